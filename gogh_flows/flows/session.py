"""Everything a placed run needs from its process, opened once and shared by every run.

A Dask pool takes a second or two to start; a flow run should not pay it. So a session
(the pool and its ledger, the measurement log and its MLflow mirror, the features and
observations placements read) is opened once per process and fleet, owns what it opened
through one exit stack, and is closed when the process exits.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import hashlib
import logging
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from gogh_flows.flows.blocks import GpuCluster, state_dir
from gogh_flows.flows.features import FeatureStore
from gogh_flows.flows.lost_runs import deliver_lost_runs
from gogh_flows.flows.mirror import PULL_EVERY_S, SpoolFlusher
from gogh_flows.flows.observations import ObservationCache
from gogh_flows.flows.predictors import forget_predictor_sources
from gogh_flows.flows.startup import starting
from gogh_flows.runtime.pool import GpuPool, open_pool
from gogh_flows.runtime.probe import probe_scheduler
from gogh_flows.tracking.backend import masked_uri
from gogh_flows.tracking.measurements import MeasurementLog
from gogh_flows.truth import load_truth

log = logging.getLogger("gogh_flows")


def _pool_detail(cluster: GpuCluster) -> str:
    if cluster.mode == "emulated":
        fleet = ", ".join(f"{t}={n}" for t, n in cluster.fleet.items())
        return f"emulated: {fleet}, one worker thread per GPU"
    if cluster.mode == "local-cuda":
        cap = (f", power cap {cluster.power_cap_w:g} W" if cluster.power_cap_w is not None else
               f", power cap {cluster.power_cap_fraction:g} of default" if cluster.power_cap_fraction is not None
               else ", runs set their board's power limit" if cluster.run_power_limits else "")
        return f"local-cuda: one dask-cuda worker process per NVIDIA GPU{cap}"
    return f"remote: the Dask scheduler at {cluster.address}"


@dataclass
class Session:
    """One process's resources for one fleet and tracking store; closing it closes what it opened."""

    cluster: GpuCluster
    pool: GpuPool
    measurements: MeasurementLog
    observations: ObservationCache
    features: FeatureStore
    root: Path
    mirror: SpoolFlusher
    truth: object = None  # the emulated fleet's ground truth (None on real GPUs)
    released: threading.Condition = field(default_factory=threading.Condition)
    _resources: ExitStack = field(default_factory=ExitStack)
    #: (job type, GPU type) of this process's placed runs whose measurement is not in the table yet
    _measuring: Counter = field(default_factory=Counter)

    @classmethod
    def open(cls, cluster: GpuCluster, tracking_uri: str) -> Session:
        """Open the pool, the measurement log and its mirror; anything opened is closed if a later step fails."""
        root = state_dir()
        root.mkdir(parents=True, exist_ok=True)
        if cluster.mode == "emulated":
            with starting("the emulated fleet's throughput table",
                          f"{cluster.truth}, {', '.join(cluster.fleet)}"):
                truth = _truth_for(cluster)
        else:
            truth = None
        with ExitStack() as stack:
            lease = cluster.lease_timeout_s
            # the pool opens in a context of its own: Dask's threads and event loop started here keep
            # the context they start in, and the first flow run's (its Prefect client, closed when
            # that run ends) was what every later sync body saw: "the client has been closed" for
            # any subflow, artifact or Variable from the second run on (a Prefect user's review)
            def opened() -> GpuPool:
                if cluster.mode == "emulated":
                    return open_pool("emulated", fleet=cluster.fleet, truth=truth, capacity=cluster.capacity,
                                     time_scale=cluster.time_scale, seed=cluster.seed, lease_timeout_s=lease)
                if cluster.mode == "local-cuda":
                    return open_pool("local-cuda", capacity=cluster.capacity, lease_timeout_s=lease,
                                     power_cap_w=cluster.power_cap_w, power_cap_fraction=cluster.power_cap_fraction,
                                     run_power_limits=cluster.run_power_limits)
                return open_pool("remote", address=cluster.address, lease_timeout_s=lease)

            with starting("the Dask GPU pool", _pool_detail(cluster)):
                pool = contextvars.Context().run(opened)
            stack.callback(pool.close)
            _say_if_alone(cluster)
            stack.enter_context(local_pool_mark(cluster))
            _say_if_shared_without_a_server(cluster)
            _say_if_the_ledger_keeps_another_lease(cluster, pool)
            with starting("the MLflow measurement store", masked_uri(tracking_uri)):
                measurements = MeasurementLog(tracking_uri, root / "measurements")
            stack.callback(measurements.flush_spool)  # what is left at exit, after the mirror stopped
            # a shared pool outlives its placing processes: a lost one's runs (and what they
            # measured) are kept by the pool's ledger and ended here (a local pool dies with its process)
            collect = None
            if cluster.mode == "remote":
                pool.ledger.store = measurements.store
                collect = functools.partial(_collect_or_reconnect, cluster, tracking_uri, pool, measurements)
            # a shared pool's placing processes (a team's machines) learn from each other's runs
            # through the store; a local pool's table is the store's already
            mirror = SpoolFlusher(measurements, collect=collect,
                                  pull_every_s=PULL_EVERY_S if cluster.mode == "remote" else None)
            stack.callback(mirror.stop)
            session = cls(cluster=cluster, pool=pool, measurements=measurements,
                          observations=ObservationCache(measurements, pool.emulated_by_type), features=FeatureStore(root / "jobs", shared=lambda: pool.ledger),
                          root=root, mirror=mirror, truth=truth, _resources=stack.pop_all())
        return session

    def notify_released(self) -> None:
        # one slot was freed: wake one waiting run (waking all of them makes every waiting
        # run re-solve at once; the others still retry every poll_s)
        with self.released:
            self.released.notify(1)

    def begin_measuring(self, job_type: str, gpu_type: str) -> None:
        """A run of this process was placed: until its measurement is in the table, no run of its
        type is offered a trial limit on that GPU type (the trial would not see its result)."""
        with self.released:
            self._measuring[(job_type, gpu_type)] += 1

    def end_measuring(self, job_type: str, gpu_type: str) -> None:
        with self.released:
            self._measuring[(job_type, gpu_type)] -= 1
            if self._measuring[(job_type, gpu_type)] <= 0:
                del self._measuring[(job_type, gpu_type)]

    def measuring(self) -> frozenset[tuple[str, str]]:
        """(job type, GPU type) of the runs this process placed whose measurement is still to come."""
        with self.released:
            return frozenset(self._measuring)

    def wait_for_release(self, timeout: float) -> None:
        """Sleep until a run of this process frees a slot, or ``timeout`` (other processes: polled)."""
        with self.released:
            self.released.wait(timeout)

    def close(self) -> None:
        """Stop the mirror, flush what it left, close the pool (each even if an earlier one failed)."""
        self._resources.close()


def _truth_for(cluster: GpuCluster):
    if cluster.mode != "emulated":
        return None
    if cluster.truth == "synthetic":
        from gogh_flows.truth.synthetic import synthetic_table

        return synthetic_table(list(cluster.fleet), seed=cluster.seed, boards=cluster.boards)
    return load_truth(cluster.truth)


_SESSIONS: dict[str, Session] = {}
_LOCK = threading.Lock()
_RECONNECTING: set[int] = set()  # pools (by id) a mirror is reconnecting now


def _scheduler_lost(session: Session) -> bool:
    """True when the remote pool's Dask client gave up on its scheduler for good.

    Dask reconnects by itself while the scheduler is back within the client's timeout; past
    that it closes the client, and every later placement of this process would fail. A
    scheduler restarted after longer (a machine rebooted) is then reached with a new session.
    """
    return session.cluster.mode == "remote" and _client_closed(session.pool)


def _client_closed(pool: GpuPool) -> bool:
    client = getattr(pool, "client", None)
    return client is not None and client.status in ("closing", "closed")


def _collect_or_reconnect(cluster: GpuCluster, tracking_uri: str, pool: GpuPool,
                          measurements: MeasurementLog) -> object:
    """What the mirror does every few seconds on a remote pool: deliver what lost placing
    processes left in the ledger for this store. Once Dask gave up on the scheduler, a process
    that places nothing more would never notice (only a new run replaces its session) and
    would leave those measurements waiting: reconnect it as soon as the scheduler answers."""
    if not _client_closed(pool):
        return deliver_lost_runs(pool.ledger, measurements)
    probe_scheduler(cluster.address, 5.0)  # SchedulerUnreachable while it is still away: try again later
    with _LOCK:
        if not any(s.pool is pool for s in _SESSIONS.values()):
            return None  # not a shared session (or already replaced): its owner reconnects it
        if id(pool) in _RECONNECTING:
            return None  # one try at a time: an open that fails takes its client's timeout
        _RECONNECTING.add(id(pool))
    # not from this thread: replacing the session stops this mirror, which waits for its thread
    threading.Thread(target=_reconnect, args=(cluster, tracking_uri, id(pool)), name="gogh-reconnect",
                     daemon=True).start()
    return None


def _reconnect(cluster: GpuCluster, tracking_uri: str, pool_id: int) -> None:
    try:
        shared_session(cluster, tracking_uri)
    except Exception as exc:  # noqa: BLE001 - the lost session's mirror tries again in a few seconds
        log.warning("gogh: connecting again to the Dask scheduler at %s failed (%s); trying again in a few "
                    "seconds", cluster.address, exc)
    finally:
        with _LOCK:
            _RECONNECTING.discard(pool_id)


def shared_session(cluster: GpuCluster, tracking_uri: str) -> Session:
    """The process-wide session of a fleet and tracking store (opened on first use, and again
    when its remote scheduler was lost for longer than Dask reconnects)."""
    key = f"{cluster.key()}|{tracking_uri}|{state_dir()}"
    stale = None
    with _LOCK:
        session = _SESSIONS.get(key)
        if session is not None and _scheduler_lost(session):
            log.warning("gogh: the connection to the Dask scheduler at %s was lost and Dask stopped reconnecting; "
                        "connecting again", cluster.address)
            stale, session = session, None
        if session is None:
            # the lost session stays registered until a new one is open: if opening fails, its
            # mirror (still running, and closed at exit) tries again, and so does the next run
            session = _SESSIONS[key] = Session.open(cluster, tracking_uri)
    if stale is not None:  # its runs have failed with the connection; what they measured is on disk
        try:
            stale.close()
        except Exception as exc:  # noqa: BLE001 - the new session serves either way
            log.warning("gogh: closing the session of the lost scheduler connection failed: %s", exc)
    return session


def close_all() -> None:
    """Close every session this process opened (also runs at exit)."""
    with _LOCK:
        sessions = list(_SESSIONS.values())
        _SESSIONS.clear()
    forget_predictor_sources()
    for session in sessions:
        try:
            session.close()
        except Exception as exc:  # closing must not hide the real outcome of a program
            log.warning("gogh: closing a GPU pool failed: %s", exc)


atexit.register(close_all)


def open_sessions() -> Mapping[str, Session]:
    return dict(_SESSIONS)


__all__ = ["Session", "close_all", "local_pool_mark", "open_sessions", "shared_session", "starting"]


def _say_if_shared_without_a_server(cluster: GpuCluster) -> None:
    """Warn when a shared pool is placed onto from a process with no ``PREFECT_API_URL``.

    Placements are safe (the ledger is the pool's), but this process's flow runs go to a
    temporary Prefect server of its own, which the team's UI and the other hosts never see. A
    rehearsal on one machine ran that way without a word (workers elsewhere are refused: they
    could not reach the server), so the first real host found out late (a review)."""
    from prefect.settings import PREFECT_API_URL

    if cluster.mode == "remote" and not PREFECT_API_URL.value():
        log.warning("gogh: placing onto the shared pool at %s with no PREFECT_API_URL: this process's flow runs go "
                    "to a temporary Prefect server of its own, which the other hosts and your Prefect UI do not see. "
                    "Set PREFECT_API_URL to the team's server (docs/runtime.md, 'A team on three machines')",
                    cluster.address)


#: this process's marks of its process-local pools, one lock per path: a FileLock is recursive, so
#: each session of this process that holds the mark holds one count of it
_MARKS: dict[str, FileLock] = {}
_MARKS_LOCK = threading.Lock()


def _mark_path(cluster: GpuCluster) -> Path:
    """One mark per set of GPUs two processes could both place onto: a local-cuda pool's are the
    boards this process sees (whatever its GOGH_HOME: per user and ``CUDA_VISIBLE_DEVICES``, in
    the temp folder; processes given different ones, or different temp folders, are not compared);
    an emulated fleet's are per fleet and state folder, where both processes' measurements go."""
    if cluster.mode == "local-cuda":  # the GPUs this process sees: split by CUDA_VISIBLE_DEVICES, none shared
        uid = os.getuid() if hasattr(os, "getuid") else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(" ", "")
        digest = hashlib.sha256(visible.encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"gogh-flows-{uid}-local-cuda-{digest}.lock"
    digest = hashlib.sha256(cluster.key().encode()).hexdigest()[:12]
    return state_dir() / "locks" / f"local-pool-{digest}.lock"


@contextmanager
def local_pool_mark(cluster: GpuCluster) -> Iterator[None]:
    """Hold a mark while this process has a process-local pool open, and warn when another
    process already holds one for the same GPUs.

    Two processes each with a local pool (two terminals, two cron jobs on one GPU box) placed
    onto the same GPU at once, each with a ledger of its own, and each run was measured as if
    alone, without a word; on ``local-cuda`` both used the same real boards (a review). Not
    refused: processes may split a machine's GPUs between them (``CUDA_VISIBLE_DEVICES``).
    The mark is an OS file lock, released when the process ends however it ends.
    """
    if cluster.mode == "remote":
        yield
        return
    path = _mark_path(cluster)
    counted = False  # whether this session holds a count of the mark (one that warned holds none)
    with _MARKS_LOCK:
        # a session may close in another thread; this process's other sessions hold the same lock
        lock = _MARKS.setdefault(str(path), FileLock(str(path), timeout=0, thread_local=False))
        first = not lock.is_locked
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()  # counted again if this process holds it already; refused if another does
        except FileLockTimeout:
            _say_another_process_has_it(cluster, path)
        except OSError as exc:  # a folder that cannot be written, a file system without locks
            log.debug("gogh: no mark for this process-local pool (%s): another process's is not looked for", exc)
        else:
            counted = True
            if first:
                _write_owner(path)
    try:
        yield
    finally:
        if counted:
            with _MARKS_LOCK:
                lock.release()


def _owner_file(path: Path) -> Path:
    return path.with_suffix(".pid")


def _write_owner(path: Path) -> None:
    try:
        _owner_file(path).write_text(f"{os.getpid()}\n")
    except OSError:  # the warning names the process where it can; the mark works without it
        pass


def _say_another_process_has_it(cluster: GpuCluster, path: Path) -> None:
    try:
        pid = _owner_file(path).read_text().strip()
    except OSError:
        pid = ""
    who = f"process {pid}" if pid else "another process"
    same = ("the same GPUs of this machine" if cluster.mode == "local-cuda"
            else "the same emulated fleet, with measurements in the same state folder")
    log.warning(
        "gogh: %s of this machine already has a process-local pool (%s) open for %s: the two processes place onto "
        "it with ledgers of their own, so their runs do not see each other (two runs may share one GPU beyond its "
        "capacity) and each is measured as if alone. To place from more than one process, start a shared pool "
        "(dask scheduler --preload gogh_flows.runtime.ledger, one dask worker per GPU) and use "
        "GpuCluster(mode='remote', address=...): docs/user-guide.md, 'Modes' (its lock: %s)",
        who, cluster.mode, same, path)


def _say_if_the_ledger_keeps_another_lease(cluster: GpuCluster, pool: GpuPool) -> None:
    """Warn when a shared pool's ledger frees a silent holder's GPU after another time than the block
    asks: the ledger lives on the scheduler, with the timeout its ``--preload`` read there
    (``GOGH_LEASE_TIMEOUT_S``) or that the first client to register it asked, and a block's
    ``lease_timeout_s`` has no effect on it afterwards; this went unsaid (a review)."""
    if cluster.mode != "remote":
        return
    kept = float(pool.ledger.lease_timeout_s)  # what the ledger answered when the pool opened
    if abs(kept - cluster.lease_timeout_s) > 1e-9:
        log.warning("gogh: the pool's ledger at %s frees a silent holder's GPU after %g s, and this block asks for "
                    "lease_timeout_s=%g, which has no effect on it: the ledger keeps the timeout it was started with "
                    "(GOGH_LEASE_TIMEOUT_S where the scheduler runs with --preload gogh_flows.runtime.ledger, or the "
                    "first client's when it was started without). Set the block's to %g, or restart the scheduler "
                    "with the one you want", cluster.address, kept, cluster.lease_timeout_s, kept)


def _say_if_alone(cluster: GpuCluster) -> None:
    """Warn when a process-local pool opens in a process a Prefect runner or worker started for
    one flow run (``serve``, ``deploy``): every such run gets a pool and a ledger of its own, so
    runs of the deployment that overlap do not see each other (on ``local-cuda``, the same real
    GPUs are placed onto by each), and each is measured as if alone. A shared pool is the fix."""
    # a worker's or `prefect flow-run execute`'s process has the flow run's id; one that `serve`
    # starts (Prefect 3.8: runner/_starter_direct.py) has only the deployment's name
    started_for_a_run = os.environ.get("PREFECT__FLOW_RUN_ID") or os.environ.get("PREFECT__DEPLOYMENT_NAME")
    if cluster.mode == "remote" or not started_for_a_run:
        return
    same = ("the same GPUs of this machine" if cluster.mode == "local-cuda"
            else "an emulated fleet of their own")
    log.warning(
        "gogh: this flow run was started in a process of its own by a Prefect runner or worker (serve, deploy) "
        "and opens a pool of its own in it (%s): other runs started the same way each place onto %s with a ledger of "
        "their own, so runs that overlap do not see each other and are measured as if alone. For a "
        "deployment that may run more than one flow run at a time, start a shared pool (dask scheduler "
        "--preload gogh_flows.runtime.ledger, one dask worker per GPU) and use GpuCluster(mode='remote', "
        "address=...): docs/user-guide.md, 'Modes'", cluster.mode, same)

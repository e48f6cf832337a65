"""A pool of GPUs on Dask: one worker per GPU, runs pinned to the chosen one.

Three modes share one interface, so the flow layer never branches on where the
GPUs are:

* ``emulated``: a Dask cluster on this machine with one worker per *declared*
  GPU (``"v100=2,t4=1"``); bodies run on CPU and telemetry comes from the truth
  table and energy model. Threads by default: process workers would each start
  their own ephemeral Prefect server (DESIGN s8).
* ``local-cuda``: ``dask_cuda.LocalCUDACluster``, one worker process per board
  found by NVML, given by UUID, its own board first in its CUDA_VISIBLE_DEVICES (``cuda:0``).
* ``remote``: an existing scheduler whose workers each advertise one GPU by
  name and resources (see docs/runtime.md for the worker command line).

Capacity is enforced by Dask itself: each worker offers ``slot=capacity`` and
every run asks for ``slot=1``, so no more than ``capacity`` bodies ever run on
one GPU even if the caller's bookkeeping is wrong.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import multiprocessing
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dask
from distributed import Client, Future

from gogh_flows.catalog import UnknownGpuTypeError, get_gpu_type
from gogh_flows.energy import EnergyModel
from gogh_flows.runtime.devices import GpuDevice, device_id, fleet_devices, split_device_id
from gogh_flows.runtime.emulation import check_time_scale
from gogh_flows.runtime.leases import PoolLedger
from gogh_flows.runtime.outcome import RunOutcome
from gogh_flows.runtime.probe import probe_scheduler
from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS
from gogh_flows.runtime.worker import PLUGIN_NAME, RunSpec, RuntimeConfig, describe_worker, execute
from gogh_flows.truth.table import ThroughputTable

__all__ = [
    "MODES",
    "START_TIMEOUT_S",
    "GpuPool",
    "PoolStartTimeout",
    "UnknownDeviceError",
    "discover_workers",
    "emulated_pool",
    "local_cuda_pool",
    "open_pool",
    "remote_pool",
]

log = logging.getLogger("gogh_flows.runtime")
MODES = ("emulated", "local-cuda", "remote")
CUDA_HINT = "install gogh-flows[cuda] (pip install 'gogh-flows[cuda]') on a machine with an NVIDIA GPU and driver"

#: the longest a local pool of worker processes may take to start (``GOGH_POOL_START_TIMEOUT_S``)
START_TIMEOUT_S = 60.0


class UnknownDeviceError(KeyError, ValueError):
    """A gpu_id the pool does not have."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _check_limit(watts: float, device: GpuDevice, *, emulated: bool) -> None:
    """A run's board limit, refused before it reaches a worker when it cannot be one: an
    emulated board enacts exactly what it is given, so outside the type's range it would run
    slower than any board can (a real board's limit is clamped to what NVML allows)."""
    if isinstance(watts, bool) or not isinstance(watts, int | float) or not math.isfinite(watts) or watts <= 0:
        raise ValueError(f"power_limit_w must be watts > 0 or None (the maximum), got {watts!r}")
    if emulated:
        from gogh_flows.catalog import get_gpu_type

        rng = get_gpu_type(device.gpu_type).power_limit_range_w
        if rng is not None and not rng[0] - 1e-6 <= watts <= rng[1] + 1e-6:
            raise ValueError(f"power_limit_w={watts:g} W is outside {device.gpu_type}'s range {rng[0]:g}-{rng[1]:g} W "
                             f"(the catalog's); give a limit in it, or None for the maximum")


@dataclass(frozen=True)
class _Known:
    """What one discovery found: the devices, their workers (pins) and which are emulated.
    Replaced whole, never changed, so no reader sees one discovery's devices with another's kinds."""

    devices: tuple[GpuDevice, ...]
    by_id: dict[str, GpuDevice]
    pins: dict[str, Any]
    emulated: frozenset[str]


class GpuPool:
    """GPUs on a Dask cluster; a context manager that closes what it owns.

    Build one with :func:`emulated_pool`, :func:`local_cuda_pool`,
    :func:`remote_pool` or :func:`open_pool`. ``pins`` maps a device id to the
    worker name object Dask knows (an ``int`` for dask-cuda workers), which may
    differ from the string kept in ``GpuDevice.worker``.
    """

    def __init__(self, *, mode: str, devices: Sequence[GpuDevice], client: Client, cluster: Any = None,
                 owns_client: bool = True, emulated: frozenset[str] | None = None,
                 pins: Mapping[str, Any] | None = None, lease_timeout_s: float | None = None,
                 sample_interval_s: float = 0.1) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown pool mode {mode!r}; choose one of {', '.join(MODES)}")
        if not devices:
            raise ValueError("a GPU pool needs at least one device")
        self.mode = mode
        self.client = client
        self.cluster = cluster
        self._owns = owns_client
        by_id = {d.id: d for d in devices}
        if len(by_id) != len(devices):
            raise ValueError(f"duplicate device ids in {[d.id for d in devices]}")
        self._known = _Known(tuple(devices), by_id, {d.id: (pins or {}).get(d.id, d.worker) for d in devices},
                             frozenset(by_id) if emulated is None else frozenset(emulated))
        self._closed = False
        self._lease_timeout_s = lease_timeout_s
        self._ledger: PoolLedger | None = None
        self._ledger_lock = threading.Lock()
        self._rediscover: Callable[[], Discovery] | None = None
        self._seen_workers = {d.worker for d in self.devices}
        self._left_out: set[str] = set()  # workers seen that advertise no usable GPU
        self._discovered_at = time.monotonic()
        #: seconds between a real board's power samples (NVML), for the runs this pool starts
        self.sample_interval_s = sample_interval_s
        #: run once the pool's own cluster has stopped (and no longer at the process's exit)
        self._at_close: list[Callable[[], None]] = []

    @property
    def ledger(self) -> PoolLedger:
        """The slot ledger every process placing onto this pool shares (kept by its scheduler)."""
        with self._ledger_lock:
            if self._ledger is None:
                self._ledger = PoolLedger(self.client, lease_timeout_s=self._lease_timeout_s)
            return self._ledger

    def live_devices(self, workers: frozenset[str] | set[str]) -> tuple[GpuDevice, ...]:
        """The devices whose worker is in ``workers`` (the scheduler's membership now).

        A remote pool first re-reads what the workers advertise when a worker it does not
        know has joined, so a long-lived process follows the pool as it changes.
        """
        if self._stale(workers):
            with self._ledger_lock:
                if self._stale(workers):  # another placement may have re-read it meanwhile
                    self._learn(self._rediscover())  # type: ignore[misc]
                    self._seen_workers |= set(workers)
        return tuple(d for d in self.devices if d.worker in workers)

    def _stale(self, workers: frozenset[str] | set[str]) -> bool:
        """A worker joined that was never looked at, or one left out (misconfigured) is still
        there and :data:`RECHECK_LEFT_OUT_S` have passed: it may have been fixed and restarted
        under the same name, which the scheduler's membership alone does not show."""
        if self._rediscover is None:
            return False
        if not set(workers) <= self._seen_workers:
            return True
        return bool(self._left_out & set(workers)) and time.monotonic() - self._discovered_at >= RECHECK_LEFT_OUT_S

    def _learn(self, found: Discovery) -> None:
        devices, pins, emulated, names, left_out = found
        # one assignment: a placement reading the pool meanwhile sees the old view or the new one
        self._known = _Known(tuple(devices), {d.id: d for d in devices}, dict(pins), frozenset(emulated))
        self._seen_workers = set(names)
        self._left_out = set(left_out)
        self._discovered_at = time.monotonic()

    # -- lookups ---------------------------------------------------------------------
    @property
    def devices(self) -> tuple[GpuDevice, ...]:
        return self._known.devices

    @property
    def _by_id(self) -> dict[str, GpuDevice]:
        return self._known.by_id

    @property
    def _pins(self) -> dict[str, Any]:
        return self._known.pins

    @property
    def _emulated(self) -> frozenset[str]:
        return self._known.emulated

    @property
    def address(self) -> str:
        """The scheduler's address (``inproc://`` for a threaded emulated pool)."""
        return self.client.scheduler.address

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(self._by_id)

    def device(self, gpu_id: str) -> GpuDevice:
        try:
            return self._by_id[gpu_id]
        except KeyError:
            raise UnknownDeviceError(
                f"no GPU {gpu_id!r} in this {self.mode} pool; its GPUs are: {', '.join(self._by_id)}"
            ) from None

    def is_emulated(self, gpu_id: str) -> bool:
        return self.device(gpu_id).id in self._emulated

    def emulated_by_type(self) -> dict[str, bool | None]:
        """GPU type -> whether this pool's boards of it are emulated (True) or real (False), None
        for a type with both. What a placement may learn from: a run measured on an emulated
        board describes the emulator's truth, not a real board of its type."""
        kinds: dict[str, set[bool]] = {}
        known = self._known  # devices and their kinds from one discovery
        for d in known.devices:
            kinds.setdefault(d.gpu_type, set()).add(d.id in known.emulated)
        return {t: next(iter(k)) if len(k) == 1 else None for t, k in kinds.items()}

    def fleet(self) -> dict[str, int]:
        """GPU count per type, e.g. ``{"v100": 2, "t4": 1}``."""
        out: dict[str, int] = {}
        for d in self.devices:
            out[d.gpu_type] = out.get(d.gpu_type, 0) + 1
        return out

    # -- running ---------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, gpu_id: str, job_type: str | None = None,
               partners: Sequence[str] | Callable[[], Sequence[str]] | None = None,
               run_id: str | None = None, hold_lease: bool = False,
               record_if_placer_lost: Callable[[RunOutcome], tuple[str, dict]] | None = None,
               warmup_steps: float = DEFAULT_WARMUP_STEPS, power_limit_w: float | None = None,
               features: Any = None, required_throughput: float | None = None, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the worker pinned to ``gpu_id``; a Future of :class:`RunOutcome`.

        ``job_type`` names the workload for the emulator and the outcome;
        ``partners`` overrides the co-located job types the worker tracks (for
        partners this pool does not run); ``run_id`` is carried into the
        outcome and the Dask key; with ``hold_lease`` the worker holds the
        ledger lease named ``run_id`` while the body runs (and starts the body
        only if that lease is still held), and ``record_if_placer_lost(outcome)``
        builds the run's measurement on the worker, handed to the ledger, when the
        placing process is lost before the body ends; ``warmup_steps`` are the steps before the
        run's steady-state measurement window opens; ``power_limit_w`` is the board limit its
        placement chose (None: the maximum), the board's limit from the run's start (the emulator
        enacts it; a real GPU when the pool was opened with ``run_power_limits``, else it is logged
        as not applied); ``features`` (the job's layer
        features) let an emulated fleet run a job type its truth lacks, from the synthetic
        fleet; ``required_throughput`` (steps/s) has a board whose limit leaves the run below it
        go back to its full limit (:class:`~gogh_flows.runtime.worker.LimitGuard`). These names
        are taken by ``submit``: pass a body keyword argument with the same name through
        ``functools.partial``.
        """
        if self._closed:
            raise RuntimeError("this GPU pool is closed; open a new one")
        device = self.device(gpu_id)
        if required_throughput is not None and not required_throughput > 0:
            raise ValueError(f"required_throughput must be > 0 steps/s or None, got {required_throughput!r}")
        if power_limit_w is not None:
            _check_limit(power_limit_w, device, emulated=device.id in self._emulated)
        key = f"gogh-{device.id}-{run_id or getattr(fn, '__name__', 'run')}-{uuid.uuid4().hex[:12]}"
        spec = RunSpec(device=device, mode=self.mode, emulated=device.id in self._emulated, run_key=key,
                       job_type=job_type, run_id=run_id, partners=partners, hold_lease=hold_lease,
                       record_if_placer_lost=record_if_placer_lost, warmup_steps=warmup_steps,
                       required_throughput=required_throughput,
                       power_limit_w=power_limit_w, features=features,
                       sample_interval_s=self.sample_interval_s)
        if hold_lease:
            if not run_id:
                raise ValueError("GpuPool.submit(hold_lease=True) needs the run_id its lease was claimed under")
            self.ledger  # noqa: B018 - the scheduler must have the ledger before a worker asks it
        return self.client.submit(
            execute, fn, args, kwargs, spec, key=key, workers=[self._pins[device.id]],
            allow_other_workers=False, resources={"slot": 1}, pure=False,
        )

    def run(self, fn: Callable[..., Any], *args: Any, gpu_id: str, **kwargs: Any) -> RunOutcome:
        """:meth:`submit` and wait: the :class:`RunOutcome` (the body's error stays inside it)."""
        return self.submit(fn, *args, gpu_id=gpu_id, **kwargs).result()

    def configure(self, *, truth: ThroughputTable | None = None, time_scale: float = 0.0,
                  energy: EnergyModel | None = None, timeout_s: float | None = None) -> None:
        """Ship emulator settings to every worker (replaces earlier settings).

        Dask sends a worker plugin to every worker and waits for all of them: one stopped or
        hung ``dask worker`` held the pool's opening until the scheduler dropped it (5 minutes).
        After ``timeout_s`` (:data:`CONFIGURE_TIMEOUT_S`) this goes on with a warning: the
        scheduler keeps the settings and the silent worker takes them when it answers again
        (pool discovery leaves such a worker out until then). A worker that answers with an
        error still raises it."""
        check_time_scale(time_scale)
        plugin = RuntimeConfig(truth, time_scale, energy)
        timeout_s = CONFIGURE_TIMEOUT_S if timeout_s is None else timeout_s
        gave_up = threading.Event()

        def register() -> None:
            try:
                self.client.register_plugin(plugin, name=PLUGIN_NAME)
            except BaseException as exc:  # raised to the caller in time; said if it stopped waiting
                if gave_up.is_set():
                    log.warning("gogh: a worker answered the emulator's settings late, with an error: %s", exc)
                raise

        if not _call_within(register, timeout_s, "gogh-configure"):
            gave_up.set()
            log.warning("gogh: not every worker took the emulator's settings within %g s (a stopped or busy "
                        "dask worker); the scheduler keeps them and gives them to it when it answers", timeout_s)

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Close the client; and the cluster when this pool started it (not a remote one)."""
        if self._closed:
            return
        self._closed = True
        if self._ledger is not None:
            self._ledger.close()
        if self._owns:
            self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        for hook in self._at_close:
            atexit.unregister(hook)
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - closing goes on; the hook says what it could not do
                log.error("gogh: after closing the pool: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> GpuPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GpuPool(mode={self.mode!r}, devices={list(self._by_id)}, address={self.address!r})"


def _check_truth_covers(truth: ThroughputTable, types: Sequence[str]) -> None:
    missing = sorted(set(types) - set(truth.gpu_types))
    if missing:
        raise ValueError(
            f"the truth table ({truth.source}) has no data for GPU type(s) {missing}; it covers "
            f"{', '.join(truth.gpu_types)}. Pass a truth table that covers the fleet, or use the synthetic "
            "one, which covers every catalog type (GpuCluster(truth='synthetic'), the default; truth=None for "
            "emulated_pool)."
        )


def emulated_pool(fleet: Mapping[str, int] | str, *, truth: ThroughputTable | None = None, capacity: int = 2,
                  time_scale: float = 0.0, processes: bool = False, seed: int = 0,
                  energy: EnergyModel | None = None, silence_logs: int = logging.ERROR,
                  lease_timeout_s: float | None = None) -> GpuPool:
    """A local Dask cluster emulating ``fleet``: one worker per GPU, named by its device id.

    ``truth`` (default: the synthetic fleet over the declared types, seeded by
    ``seed``) gives the emulated throughputs; ``time_scale`` is wall seconds
    slept per emulated second (0 = none). ``processes=True`` runs each worker in
    its own process behind a nanny (tcp); never do that against an ephemeral
    Prefect server.
    """
    from distributed import Nanny, Scheduler, SpecCluster, Worker

    if not time_scale >= 0:
        raise ValueError(f"time_scale must be >= 0 (0 = do not sleep), got {time_scale!r}")
    if processes:  # thread workers start no process: nothing re-imports the main script
        from gogh_flows.runtime.main_guard import check_main_guard

        check_main_guard("emulated GPU worker processes (emulated_pool(processes=True))")
    devices = fleet_devices(fleet, capacity=capacity)
    types = sorted({d.gpu_type for d in devices})
    if truth is None:
        from gogh_flows.truth.synthetic import synthetic_table

        truth = synthetic_table(types, seed=seed)
    _check_truth_covers(truth, types)
    protocol = "tcp" if processes else "inproc"
    worker_cls = Nanny if processes else Worker
    workers = {
        d.worker: {"cls": worker_cls, "options": {"name": d.worker, "nthreads": capacity,
                                                   "resources": {"slot": capacity}, "protocol": protocol,
                                                   **({"host": "127.0.0.1"} if processes else {})}}
        for d in devices
    }
    scheduler = {"cls": Scheduler, "options": {"protocol": protocol, "dashboard": False,
                                               "dashboard_address": ":0",
                                               **({"host": "127.0.0.1"} if processes else {})}}
    # Dask's statistical profiler samples every thread's Python frames 10 ms apart; with bodies
    # running in the workers' threads of this very process that sampling crashed the
    # interpreter once (a segfault in Worker.trigger_profile on CPython 3.11, seen in a test
    # run). An emulated pool has nothing to profile, so it runs without it.
    options = {"workers": workers, "scheduler": scheduler, "silence_logs": silence_logs, "name": "gogh-emulated"}
    # worker processes may never start (a script without its __main__ guard): bounded; threads start at once
    deadline = time.monotonic() + (_start_timeout() if processes else 60.0)
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        if processes:
            cluster = _start_within(SpecCluster, options, deadline=deadline,
                                    what=f"an emulated pool of {len(devices)} worker process(es)")
        else:
            cluster = SpecCluster(**options)
    try:
        client = Client(cluster, set_as_default=False)
        try:
            client.wait_for_workers(len(devices), timeout=max(1.0, deadline - time.monotonic()))
            pool = GpuPool(mode="emulated", devices=devices, client=client, cluster=cluster,
                           lease_timeout_s=lease_timeout_s)
            pool.configure(truth=truth, time_scale=time_scale, energy=energy)
        except BaseException:
            client.close()
            raise
    except BaseException:
        cluster.close()
        raise
    return pool


def _visible_index(cluster: Any, client: Client) -> dict[Any, str]:
    """Worker name -> first CUDA_VISIBLE_DEVICES entry (its own board)."""
    out: dict[Any, str] = {}
    for name, spec in getattr(cluster, "worker_spec", {}).items():
        env = (spec.get("options") or {}).get("env") or {}
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible:
            out[name] = str(visible).split(",")[0].strip()
    if out:
        return out
    info = client.scheduler_info()["workers"]
    env = client.run(describe_worker)
    return {info[a]["name"]: (e["cuda_visible_devices"] or "").split(",")[0].strip()
            for a, e in env.items() if a in info}


def _start_timeout(value: float | None = None) -> float:
    """The start-up bound: ``value``, else ``GOGH_POOL_START_TIMEOUT_S``, else 60 s."""
    from gogh_flows.runtime.settings import seconds

    return seconds("GOGH_POOL_START_TIMEOUT_S", START_TIMEOUT_S, "how long a pool's worker processes may take "
                   "to start", value=value, argument="start_timeout_s")


class PoolStartTimeout(TimeoutError):
    """A local cluster of worker processes did not start in time (and what it started was closed)."""


def _stop_children(children: list[Any], grace_s: float = 3.0) -> None:
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        child.join(grace_s)
        if child.is_alive():
            child.kill()
            child.join(grace_s)


def _start_within(factory: Callable[..., Any], options: Mapping[str, Any], *, deadline: float, what: str) -> Any:
    """``factory(**options)`` (a Dask cluster class), given up at ``deadline``.

    A cluster's constructor waits for its worker processes, and one whose worker cannot
    start may wait without end (seen: more than 7 minutes with dask-cuda). So it runs on a
    thread of its own; past the deadline, the half-built cluster is closed (bounded too), any
    process it started is stopped, and :class:`PoolStartTimeout` says what was being started,
    how long it waited and the likely causes.
    """
    from gogh_flows.runtime.main_guard import KEEP_NOTE, guard_advice, unguarded_call

    before = set(multiprocessing.active_children())
    box: dict[str, Any] = {}
    try:
        box["cluster"] = factory.__new__(factory) if isinstance(factory, type) else None
    except TypeError:
        box["cluster"] = None

    def build() -> None:
        if box["cluster"] is not None:
            box["cluster"].__init__(**options)
        else:
            box["cluster"] = factory(**options)

    started = time.monotonic()
    if _call_within(build, deadline - started, "gogh-pool-start"):
        return box["cluster"]
    waited = time.monotonic() - started
    closed = _close_within(box.get("cluster"), 10.0)
    _stop_children([c for c in multiprocessing.active_children() if c not in before])
    call = unguarded_call()
    if call is not None:
        cause = (f"The likely cause: {call.path}, line {call.line}, runs at the script's top level, outside "
                 'an `if __name__ == "__main__":` block, so every spawned worker runs it again and fails. Write:\n\n'
                 + textwrap.indent(guard_advice(call), "    ") + f"\n\n{KEEP_NOTE}")
    else:
        cause = ("Look at what the worker processes printed above. If it says \"An attempt has been made to start "
                 "a new process before the current process has finished its bootstrapping phase\", the script "
                 'that opened the pool lacks an `if __name__ == "__main__":` guard; write:\n\n'
                 + textwrap.indent(guard_advice(), "    ") + f"\n\n{KEEP_NOTE}. Otherwise a worker fails on its "
                 "own (a CUDA or driver error, a package it cannot import; start one by hand to see it), or "
                 "starting is only slow on this machine: raise the bound with GOGH_POOL_START_TIMEOUT_S "
                 "(seconds) or start_timeout_s=")
    raise PoolStartTimeout(
        f"gogh: starting {what} did not finish within {waited:.0f} s, so it was given up and "
        f"{'what it had started was closed' if closed else 'its worker processes were stopped'}. "
        f"{cause}."
    )


def _call_within(call: Callable[[], object], timeout_s: float, name: str) -> bool:
    """``call()`` on a thread of its own, waited for at most ``timeout_s``: whether it finished
    (an exception it raised in time is raised here). A daemon thread: one still waiting on
    something that never answers must not hold the interpreter's exit."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            call()
            box["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if "error" in box:
        raise box["error"]
    return bool(box.get("ok"))


def _close_within(cluster: Any, timeout_s: float) -> bool:
    """Close a (maybe half-built) cluster on a thread, waiting at most ``timeout_s``; whether it closed."""
    if cluster is None or not hasattr(cluster, "close"):
        return False

    def close() -> None:
        try:
            cluster.close(timeout=timeout_s)
        except TypeError:
            cluster.close()

    try:
        return _call_within(close, timeout_s + 2.0, "gogh-pool-close")
    except Exception as exc:  # noqa: BLE001 - best effort on a cluster that never started
        log.debug("closing a cluster that did not start: %s", exc)
        return False


def local_cuda_pool(*, capacity: int = 2, interval_s: float = 0.1, silence_logs: int = logging.ERROR,
                    lease_timeout_s: float | None = None, start_timeout_s: float | None = None,
                    power_cap_w: float | None = None, power_cap_fraction: float | None = None,
                    run_power_limits: bool = False, **cluster_options: Any) -> GpuPool:
    """One ``LocalCUDACluster`` worker per local NVIDIA board, matched to the catalog by NVML name.

    Fails fast instead of hanging: a script that would re-run itself in every spawned
    worker (no ``if __name__ == "__main__":`` guard) is refused before anything starts, and
    starting the cluster and its workers is bounded by ``start_timeout_s`` (default
    ``GOGH_POOL_START_TIMEOUT_S``, else 60 s). ``power_cap_w`` (watts) or
    ``power_cap_fraction`` (of each board's default limit) caps every board while the
    pool's workers live; off by default, see :mod:`gogh_flows.runtime.power_cap`.
    ``run_power_limits`` lets each worker set its board to the power limit its runs'
    placements chose (off by default; checked when the pool starts, put back when the board
    empties and when the worker stops, see :mod:`gogh_flows.runtime.run_limits`). Extra
    keyword arguments go to ``LocalCUDACluster``.
    """
    from gogh_flows.runtime.main_guard import check_main_guard
    from gogh_flows.runtime.power_cap import check_cap_request

    try:
        every = float(interval_s)
    except (TypeError, ValueError):
        every = math.nan
    if not (math.isfinite(every) and every > 0):
        raise ValueError(f"interval_s (seconds between a board's power samples) must be > 0, got {interval_s!r}")
    interval_s = every
    check_main_guard("dask-cuda GPU worker processes (local_cuda_pool)")
    check_cap_request(power_cap_w, power_cap_fraction, run_power_limits=run_power_limits)
    bound = _start_timeout(start_timeout_s)
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise RuntimeError(f"local-cuda mode needs dask-cuda, which is not importable ({exc}): {CUDA_HINT}") from exc
    from gogh_flows.catalog import from_nvml_name
    from gogh_flows.runtime.nvml import NvmlUnavailable, discover

    try:
        boards = discover()
    except NvmlUnavailable as exc:
        raise RuntimeError(f"local-cuda mode cannot list GPUs: {exc}. {CUDA_HINT}") from exc
    if not boards:
        raise RuntimeError(f"local-cuda mode found no NVIDIA GPU (check CUDA_VISIBLE_DEVICES); {CUDA_HINT}")
    types = [from_nvml_name(b.name).name for b in boards]  # unknown boards -> clear UnknownGpuTypeError
    caps, caps_back = _plan_caps(boards, power_cap_w, power_cap_fraction)  # range checked before any change
    restore: dict[str, float] = {}
    if run_power_limits:  # the limits to put back, read before any worker can change one
        from gogh_flows.runtime.run_limits import plan_run_limits

        restore = plan_run_limits([b.uuid or str(b.index) for b in boards])
    deadline = time.monotonic() + bound
    # each worker is given its board by UUID: an index would be read by CUDA in its own device
    # order (FASTEST_FIRST unless CUDA_DEVICE_ORDER says otherwise), not NVML's, and on a mixed
    # machine a worker could compute on one board while NVML measured and limited another
    cluster = _start_within(
        LocalCUDACluster,
        {"CUDA_VISIBLE_DEVICES": [b.uuid or b.index for b in boards], "n_workers": len(boards),
         "threads_per_worker": capacity, "resources": {"slot": capacity}, "dashboard_address": None,
         "silence_logs": silence_logs, **cluster_options},
        deadline=deadline,
        what=f"dask-cuda's LocalCUDACluster ({len(boards)} worker process(es), one per GPU: "
             + ", ".join(f"{b.index} {b.name}" for b in boards) + ")")
    client = None
    try:
        client = Client(cluster, set_as_default=False)
        try:
            client.wait_for_workers(len(boards), timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            raise PoolStartTimeout(
                f"gogh: the {len(boards)} dask-cuda worker(s) did not all join within {bound:g} s of starting the "
                "pool; it was closed. Look at what the workers printed above, or raise the bound with "
                "GOGH_POOL_START_TIMEOUT_S (seconds)") from None
        first = _visible_index(cluster, client)
        counters: dict[str, int] = {}
        devices, pins = [], {}
        for name, visible in sorted(first.items(), key=lambda kv: str(kv[0])):
            match = [i for i, b in enumerate(boards) if visible in (str(b.index), b.uuid)]
            if not match:
                raise RuntimeError(f"dask-cuda worker {name!r} sees board {visible!r}, which NVML did not list")
            b, t = boards[match[0]], types[match[0]]
            gid = device_id(t, counters.setdefault(t, 0))
            counters[t] += 1
            devices.append(GpuDevice(id=gid, gpu_type=t, worker=str(name), capacity=capacity,
                                     cuda_index=b.index, uuid=b.uuid, host="localhost"))
            pins[gid] = name
        devices.sort(key=lambda d: d.cuda_index or 0)
        if caps:
            _apply_caps(client, caps, {str(name): visible for name, visible in first.items()})
        if run_power_limits:
            from gogh_flows.runtime.run_limits import PLUGIN_NAME as LIMITS_PLUGIN
            from gogh_flows.runtime.run_limits import RunLimitsPlugin, board_of, restore_if_still_changed

            client.register_plugin(RunLimitsPlugin({str(pins[d.id]): board_of(d) for d in devices}, restore),
                                   name=LIMITS_PLUGIN)  # a worker NVML refuses fails the pool here
            # a worker killed outright cannot put its board back: this process does when the pool
            # closes, or at its exit if it never does (one hook per pool, unregistered at close, so
            # a limit someone sets after the pool closed is never undone)
            put_back = functools.partial(restore_if_still_changed, restore)
            atexit.register(put_back)
            log.info("gogh: runs set their board's power limit as placed; each board is put back when it is "
                     "empty and when its worker stops")
        pool = GpuPool(mode="local-cuda", devices=devices, client=client, cluster=cluster, pins=pins,
                       emulated=frozenset(), lease_timeout_s=lease_timeout_s, sample_interval_s=interval_s)
        if caps_back is not None:
            pool._at_close.append(caps_back)
        if run_power_limits:
            pool._at_close.append(put_back)
        return pool
    except BaseException:
        if client is not None:
            client.close()
        cluster.close()  # its workers' teardown restores any power limit they changed
        raise


def _plan_caps(boards: Sequence[Any], power_cap_w: float | None,
               power_cap_fraction: float | None) -> tuple[list[Any], Callable[[], None] | None]:
    """Each board's cap, range checked, and the hook that puts back a board a killed worker left
    capped; ``([], None)`` (and no NVML call at all) when none was asked."""
    if power_cap_w is None and power_cap_fraction is None:
        return [], None
    from gogh_flows.runtime.nvml import load_pynvml
    from gogh_flows.runtime.power_cap import plan_power_caps, restore_if_still_capped

    nvml = load_pynvml()
    plan = plan_power_caps([b.uuid or b.index for b in boards], power_cap_w=power_cap_w,
                           power_cap_fraction=power_cap_fraction, nvml=nvml)
    # a worker killed outright cannot put its board back: this process does when the pool closes
    # (the hook is then unregistered, so a limit set later is never undone), or at its exit
    put_back = functools.partial(restore_if_still_capped, plan, nvml)
    atexit.register(put_back)
    return plan, put_back


def _apply_caps(client: Client, plan: Sequence[Any], visible: Mapping[str, str]) -> None:
    """Register the power-cap plugin: each worker caps its own board now and restores it when it stops."""
    from gogh_flows.runtime.power_cap import PLUGIN_NAME as CAP_PLUGIN
    from gogh_flows.runtime.power_cap import PowerCapPlugin, caps_here, record_reported

    by_board = {}
    for cap in plan:
        by_board[cap.board] = cap
        if cap.index is not None:
            by_board[str(cap.index)] = cap
    caps = {name: by_board[board] for name, board in visible.items() if board in by_board}
    client.register_plugin(PowerCapPlugin(caps), name=CAP_PLUGIN)
    record_reported(client.run(caps_here), plan)
    log.info("gogh: GPU power capped while this pool runs: %s; restored when its workers stop",
             ", ".join(f"{c.label} at {c.cap_w:g} W (was {c.restore_w:g} W)" for c in plan))


def _remote_device(address: str, name: Any, info: Mapping[str, Any], env: Mapping[str, Any]) -> GpuDevice:
    label = str(name)
    declared = env.get("gpu_type")
    parsed = split_device_id(label)
    gpu_type = declared or (parsed[0] if parsed else None)
    if not gpu_type:
        raise ValueError(
            f"worker {label!r} ({address}) advertises no GPU type: name it <type>-<n> (e.g. --name v100-0) "
            "or set GOGH_GPU_TYPE in its environment (see docs/runtime.md)"
        )
    try:
        gpu_type = get_gpu_type(gpu_type).name
    except UnknownGpuTypeError as exc:
        raise UnknownGpuTypeError(f"worker {label!r} ({address}) advertises an unknown GPU type: {exc}") from None
    slots = (info.get("resources") or {}).get("slot")
    if slots is None:
        raise ValueError(
            f"worker {label!r} ({address}) advertises no 'slot' resource; start it with "
            "--resources slot=2 (or slot=1 for an exclusive GPU)"
        )
    capacity = _worker_slots(label, address, slots, info.get("nthreads"))
    visible = (env.get("cuda_visible_devices") or "").split(",")[0].strip()
    note = env.get("pin_note")
    if note and (label, note) not in _PIN_NOTES_SAID:
        _PIN_NOTES_SAID.add((label, note))
        log.warning("gogh: worker %s (%s): %s", label, address, note)
    # the board's NVML UUID as the worker resolved it (its CUDA index is not NVML's numbering)
    uuid = env.get("nvml_uuid") or (visible if visible.startswith("GPU-") else None)
    try:
        return GpuDevice(
            id=label, gpu_type=gpu_type, worker=label, capacity=capacity,
            cuda_index=int(visible) if visible.isdigit() else None, uuid=uuid, host=info.get("host"),
        )
    except ValueError as exc:  # said with the worker it is about and the option that sets it
        raise ValueError(f"worker {label!r} ({address}): {exc}; start it with --resources slot=2 (or slot=1 for "
                         "an exclusive GPU)") from None


def _worker_slots(label: str, address: str, slots: Any, nthreads: Any) -> int:
    """How many bodies a worker can run at once: its ``slot`` resource, but no more than its threads.

    A worker started with ``--nthreads 1 --resources slot=2`` was counted as two slots: the second
    run placed there as a pair queued behind the first and ran alone after it, measured as if
    paired, with nothing said (a review). Counted as its threads, and said once."""
    try:
        declared = float(slots)
    except (TypeError, ValueError):
        declared = math.nan
    if not (math.isfinite(declared) and declared >= 1 and declared == int(declared)):
        raise ValueError(f"worker {label!r} ({address}) advertises slot={slots!r}: a whole number of bodies at once; "
                         "start it with --resources slot=2 (or slot=1 for an exclusive GPU)")
    capacity = int(declared)
    if isinstance(nthreads, int) and 0 < nthreads < capacity:
        said = (label, f"nthreads {nthreads} < slot {capacity}")
        if said not in _PIN_NOTES_SAID:
            _PIN_NOTES_SAID.add(said)
            log.warning("gogh: worker %s (%s) has %d thread(s) for slot=%d: only %d body can run there at a time, so "
                        "it is counted as %d slot(s); start it with --nthreads %d to share its GPU (docs/runtime.md)",
                        label, address, nthreads, capacity, nthreads, nthreads, capacity)
        capacity = nthreads
    return capacity


#: (worker, warning) pairs already said about a worker (how its board was identified, its threads)
_PIN_NOTES_SAID: set[tuple[str, str]] = set()


#: (devices, pins, emulated device ids, every worker name looked at, the names left out)
Discovery = tuple[list[GpuDevice], dict[str, Any], set[str], set[str], set[str]]
#: how often a pool looks again at a worker it left out (misconfigured) while it stays: a worker
#: fixed and restarted under the same name is found within this; looking at every placement
#: re-read every worker and repeated the warning each time
RECHECK_LEFT_OUT_S = 60.0
#: how long a worker has to say what it is. A worker whose event loop is blocked (a hung or
#: stopped process, a task holding its loop) answers nothing, and Dask's ``Client.run`` waits for
#: every worker: one such worker held every placement's re-reading of the pool (and ``gogh pool
#: status``) until it came back or the scheduler dropped it, five minutes by Dask's default
DESCRIBE_TIMEOUT_S = 5.0
#: how long opening a pool waits for every worker to take the emulator's settings (``GpuPool.configure``)
CONFIGURE_TIMEOUT_S = 30.0


def _describe_workers(client: Client, addresses: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Each worker's :func:`describe_worker`, or why it gave none (a string).

    All workers are asked at once first (one broadcast); only when that does not finish in
    ``timeout_s`` is each asked apart, so that the ones that answer are not held by the one
    that does not.
    """
    import asyncio

    async def one(addr: str) -> Any:
        try:
            got = await asyncio.wait_for(client._run(describe_worker, workers=[addr], on_error="return"), timeout_s)
        except asyncio.TimeoutError:
            return (f"did not say what it is within {timeout_s:g} s (its event loop is blocked: a hung "
                    "or stopped process, or a task holding it)")
        except Exception as exc:  # it left meanwhile, or the call failed on its way
            return f"could not be asked what it is ({type(exc).__name__}: {exc})"
        return got.get(addr, "gave no answer")

    async def every() -> dict[str, Any]:
        try:
            got = await asyncio.wait_for(
                client._run(describe_worker, workers=list(addresses), on_error="return"), timeout_s)
            if all(isinstance(got.get(a), dict) for a in addresses):
                return dict(got)
        except Exception:  # not all in time, or a worker left between the membership read and the call: ask each
            pass
        answers = await asyncio.gather(*(one(a) for a in addresses))
        return dict(zip(addresses, answers))

    if not addresses:
        return {}
    answers = client.sync(every)
    return {a: (e if isinstance(e, (dict, str)) else f"failed to say what it is ({type(e).__name__}: {e})")
            for a, e in answers.items()}


def discover_workers(client: Client, address: str, warned: set[str] | None = None,
                     described: dict[str, dict[str, Any]] | None = None, *,
                     timeout_s: float | None = None) -> Discovery:
    """The GPUs the scheduler's workers advertise now; a misconfigured worker is left out, named
    in a warning (once per distinct reason when ``warned`` keeps the reasons said before).

    A worker that does not answer within ``timeout_s`` (:data:`DESCRIBE_TIMEOUT_S`) does not hold the others: if
    ``described`` (kept by the caller between calls, by worker address) has what it said
    before, that stands (a process's environment does not change while it runs); a worker
    never heard from is left out and looked at again later, like a misconfigured one.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    answers = _describe_workers(client, sorted(info), DESCRIBE_TIMEOUT_S if timeout_s is None else timeout_s)
    envs: dict[str, dict[str, Any]] = {}
    for addr, answer in answers.items():
        if isinstance(answer, dict):
            envs[addr] = answer
        elif described is not None and addr in described:
            envs[addr] = described[addr]
    if described is not None:
        for addr in set(described) - set(info):  # gone: its address is not reused by another
            described.pop(addr, None)
        described.update(envs)
    devices, pins, emulated, skipped, left_out = [], {}, set(), [], set()
    for addr, w in sorted(info.items(), key=lambda aw: str(aw[1]["name"])):
        try:
            if addr not in envs:
                raise ValueError(f"worker {str(w['name'])!r} ({addr}) {answers.get(addr, 'gave no answer')}; "
                                 f"left out until it answers (looked at again within {RECHECK_LEFT_OUT_S:g} s)")
            d = _remote_device(addr, w["name"], w, envs[addr])
            if d.id in pins:
                raise ValueError(f"worker {str(w['name'])!r} ({addr}) uses a GPU id another worker has")
        except (ValueError, UnknownGpuTypeError) as exc:
            skipped.append(str(exc))
            left_out.add(str(w["name"]))
            if warned is None or str(exc) not in warned:
                log.warning("gogh: left out of the pool: %s", exc)
                if warned is not None:
                    warned.add(str(exc))
            continue
        devices.append(d)
        pins[d.id] = w["name"]
        if envs[addr].get("emulated"):
            emulated.add(d.id)
    if not devices:
        raise ValueError(f"no worker of the scheduler at {address!r} advertises a usable GPU: "
                         + "; ".join(skipped))
    return devices, pins, emulated, {str(w["name"]) for w in info.values()}, left_out


#: a remote pool's Dask client timeout, which is also how long it tries to reconnect after its
#: connection to the scheduler drops (``Client._reconnect`` gives up after the client's timeout);
#: a worker waits as long for a placing process to come back before it calls the run crashed
CLIENT_TIMEOUT_S = 10.0


def remote_pool(address: str, *, timeout: float = CLIENT_TIMEOUT_S, min_workers: int = 1,
                truth: ThroughputTable | None = None, time_scale: float | None = None,
                energy: EnergyModel | None = None, lease_timeout_s: float | None = None) -> GpuPool:
    """Connect to a running scheduler whose workers each advertise one GPU.

    A worker's GPU type comes from ``GOGH_GPU_TYPE`` in its environment, else
    from its name ``<type>-<n>``; its capacity from its ``slot`` resource; it is
    emulated when ``GOGH_EMULATED=1``. A worker that advertises no usable GPU
    is left out with a warning naming it (the others still serve). The device
    list follows the scheduler's membership (:meth:`GpuPool.live_devices`). The
    scheduler and its workers are left running on close. ``truth``/``time_scale`` (emulated workers only), when
    given, are shipped to the workers for every client of this scheduler.
    """
    probe_scheduler(address, timeout)  # a hung scheduler would hold the Client's handshake for minutes
    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise ConnectionError(
            f"cannot reach the Dask scheduler at {address!r} within {timeout:g}s ({type(exc).__name__}: {exc}); "
            "check the address and that `dask scheduler` is running there"
        ) from None
    try:
        try:
            client.wait_for_workers(min_workers, timeout=timeout)
        except TimeoutError:
            raise RuntimeError(
                f"the scheduler at {address!r} has fewer than {min_workers} worker(s) after {timeout:g}s; "
                "start one per GPU (see docs/runtime.md)"
            ) from None
        warned: set[str] = set()
        described: dict[str, dict[str, Any]] = {}
        found = discover_workers(client, address, warned, described)
        devices, pins, emulated = found[:3]
        pool = GpuPool(mode="remote", devices=devices, client=client, pins=pins, emulated=frozenset(emulated),
                       lease_timeout_s=lease_timeout_s)
        pool._rediscover = lambda: discover_workers(client, address, warned, described)
        pool._learn(found)
        if truth is not None or time_scale is not None or energy is not None:
            if truth is not None:
                _check_truth_covers(truth, sorted({d.gpu_type for d in devices if d.id in emulated}))
            pool.configure(truth=truth, time_scale=time_scale or 0.0, energy=energy)
        return pool
    except BaseException:
        client.close()
        raise


def open_pool(mode: str, **options: Any) -> GpuPool:
    """The pool for ``mode``: ``emulated`` (needs ``fleet=``), ``local-cuda``, ``remote`` (needs ``address=``)."""
    if mode == "emulated":
        if "fleet" not in options:
            raise ValueError("open_pool('emulated', ...) needs fleet=, e.g. fleet='v100=2,t4=1'")
        return emulated_pool(**options)
    if mode == "local-cuda":
        return local_cuda_pool(**options)
    if mode == "remote":
        if "address" not in options:
            raise ValueError("open_pool('remote', ...) needs address=, e.g. address='tcp://10.0.0.5:8786'")
        return remote_pool(**options)
    raise ValueError(f"unknown pool mode {mode!r}; choose one of {', '.join(MODES)}")

"""The pool's ledger seen from its holders: the placing process and the worker running the body.

:class:`PoolLedger` is what a placing process uses: read the state a decision is solved on,
claim a slot by compare-and-set, keep its claims alive until their bodies start, release.
:class:`WorkerLease` is what the worker holds while a body runs: it starts the body only if
the lease is still there, keeps it alive, passes a stop request on to the body, and frees the
slot when the body has really stopped.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distributed import Client

from gogh_flows.runtime.ledger import PLUGIN_NAME, LedgerPlugin, lease_timeout_from_env
from gogh_flows.runtime.probe import SchedulerUnreachable

__all__ = ["Claim", "Lease", "LedgerState", "LostRun", "PoolLedger", "WorkerLease", "ensure_ledger"]

log = logging.getLogger("gogh_flows.runtime")


@dataclass(frozen=True)
class Lease:
    """One run holding one slot; times are the scheduler's clock (Unix seconds)."""

    run_id: str
    gpu_id: str
    worker: str
    job_type: str
    required_throughput: float
    work: float
    claimed_at: float
    seen_at: float
    started_at: float | None
    cancel: bool
    cancel_reason: str | None = None  # why a stop was asked (cancelled, or its placing process was lost)
    client: str | None = None  # the claiming Dask client (holds the lease until the body starts)
    key: str | None = None  # the body's Dask task once started (its worker holds the lease)
    power_limit_w: float | None = None  # its board's power limit, set by the last claim there (None: maximum)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Lease:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class LedgerState:
    """A snapshot of the ledger: what a decision is solved on, and the versions its claim names."""

    now: float  # the scheduler's clock when the snapshot was taken
    lease_timeout_s: float
    versions: dict[str, int]
    leases: tuple[Lease, ...]
    workers: frozenset[str]  # names of the workers in the pool now
    counts: dict[str, int]
    undelivered: int = 0  # runs of lost placing processes (with their measurement if a body ran) not yet delivered
    kept: int = 0  # workers' records of ended runs waiting for their placing process to say it logged them
    version_base: int = 0  # where the ledger's versions start (random per ledger; 0 from older ones)
    silent_workers: frozenset[str] = frozenset()  # registered, not heard from lately: not placed on

    def version(self, gpu_id: str) -> int:
        return self.versions.get(gpu_id, self.version_base)

    def occupants(self) -> dict[str, list[Lease]]:
        """gpu_id -> its leases, oldest first."""
        out: dict[str, list[Lease]] = {}
        for lease in sorted(self.leases, key=lambda x: (x.gpu_id, x.claimed_at, x.run_id)):
            out.setdefault(lease.gpu_id, []).append(lease)
        return out


@dataclass(frozen=True)
class Claim:
    """The ledger's answer to a claim: ``ok``, or why not (``changed``, ``full``, ``gone``, ``held``)."""

    ok: bool
    version: int
    reason: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class LostRun:
    """A run whose placing process was lost, as the ledger hands it to a process of the same store.

    ``row`` is the measurement its worker made (None: lost before its body started);
    ``placer_gone``: its placer's client has not come back, so nobody else ends its flow run.
    """

    run_id: str
    row: dict[str, Any] | None
    gpu_id: str | None
    placer_gone: bool


def ensure_ledger(client: Client, lease_timeout_s: float | None = None) -> None:
    """Register the ledger on the client's scheduler unless it already has one (which is kept)."""
    client.register_plugin(LedgerPlugin(lease_timeout_s), name=PLUGIN_NAME)


class PoolLedger:
    """The ledger of the pool ``client`` is connected to, for a process that places runs.

    Claims made through this object are refreshed by a background thread until they are
    released or handed over (:meth:`hand_over`): a placing process that dies stops
    refreshing, and its claims lapse after the lease timeout.
    """

    def __init__(self, client: Client, *, lease_timeout_s: float | None = None, register: bool = True) -> None:
        self.client = client
        self.address = client.scheduler.address  # kept: a closed client no longer says
        # the tracking store (``MeasurementLog.store``) this process logs to: if it is lost, the
        # processes that log there are handed its runs (``collect``)
        self.store: str | None = None
        if register:
            ensure_ledger(client, lease_timeout_s)
        self._held: set[str] = set()
        # {run_id: if_unstarted}: releases that did not reach the ledger (a scheduler that stood
        # still, a lost connection), sent again by the keeper until one is answered. A claim this
        # process gave up on may still be taken; nobody refreshes it, but while this process's
        # client beats the ledger would keep it for a while, and a slot was lost for as long as
        # the process lived (a review reproduced it with a stopped scheduler)
        self._to_release: dict[str, bool] = {}
        # whether the ledger takes this process's word that it logged a run (``logged``): an
        # older one refuses the claim's flag, and then none is given
        self._acks = True
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.lease_timeout_s = self.state().lease_timeout_s

    def _call(self, op: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """One RPC to the ledger; ``TimeoutError`` when the scheduler does not answer within
        ``timeout_s``, :class:`SchedulerUnreachable` when the connection to it is lost.

        Dask raises the latter as its own ``CommClosedError("ConnectionPool closing.")`` once
        its client stopped reconnecting, which says neither what was lost nor what happens next.
        """
        bounded = timeout_s is not None and math.isfinite(timeout_s)
        if self.client.status in ("closing", "closed"):  # Dask's own error: 'NoneType' has no attribute ...
            raise SchedulerUnreachable(
                f"this process's Dask client stopped reconnecting to the pool's scheduler at {self.address} (it "
                "was away longer than the client's timeout); this process connects again at its next run, or once the scheduler "
                "answers")
        try:
            return self.client.sync(getattr(self.client.scheduler, op),
                                    callback_timeout=timeout_s if bounded else None, **kwargs)
        except (SchedulerUnreachable, TimeoutError):
            raise  # TimeoutError is an OSError too: the scheduler is there but slow, or hung
        except OSError as exc:  # CommClosedError, a refused or reset connection
            raise SchedulerUnreachable(
                f"lost the connection to the pool's Dask scheduler at {self.address} "
                f"({type(exc).__name__}: {exc}). Dask tries to reconnect for its client's timeout (10 s "
                "by default), then gives up; this process's next run connects again, and says so if the "
                "scheduler is still down") from exc

    # -- reading -------------------------------------------------------------------------
    def state(self, *, timeout_s: float | None = None) -> LedgerState:
        d = self._call("gogh_ledger_state", timeout_s=timeout_s)
        return LedgerState(now=d["now"], lease_timeout_s=d["lease_timeout_s"], versions=d["versions"],
                           leases=tuple(Lease.from_wire(x) for x in d["leases"]),
                           workers=frozenset(d["workers"]), counts=d["counts"],
                           undelivered=d.get("undelivered", 0), kept=d.get("kept", 0),
                           version_base=d.get("version_base", 0),
                           silent_workers=frozenset(d.get("silent_workers", ())))

    def put_features(self, job_type: str, doc: str | None = None, *, timeout_s: float | None = 10.0) -> bool:
        """Publish a job type's layer features (JSON) to the pool's other placing processes; with no
        ``doc``, whether the ledger has them (a few bytes each way: asked at every placement)."""
        return bool(self._call("gogh_ledger_put_features", timeout_s=timeout_s, job_type=job_type, doc=doc)["ok"])

    def features(self, job_types: list[str], *, timeout_s: float | None = 10.0) -> dict[str, str]:
        """The published features (JSON) of those of ``job_types`` the ledger has."""
        found = self._call("gogh_ledger_features", timeout_s=timeout_s, job_types=list(job_types))
        return {t: doc for t, doc in found.items() if doc is not None}

    def why_dropped(self, run_id: str, *, timeout_s: float | None = 5.0) -> str | None:
        """Why the ledger dropped ``run_id``'s lease: ``worker_left``, ``client_left``, ``expired``;
        None when it does not say (released, unknown, or a ledger from before it kept reasons)."""
        try:
            return self._call("gogh_ledger_dropped", run_ids=[run_id], timeout_s=timeout_s).get(run_id)
        except Exception:  # noqa: BLE001 - only words an error: the generic one stands
            return None

    def get(self, run_id: str, *, timeout_s: float | None = None) -> Lease | None:
        found = self._call("gogh_ledger_get", timeout_s=timeout_s, run_ids=[run_id]).get(run_id)
        return Lease.from_wire(found) if found else None

    # -- claiming ------------------------------------------------------------------------
    def claim(self, run_id: str, gpu_id: str, *, worker: str, capacity: int, job_type: str,
              required_throughput: float, work: float, expect_version: int,
              timeout_s: float | None = None, power_limit_w: float | None = None) -> Claim:
        """Claim a slot if the GPU is still at ``expect_version``; a claim that timed out may
        have been made: the caller releases it (``release(run_id, if_unstarted=True)``).
        ``power_limit_w`` becomes the board's limit for every run on it (None: its maximum)."""
        ask = dict(run_id=run_id, gpu_id=gpu_id, worker=worker, capacity=capacity, job_type=job_type,
                   required_throughput=required_throughput, work=work, expect_version=expect_version,
                   client=self.client.id, store=self.store, power_limit_w=power_limit_w)
        if self._acks:
            try:
                # this process says when it has logged each run (``logged``): its worker's record is kept till then
                d = self._call("gogh_ledger_claim", timeout_s=timeout_s, acks_logged=True, **ask)
            except TypeError:  # a ledger older than this process: claims as before
                self._acks = False
        if not self._acks:
            d = self._call("gogh_ledger_claim", timeout_s=timeout_s, **ask)
        claim = Claim(ok=d["ok"], version=d["version"], reason=d.get("reason"), detail=d.get("detail"))
        if claim.ok:
            with self._lock:
                self._held.add(run_id)
            self._ensure_keeper()
        return claim

    def release(self, run_id: str, *, if_unstarted: bool = False, timeout_s: float | None = None) -> bool:
        """Free the run's slot (with ``if_unstarted``: only if its body never started); freed?

        A release the scheduler does not answer raises, and is sent again in the background
        until it is answered (or this process's client gives up on the scheduler, which then
        drops the process's unstarted claims itself)."""
        self.hand_over(run_id)
        try:
            answer = self._call("gogh_ledger_release", timeout_s=timeout_s, run_id=run_id, if_unstarted=if_unstarted)
        except Exception:
            with self._lock:
                self._to_release[run_id] = if_unstarted
            self._ensure_keeper()
            raise
        with self._lock:
            self._to_release.pop(run_id, None)
        return bool(answer["released"])

    def pending_releases(self) -> list[str]:
        """Runs whose release has not reached the ledger yet (sent again in the background)."""
        with self._lock:
            return sorted(self._to_release)

    def cancel(self, run_id: str, reason: str = "cancelled by its placing process", *,
               timeout_s: float | None = None) -> bool:
        """Ask the run's body to stop (at its next progress report); its worker frees the slot."""
        return bool(self._call("gogh_ledger_cancel", timeout_s=timeout_s, run_id=run_id, reason=reason)["ok"])

    def collect(self, store: str, *, timeout_s: float | None = 5.0) -> list[LostRun]:
        """Runs whose placing process was lost and logged to the tracking ``store``.

        This process delivers them now: say so with :meth:`delivered` once their measurements
        are logged (if it dies first, they are handed to another process).
        """
        d = self._call("gogh_ledger_collect", timeout_s=timeout_s, store=store, client=self.client.id)
        return [LostRun(run_id=x["run_id"], row=x["row"], gpu_id=x.get("gpu_id"),
                        placer_gone=bool(x.get("placer_gone", True))) for x in d["rows"]]

    def delivered(self, run_ids: list[str], *, timeout_s: float | None = 5.0) -> int:
        return int(self._call("gogh_ledger_delivered", timeout_s=timeout_s, run_ids=list(run_ids))["delivered"])

    def logged(self, run_ids: list[str], *, timeout_s: float | None = 5.0) -> int:
        """This process has logged these runs' measurements: the ledger can forget their workers' records."""
        if not self._acks:
            return 0
        return int(self._call("gogh_ledger_logged", timeout_s=timeout_s, run_ids=list(run_ids),
                              client=self.client.id)["logged"])

    def hand_over(self, run_id: str) -> None:
        """Stop refreshing ``run_id`` from this process (its worker holds it, or it is gone)."""
        with self._lock:
            self._held.discard(run_id)

    # -- keeping claims alive --------------------------------------------------------------
    def _ensure_keeper(self) -> None:
        with self._lock:
            if self._keeper is None or not self._keeper.is_alive():
                self._keeper = threading.Thread(target=self._keep, name="gogh-lease-keeper", daemon=True)
                self._keeper.start()

    def _keep(self) -> None:
        every = self.lease_timeout_s / 4
        while not self._stop.wait(every):
            self._release_again(every)
            with self._lock:
                held = sorted(self._held)
            if not held:
                continue
            try:
                gone = self._call("gogh_ledger_refresh", run_ids=held)["gone"]
            except Exception as exc:  # the scheduler is unreachable: the leases lapse there anyway
                log.warning("gogh: could not refresh %d lease(s) on the pool's scheduler: %s", len(held), exc)
                continue
            if gone:
                with self._lock:
                    self._held.difference_update(gone)

    def _release_again(self, timeout_s: float) -> None:
        with self._lock:
            pending = dict(self._to_release)
        for run_id, if_unstarted in pending.items():
            if self.client.status in ("closing", "closed"):
                # the scheduler drops a departed client's unstarted claims itself (remove_client)
                with self._lock:
                    self._to_release.clear()
                return
            try:
                self.release(run_id, if_unstarted=if_unstarted, timeout_s=timeout_s)  # kept pending if it fails
            except Exception as exc:  # noqa: BLE001 - sent again at the next tick
                log.debug("gogh: the release of run %s still did not reach the pool's scheduler: %s", run_id, exc)
                return  # the scheduler is still away: the others wait for the next tick too
            log.info("gogh: the release of run %s reached the pool's scheduler", run_id)

    def close(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)


class WorkerLease:
    """The lease of one run, held by the worker while its body runs.

    :meth:`begin` asks the scheduler whether the body may start (the lease is still held, for
    this worker, and no stop was asked); a background thread then refreshes it and calls
    ``on_cancel(reason)`` when a stop is asked or the lease is found dropped; :meth:`end` frees the
    slot when the body has stopped.

    Every call to the scheduler is bounded: :meth:`begin` by ``call_timeout_s`` (60 s, or two lease
    timeouts if longer: how long a placing process waits for a silent scheduler), the rest by the
    lease timeout the ledger gave (a lease unheard of for that long lapses on its own, so waiting
    longer to free it gains nothing), and a refresh by its own period. A scheduler that accepts the
    connection and never answers held the worker's thread for good: the body's task never ended
    and its measurement never reached its placing process.
    """

    def __init__(self, run_id: str, call: Callable[..., Any], on_cancel: Callable[[str], None],
                 call_timeout_s: float | None = None) -> None:
        self.run_id = run_id
        self._call = call
        self._on_cancel = on_cancel
        self._timeout_s = call_timeout_s if call_timeout_s is not None else max(60.0, 2 * lease_timeout_from_env())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.board_limit_known = False  # begin() heard the board's limit from the ledger
        self.board_limit_w: float | None = None
        self.placer_client: str | None = None

    def begin(self, worker: str, key: str | None = None) -> bool:
        d = self._call("gogh_ledger_begin", run_id=self.run_id, worker=worker, key=key, timeout_s=self._timeout_s)
        if not d["ok"]:
            return False
        self._timeout_s = float(d["lease_timeout_s"])
        self.board_limit_known = "power_limit_w" in d
        self.board_limit_w = d.get("power_limit_w")  # the board's limit now: the last claim's there
        self.placer_client = d.get("client")  # the placing process's Dask client
        every = d["lease_timeout_s"] / 4
        self._thread = threading.Thread(target=self._keep, args=(every,), name=f"gogh-lease-{self.run_id}",
                                        daemon=True)
        self._thread.start()
        return True

    def _keep(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                answer = self._call("gogh_ledger_refresh", run_ids=[self.run_id], timeout_s=every)
            except Exception as exc:  # noqa: BLE001 - retried at the next tick
                log.warning("gogh: worker could not refresh the lease of run %s: %s", self.run_id, exc)
                continue
            if self.run_id in answer["cancel"]:
                self._on_cancel(answer["cancel"][self.run_id])
            if self.run_id in answer["gone"]:
                # The ledger may already have given the slot to another run, and the placing process
                # has given this one up (RunLost): a body left running would share the GPU unseen.
                log.warning("gogh: the lease of run %s was dropped while its body runs (it lapsed while this "
                            "worker went unheard, or the scheduler restarted); the body is stopped at its next "
                            "report, as its GPU may be given to another run (raise the lease timeout if this "
                            "host is overloaded)", self.run_id)
                self._on_cancel("its GPU slot's lease was dropped by the pool's ledger (it lapsed while its "
                                "worker went unheard, or the scheduler restarted), and its placing process "
                                "gives such a run up")
                return

    def placer_connected(self) -> bool | None:
        """Whether the placing process's Dask client is connected now (None: not known).

        Dask cancels a client's runs when its connection drops, even if it is back within a
        second with the same id; such a placer ends its flow run itself."""
        if not self.placer_client:
            return None
        try:
            answer = self._call("gogh_ledger_connected", clients=[self.placer_client], timeout_s=5.0)
            return bool(answer[self.placer_client])
        except Exception:  # noqa: BLE001 - unknown: an older ledger, or the scheduler unreachable
            return None

    def lift(self, from_w: float) -> None:
        """Tell the ledger the run's board went back to its full limit from ``from_w``."""
        try:
            self._call("gogh_ledger_lift", run_id=self.run_id, from_w=float(from_w), timeout_s=self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - the next claim on the board sets its limit anyway
            log.warning("gogh: could not tell the pool's ledger that run %s's board went back to its full "
                        "limit: %s", self.run_id, exc)

    def end(self, record: tuple[str, dict[str, Any]] | None = None) -> bool:
        """Free the slot, handing the ledger this worker's ``record`` of the run (tracking store,
        measurement row) in the same call; whether the run's placing process was lost (nobody
        waits for its outcome: the record is delivered to the next placing process that logs to
        that store). With the placer still there, the ledger keeps the record until the placer
        says it logged the run: a placer killed after this call and before its own record
        reached the table left the run unmeasured."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        store, row = record if record is not None else (None, None)
        try:
            try:
                released = self._call("gogh_ledger_release", run_id=self.run_id, if_unstarted=False,
                                      store=store, row=row, client=self.placer_client, timeout_s=self._timeout_s)
            except TypeError:
                # a ledger older than this worker takes no record with the release: the slot is
                # freed as it was, and the record handed in only if the placer is gone
                released = self._call("gogh_ledger_release", run_id=self.run_id, if_unstarted=False,
                                      timeout_s=self._timeout_s)
                if released.get("placer_lost") and row is not None:
                    self._call("gogh_ledger_deposit", run_id=self.run_id, store=store, row=row,
                               client=released.get("client"), gpu_id=released.get("gpu_id"),
                               timeout_s=self._timeout_s)
            return bool(released.get("placer_lost"))
        except Exception as exc:  # noqa: BLE001 - the lease lapses on its own
            log.warning("gogh: worker could not release the lease of run %s (it lapses on its own): %s%s",
                        self.run_id, exc, "" if row is None else
                        f"; its placing process logs the run if it is still there, and if not, this record of it "
                        f"is lost: {row}")
            return False

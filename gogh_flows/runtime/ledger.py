"""Who holds which GPU slot: one ledger for the whole pool, kept by the pool's Dask scheduler.

Placement decisions are taken by independent flow runs: threads of one process, processes
started by a Prefect worker, processes on other machines. They all place onto one Dask pool,
and the one component they all reach is that pool's scheduler, so the ledger lives there, as
a scheduler plugin with RPC handlers (the way ``distributed``'s own Semaphore keeps its
leases). Handlers run one at a time on the scheduler's event loop, so each claim is atomic
without a lock.

Two rules make a placement safe:

* **compare-and-set on occupancy.** Every GPU has a version, bumped by each claim and each
  release on it. A decision reads the versions with the occupancy it solves on, and its claim
  names the version of the GPU it chose; if anything changed there since, the claim is refused
  and the run decides again on the new state. So two runs share a GPU only if the decision
  that put the second there saw the first (and protected its requirement).
* **leases.** A claim is held by the placing process's Dask client until the body starts,
  then by the worker running it. It is dropped when the run ends, when its holder leaves the
  scheduler (the client disconnects: its process died; the worker is removed), or when it was
  not refreshed for ``lease_timeout_s`` *and* Dask no longer shows its holder alive (the
  claiming client connected, or the body's task processing on its worker). Liveness comes from
  Dask's own state first because a refresh thread can miss its turn under load (a long
  GIL-holding call): a lease must never lapse under a body that still runs, or another run
  would be put next to it unseen. A crashed placing process or worker frees its GPU at once.

The ledger also keeps what nobody else can: the runs of a placing process that was lost,
so that their flow runs do not say Running for ever. A claim whose body never started is kept
when the placer's client leaves; a run whose body ran, when its worker hands in the
measurement it made once the body stopped. A lease timeout later (a placer that only lost its
connection comes back within it and ends its runs itself), a placing process that logs to the
same tracking store collects them, logs the measurements (by their idempotency key, so twice is
harmless), marks the flow runs Crashed and says they are delivered; until then they are held here.

Start a shared scheduler with the ledger preloaded (``dask scheduler --preload
gogh_flows.runtime.ledger``), or let the first client register it (:func:`ensure_ledger`).
"""

from __future__ import annotations

import importlib
import logging
import secrets
from collections import OrderedDict
from time import monotonic, time
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import heartbeat_interval
from tornado.ioloop import PeriodicCallback

from gogh_flows.runtime.settings import seconds

__all__ = ["DEFAULT_LEASE_TIMEOUT_S", "HAND_IN_REASONS", "LEASE_TIMEOUT_ENV", "PLACER_GAVE_UP", "PLACER_LOST",
           "PLUGIN_NAME", "LedgerPlugin", "dask_setup"]

log = logging.getLogger("gogh_flows.runtime.ledger")

PLUGIN_NAME = "gogh-ledger"
LEASE_TIMEOUT_ENV = "GOGH_LEASE_TIMEOUT_S"
DEFAULT_LEASE_TIMEOUT_S = 30.0
#: how many dropped leases' reasons the ledger remembers (for the placing process's error)
DROPPED_KEPT = 1000
#: how many released run ids the ledger remembers, to refuse a claim that arrives after its release
RELEASED_KEPT = 10_000
#: how many lease timeouts an unstarted claim outlives its placing process's last refresh while
#: that process's Dask client still beats (a refresh missed, not a process gone)
UNSTARTED_GRACE = 3


def lease_timeout_from_env(value: float | None = None) -> float:
    """The lease timeout: ``value``, else ``$GOGH_LEASE_TIMEOUT_S``, else 30 s; checked > 0."""
    return seconds(LEASE_TIMEOUT_ENV, DEFAULT_LEASE_TIMEOUT_S, "the ledger's lease timeout: how long a holder "
                   "may go unheard before its GPU is freed", value=value, argument="lease_timeout_s")


#: what a decorated run's task graph names beyond the runtime (which the ledger's own imports
#: bring): the scheduler unpickles each graph on its event loop, so the first graph imports
#: these there, torch with them (seconds, more with a CUDA build on a cold disk)
RUN_PATH_MODULES = ("gogh_flows.flows",)


def warm_run_path() -> float:
    """Import :data:`RUN_PATH_MODULES` now, before any lease exists; the seconds it took.

    Dask's scheduler deserialises a submitted graph on its event loop, and with it the modules
    the run's function and body name. Left to the first run, that import stalls every handler of
    the ledger meanwhile: 2.8 s on the 2-core CI machine, where a 4 s lease check has no margin
    left (on a lent H100 the multi-host tests with that timeout lost their first run; the stall
    there was not measured). Imported while the ledger starts, the cost is paid before anyone
    holds a slot; a team's own heavy modules can be preloaded the same way (``dask scheduler
    --preload mypackage``). Only a speed-up: an import that fails is logged and the ledger starts
    without it (the first run then pays the import, or fails with the same error itself).
    """
    began = monotonic()
    for name in RUN_PATH_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the ledger must start whatever the run path does
            log.warning("gogh: the ledger could not import %s ahead of the first run (%s: %s); the first "
                        "run's graph will import it on the scheduler's event loop, stalling the ledger "
                        "meanwhile", name, type(exc).__name__, exc)
    return monotonic() - began


#: the most measurements of lost placing processes kept while nobody collects them
MAX_UNDELIVERED = 10_000
#: how long a worker's record of an ended run waits for its placing process to say it logged the
#: run (at least four lease timeouts) before it is handed out like a lost placer's
KEPT_FOR_S = 60.0

#: why a started body is asked to stop when the process that placed it disconnects
PLACER_LOST = "its placing process was lost (its Dask client disconnected)"
#: a stop asked by a placing process that gave the run up while its scheduler was silent: the
#: body is stopped and, as for a lost placer, its worker hands in what it measured
PLACER_GAVE_UP = "its placing process gave it up (the pool's scheduler did not answer)"
#: the stop reasons after which the worker hands in the body's measurement
HAND_IN_REASONS = (PLACER_LOST, PLACER_GAVE_UP)
#: Dask's ``distributed.client.heartbeat``: how often a client beats until the scheduler says otherwise
CLIENT_HEARTBEAT_S = 5.0
#: a worker not heard from for this long (or the lease timeout, if longer) is left out of the
#: workers a placement may choose: hung (stopped, its event loop blocked), or too loaded to beat.
#: Dask keeps it until its worker-ttl (5 minutes), and runs placed on it waited in its queue
SILENT_WORKER_S = 10.0


#: job types whose features the ledger keeps, and the largest document it takes (a job's tokens
#: are folded into at most 48: a few kilobytes)
MAX_FEATURE_TYPES = 4096
MAX_FEATURES_DOC = 512 * 1024


class LedgerPlugin(SchedulerPlugin):
    """The pool's slot reservations, held by the scheduler; see the module docstring.

    ``idempotent``: a second client registering the plugin keeps the first one and its state.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, lease_timeout_s: float | None = None) -> None:
        self.lease_timeout_s = lease_timeout_from_env(lease_timeout_s)
        # {gpu_id: version}: bumped by every claim and release on that GPU
        self.versions: dict[str, int] = {}
        # where every GPU's version starts: random for each ledger a scheduler starts (``start``),
        # so a decision read from a ledger that a scheduler restart replaced cannot match the new
        # ledger's version by coincidence (versions restarting at 0 could: the compare-and-set
        # would pass on a stale view)
        self.version_base = 0
        # {run_id: {"run_id", "gpu_id", "worker", "job_type", "required_throughput", "work",
        #           "claimed_at", "seen_at", "started_at" (None until the body starts), "cancel",
        #           "cancel_reason" (why a stop was asked),
        #           "client" (id of the claiming Dask client), "key" (the body's task key once started)}}
        self.leases: dict[str, dict[str, Any]] = {}
        # {worker address: worker name}: remove_worker is told the address only, after the
        # scheduler has forgotten the name
        self.names: dict[str, str] = {}
        # {"expired" | "worker_left" | "client_left" | "orphaned" (a started body whose placing
        #  process left) | "released" | "claimed" | "refused_changed" | "refused_full" |
        #  "deposited" | "delivered" | "unstarted_reported" | "undelivered_dropped" | "kept" | "logged" |
        #  "kept_unacknowledged": n}
        self.counts: dict[str, int] = {}
        # {run_id: {"store" (a hash of the tracking store the run logs to), "row" (its measurement;
        #           None when its body never started), "gpu_id", "client" (the lost placer's),
        #           "since", "taker" (the client collecting it, None while nobody has), "taken_at"}}:
        # runs whose placing process was lost, until a process logging to that store has logged
        # their measurement and marked their flow run crashed
        self.undelivered: dict[str, dict[str, Any]] = {}
        # {run_id: {"store", "row", "gpu_id", "client", "since"}}: the worker's record of a run whose
        # body ended while its placing process was connected, kept until that process says it logged
        # the run (placers that said at their claim that they would: older ones log as before). Its
        # client leaving first, or a placer silent for KEPT_FOR_S, makes the record undelivered:
        # between the worker freeing the slot and the placer's record reaching the table, a placer
        # killed lost the run's measurement (a review), since nobody else held it
        self.kept: dict[str, dict[str, Any]] = {}
        # {job type: its layer features as JSON}: a run placed by one process is a co-location
        # partner of every other's placements, which predict next to it from its features; a user
        # model's can be read only where it was decorated, so its placers publish them here
        self.features: dict[str, str] = {}
        # {run_id: why its lease was dropped ("worker_left", "client_left", "expired")}, the last
        # DROPPED_KEPT of them: a placing process told only "gone" said "lease lapsed" of a run
        # whose worker had been killed a second before (a review)
        self.dropped: OrderedDict[str, str] = OrderedDict()
        # the last RELEASED_KEPT runs released (or released before their claim arrived): a claim
        # its placing process gave up on (timed out) can reach the scheduler after that process's
        # release, or be answered after it; taken then, nobody would hold or free it
        self.released: OrderedDict[str, None] = OrderedDict()
        self.scheduler: Any = None
        # the ledger's own clock of being awake: when its expiry check last ran (monotonic), and
        # when it last woke from a stall (wall time); nobody can be heard while the scheduler
        # stands still, so a stall restarts every lease's clock (see :meth:`_expire`)
        self._ticked: float | None = None
        self._ticked_wall: float | None = None
        self.awake_since = 0.0
        self._every_s = 1.0

    # -- lifetime ----------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        # no await before the handlers are in: Dask adds a client-registered plugin only after
        # start returns, so an await here would let a second registration start a second ledger
        took = warm_run_path()
        if took > 1.0:
            log.info("gogh: the ledger imported the run path in %.1f s before taking claims", took)
        self.scheduler = scheduler
        self.version_base = secrets.randbelow(1 << 40)
        scheduler.handlers.update({
            "gogh_ledger_state": self.state,
            "gogh_ledger_claim": self.claim,
            "gogh_ledger_get": self.get,
            "gogh_ledger_refresh": self.refresh,
            "gogh_ledger_begin": self.begin,
            "gogh_ledger_lift": self.lift,
            "gogh_ledger_connected": self.connected,
            "gogh_ledger_release": self.release,
            "gogh_ledger_cancel": self.cancel,
            "gogh_ledger_deposit": self.deposit,
            "gogh_ledger_collect": self.collect,
            "gogh_ledger_delivered": self.delivered,
            "gogh_ledger_logged": self.logged,
            "gogh_ledger_put_features": self.put_features,
            "gogh_ledger_features": self.get_features,
            "gogh_ledger_dropped": self.why_dropped,
        })
        self.names = {addr: str(ws.name) for addr, ws in scheduler.workers.items()}
        # check often enough that a lapsed lease is dropped within a quarter of its timeout
        every_ms = max(50.0, min(1000.0, self.lease_timeout_s * 250.0))
        self._every_s = every_ms / 1000.0
        pc = PeriodicCallback(self._expire, every_ms)
        scheduler.periodic_callbacks["gogh-ledger-expiry"] = pc
        pc.start()

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            self.names[worker] = str(ws.name)

    def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        name = self.names.pop(worker, None)
        if name is None or name in self.names.values():
            return  # unknown, or another process still serves that name
        for run_id in [r for r, lease in self.leases.items() if lease["worker"] == name]:
            self._drop(run_id, "worker_left")

    def remove_client(self, scheduler: Any, client: str) -> None:
        # A placing process that died (killed, or its Prefect run cancelled) leaves its claims
        # behind. An unstarted one is dropped. A started body belongs to its worker, but nobody
        # waits for its result any more: it is asked to stop (at its next progress report) and
        # its worker frees the slot once it has, so the GPU is never shared with a body that
        # is still running.
        for run_id, lease in list(self.leases.items()):
            if lease["client"] != client:
                continue
            if lease["started_at"] is None:
                self._drop(run_id, "client_left")
                if lease.get("store"):  # no body ran, nothing measured: its flow run still says Running
                    self._hold(run_id, lease["store"], None, client, lease["gpu_id"])
            elif self._ask_stop(lease, PLACER_LOST):
                self._count("orphaned")
        for entry in self.undelivered.values():
            if entry["taker"] == client:  # collected, never said delivered: up for collection again
                entry["taker"] = None
        for run_id in [r for r, e in self.kept.items() if e["client"] == client]:
            # its body ended, and the placer went before saying it logged the run: the worker's
            # record is delivered like any lost placer's (to the placer itself, back after a blip, at once)
            self._unkeep(run_id)

    # -- state -------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        if n:
            self.counts[what] = self.counts.get(what, 0) + n

    def version_of(self, gpu_id: str) -> int:
        """The GPU's version now (what a claim's ``expect_version`` must be)."""
        return self.versions.get(gpu_id, self.version_base)

    def _bump(self, gpu_id: str) -> int:
        self.versions[gpu_id] = self.version_of(gpu_id) + 1
        return self.versions[gpu_id]

    def _remember_released(self, run_id: str) -> None:
        self.released[run_id] = None
        self.released.move_to_end(run_id)
        while len(self.released) > RELEASED_KEPT:
            self.released.popitem(last=False)

    def _drop(self, run_id: str, why: str) -> bool:
        lease = self.leases.pop(run_id, None)
        if lease is None:
            return False
        self._bump(lease["gpu_id"])
        self._count(why)
        if why != "released":
            self.dropped[run_id] = why
            while len(self.dropped) > DROPPED_KEPT:
                self.dropped.popitem(last=False)
            log.warning("gogh ledger: dropped the lease of run %s on %s (%s)", run_id, lease["gpu_id"], {
                "worker_left": "its worker left", "client_left": "its placing process's client left",
            }.get(why, f"not refreshed for {self.lease_timeout_s:g} s, and its holder is gone"))
        return True

    @staticmethod
    def _ask_stop(lease: dict[str, Any], reason: str) -> bool:
        """Mark the lease's body to stop (the first reason given stands); newly asked?"""
        if lease["cancel"]:
            return False
        lease["cancel"], lease["cancel_reason"] = True, reason
        return True

    def _holder_alive(self, lease: dict[str, Any]) -> bool:
        """Whether Dask's own state shows the lease's holder still at work.

        A running body's worker must also have sent the scheduler a heartbeat within the lease
        timeout: a hung worker (stopped, its event loop blocked) stays "processing" its task
        until Dask's ``worker-ttl`` (5 minutes) removes it, and the lease, renewed on that
        showing alone, held its slot that long (a new-user review: 335 s for a 10 s lease)."""
        if self.scheduler is None:
            return False
        if lease["started_at"] is None:
            # its placing process refreshes it until the body starts: a client that beats but has
            # not refreshed for UNSTARTED_GRACE timeouts lost track of the claim (one it gave up on
            # and could not release), which client liveness alone kept for the process's life
            refreshed = max(lease["refreshed_at"], self.awake_since)
            return (time() - refreshed <= UNSTARTED_GRACE * self.lease_timeout_s
                    and self._client_heard(lease["client"]))
        ws = self._processing_worker(lease)
        return ws is not None and time() - max(ws.last_seen, self.awake_since) <= self.lease_timeout_s

    def _processing_worker(self, lease: dict[str, Any]) -> Any:
        """The scheduler's state of the worker Dask shows running a started lease's body, if it is
        the lease's worker (None: not started, or not running there)."""
        if self.scheduler is None or lease["started_at"] is None or not lease["key"]:
            return None
        ts = self.scheduler.tasks.get(lease["key"])
        ws = ts.processing_on if ts is not None and ts.state == "processing" else None
        return ws if ws is not None and str(ws.name) == lease["worker"] else None

    def _client_heard(self, client: str | None) -> bool:
        """Whether the claiming process's Dask client is connected and has sent a heartbeat lately.

        Dask keeps a connected client however long it is silent, so a placing process that hung
        between its claim and its body's start (stopped, or its interpreter blocked) held the slot
        for as long as it hung. Clients beat less often than workers (every 5 s while at most ten
        clients are connected, then ten worker intervals, as the scheduler tells them), so three
        beats, or the lease timeout if longer, may pass unheard."""
        cs = self.scheduler.clients.get(client) if client is not None else None
        if cs is None:
            return False
        beat_s = max(CLIENT_HEARTBEAT_S, 10 * heartbeat_interval(len(self.scheduler.clients)))
        return time() - max(cs.last_seen, self.awake_since) <= max(self.lease_timeout_s, 3 * beat_s)

    def _woke_from_stall(self) -> bool:
        """Whether the scheduler stood still since the last check (stopped, its event loop blocked).

        Holders refresh their leases and workers send heartbeats all along, but while the scheduler
        stands still none of it is heard. After a stall longer than the lease timeout every lease
        looks lapsed, and whether the first expiry check on waking dropped them depended on whether
        the queued heartbeats happened to be read before it: a dropped lease frees a GPU that a
        body still runs on. So the ledger's own stall restarts every clock: a lease lapses no
        sooner than a lease timeout after the ledger woke.

        A stall is a gap of more than half the lease timeout (at least two of the check's periods):
        the gap of four periods used before let a 4 s lease go unforgiven for stalls of 2-4 s, in
        which a refresh sent a second before the stall and the stall itself add up to the lease.
        A gap taken for a stall only restarts the clocks (holders keep their slots a little
        longer); a stall missed drops leases whose bodies run, and their bodies are stopped."""
        tick, wall = monotonic(), time()
        last, last_wall = self._ticked, self._ticked_wall
        self._ticked, self._ticked_wall = tick, wall
        if last is None or last_wall is None:  # the first check (both are set together)
            return False
        gap = max(2 * self._every_s, self.lease_timeout_s / 2)
        # a step of the wall clock (NTP, a resume from suspend, which the monotonic clock leaves
        # out) ages every lease at once as a stall does, and nobody could have refreshed in it; a
        # step back leaves times in the future, which would keep a dead holder's lease that much longer
        return tick - last > gap or abs((wall - last_wall) - (tick - last)) > gap

    def _expire(self) -> None:
        now = time()
        if self._woke_from_stall():
            self.awake_since = now
            for lease in self.leases.values():  # a step back of the clock: no time after now
                for stamp in ("seen_at", "refreshed_at"):
                    lease[stamp] = min(lease[stamp], now)
            log.warning("gogh ledger: the scheduler stood still (stopped or its event loop blocked) for longer "
                        "than half the lease timeout; every lease's clock starts again now")
        self._age_kept(now)
        for run_id, lease in list(self.leases.items()):
            if max(lease["seen_at"], self.awake_since) >= now - self.lease_timeout_s:
                continue
            if self._holder_alive(lease):
                # a refresh missed its turn; Dask shows the holder alive and heard: seen when it was last
                # heard, not now, so a worker stopped right after its last heartbeat loses the lease
                # within the timeout of it (renewed to now, it held the slot for up to two: a review)
                ws = self._processing_worker(lease)
                lease["seen_at"] = max(lease["seen_at"], float(ws.last_seen) if ws is not None else now)
            else:
                self._drop(run_id, "expired")

    # -- handlers (each runs alone on the scheduler's event loop: atomic) ---------------
    def state(self) -> dict[str, Any]:
        """Everything a decision needs: leases, per-GPU versions, live workers, the clock."""
        live, silent = self._workers_heard()
        return {"now": time(), "lease_timeout_s": self.lease_timeout_s, "versions": dict(self.versions),
                "leases": [dict(lease) for lease in self.leases.values()],
                "workers": live, "silent_workers": silent, "counts": dict(self.counts),
                "undelivered": len(self.undelivered), "kept": len(self.kept), "version_base": self.version_base}

    def _workers_heard(self) -> tuple[list[str], list[str]]:
        """(the pool's workers heard from lately, those registered but silent for longer than
        ``SILENT_WORKER_S`` or the lease timeout): a hung worker's running leases lapse within the
        lease timeout, and placements no longer choose it until it is heard from again."""
        if self.scheduler is None:
            return sorted(set(self.names.values())), []
        # workers beat less often in a large pool (Dask's heartbeat_interval: 0.5 s up to ten, then
        # more): three of their beats missed, at the least
        beat_s = heartbeat_interval(len(self.scheduler.workers))
        quiet_s, now = max(SILENT_WORKER_S, self.lease_timeout_s, 3 * beat_s), time()
        heard: set[str] = set()
        for address, name in self.names.items():
            ws = self.scheduler.workers.get(address)
            if ws is None or now - max(getattr(ws, "last_seen", now), self.awake_since) <= quiet_s:
                heard.add(name)
        return sorted(heard), sorted(set(self.names.values()) - heard)

    def claim(self, run_id: str, gpu_id: str, worker: str, capacity: int, job_type: str,
              required_throughput: float, work: float, expect_version: int,
              client: str | None = None, store: str | None = None,
              power_limit_w: float | None = None, acks_logged: bool = False) -> dict[str, Any]:
        """Take one slot of ``gpu_id`` if its version is still ``expect_version`` and it has room.

        Claiming again what the run already holds succeeds (a retried call); the answer's
        ``reason`` says why a claim was refused: ``changed``, ``full``, ``gone`` or ``held``.
        ``store`` names the tracking store the placing process logs to: if that process is
        lost, the processes logging there are told (see :meth:`collect`). ``power_limit_w``
        is the board limit the placement chose (None: its maximum): a board has one limit, so
        it is set on every lease of the GPU in the same step as the claim, which the version
        check makes safe (the decision saw every run it changes the limit of). ``acks_logged``:
        the placing process says when it has logged the run (:meth:`logged`), so its worker's
        record is kept until then.
        """
        version = self.version_of(gpu_id)
        held = self.leases.get(run_id)
        if held is not None:
            if held["gpu_id"] == gpu_id:
                held["seen_at"] = held["refreshed_at"] = time()
                return {"ok": True, "version": version}
            return {"ok": False, "reason": "held", "version": version,
                    "detail": f"run {run_id} already holds {held['gpu_id']}"}
        if run_id in self.released:
            self._count("refused_released")
            return {"ok": False, "reason": "released", "version": version,
                    "detail": f"run {run_id} was released before this claim was taken (its placing process gave "
                              "the claim up)"}
        if worker not in self.names.values():
            return {"ok": False, "reason": "gone", "version": version,
                    "detail": f"worker {worker!r} of {gpu_id} is not in the pool"}
        # a GPU never claimed here is at its base, which a placing process from before the base
        # existed reads as 0 (it was refused as changed for ever): either is the same empty GPU
        if version != expect_version and not (gpu_id not in self.versions and expect_version == 0):
            self._count("refused_changed")
            return {"ok": False, "reason": "changed", "version": version}
        if sum(1 for lease in self.leases.values() if lease["gpu_id"] == gpu_id) >= capacity:
            self._count("refused_full")
            return {"ok": False, "reason": "full", "version": version}
        now = time()
        self.dropped.pop(run_id, None)  # a run that claims again is not the lease that was dropped
        self.leases[run_id] = {
            "run_id": run_id, "gpu_id": gpu_id, "worker": worker, "job_type": job_type,
            "required_throughput": float(required_throughput), "work": float(work),
            "claimed_at": now, "seen_at": now, "refreshed_at": now, "started_at": None, "cancel": False,
            "cancel_reason": None, "client": client, "key": None, "store": store,
            "power_limit_w": None if power_limit_w is None else float(power_limit_w),
            "acks_logged": bool(acks_logged),
        }
        for lease in self.leases.values():
            if lease["gpu_id"] == gpu_id:
                lease["power_limit_w"] = self.leases[run_id]["power_limit_w"]
        self._count("claimed")
        return {"ok": True, "version": self._bump(gpu_id)}

    def why_dropped(self, run_ids: list[str]) -> dict[str, str | None]:
        """Why each run's lease was dropped (None: released by its run, never held, or forgotten)."""
        return {r: self.dropped.get(r) for r in run_ids}

    def get(self, run_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        return {r: (dict(self.leases[r]) if r in self.leases else None) for r in run_ids}

    def refresh(self, run_ids: list[str]) -> dict[str, Any]:
        """Keep these leases alive; which of them are gone, and which were asked to stop (and why)."""
        now = time()
        gone: list[str] = []
        cancel: dict[str, str] = {}  # run_id -> why it was asked to stop
        for r in run_ids:
            lease = self.leases.get(r)
            if lease is None:
                gone.append(r)
                continue
            lease["seen_at"] = lease["refreshed_at"] = now
            if lease["cancel"]:
                cancel[r] = lease["cancel_reason"] or "cancelled"
        return {"gone": gone, "cancel": cancel, "lease_timeout_s": self.lease_timeout_s}

    def begin(self, run_id: str, worker: str, key: str | None = None) -> dict[str, Any]:
        """The worker is about to start the body (task ``key``): only if the lease is still held, for it."""
        lease = self.leases.get(run_id)
        if lease is None or lease["worker"] != worker or lease["cancel"]:
            return {"ok": False, "lease_timeout_s": self.lease_timeout_s}
        lease["started_at"] = lease["seen_at"] = time()
        lease["key"] = key
        # the board's limit is the last claim's on it, not this run's own: bodies start in any
        # order, and one placed earlier (at its own limit) may start after a later claim reset it
        return {"ok": True, "lease_timeout_s": self.lease_timeout_s, "power_limit_w": lease["power_limit_w"],
                "client": lease["client"]}

    def connected(self, clients: list[str]) -> dict[str, bool]:
        """Which of these Dask clients the scheduler has connected now (a placer back after a blip)."""
        known = self.scheduler.clients if self.scheduler is not None else {}
        return {c: c in known for c in clients}

    def lift(self, run_id: str, from_w: float) -> dict[str, Any]:
        """The run's worker put its board back to its full limit (the run measured short under
        ``from_w``): every lease of that GPU says so, if the board's limit is still ``from_w``,
        and the GPU's version is bumped, so a decision taken on the lower limit is refused and
        decides again on the board as it is."""
        lease = self.leases.get(run_id)
        if lease is None or lease["power_limit_w"] is None or abs(lease["power_limit_w"] - float(from_w)) > 1e-6:
            return {"ok": False}  # gone, or a later claim set the board's limit since
        for other in self.leases.values():
            if other["gpu_id"] == lease["gpu_id"]:
                other["power_limit_w"] = None
        self._count("limits_lifted")
        return {"ok": True, "version": self._bump(lease["gpu_id"])}

    def release(self, run_id: str, if_unstarted: bool = False, store: str | None = None,
                row: dict[str, Any] | None = None, client: str | None = None) -> dict[str, Any]:
        """Free the run's slot; with ``if_unstarted``, only if its body never started.

        The placing process releases with ``if_unstarted``: once the body runs, the worker
        holds the lease and frees it when the body really stops, so a run abandoned by its
        placing process (cancelled, interrupted) keeps its slot for as long as it computes.
        The worker releases with its record of the run (``store``, ``row``), in the same call: if
        nobody waits for the run's outcome any more, the record waits for a placing process to
        log it; otherwise it is kept until the placer says it has (:meth:`logged`), or its
        client leaves first. A record whose lease is gone already (it lapsed, or its worker was
        taken for gone, while the body ran on) waits for collection too, its placer's (``client``)
        first: that placer logged the run as lost, with none of the steps the body did.
        """
        lease = self.leases.get(run_id)
        if lease is None:
            self._remember_released(run_id)
            if store is not None and row is not None and run_id not in self.undelivered:
                self.deposit(run_id, store, row, client)
            return {"released": False, "started": None, "placer_lost": False}
        if if_unstarted and lease["started_at"] is not None:
            return {"released": False, "started": True, "placer_lost": False}
        self._drop(run_id, "released")
        self._remember_released(run_id)
        # nobody waits for this run's outcome any more: its worker should hand in the measurement
        placer_lost = lease["cancel_reason"] in HAND_IN_REASONS or (
            lease["client"] is not None and self.scheduler is not None
            and lease["client"] not in self.scheduler.clients)
        kept = False
        if store is not None and row is not None:
            if placer_lost:
                self.deposit(run_id, store, row, lease["client"], lease["gpu_id"])
            elif lease.get("acks_logged") and lease["client"] is not None:
                self._keep(run_id, store, row, lease["client"], lease["gpu_id"])
                kept = True
        return {"released": True, "started": lease["started_at"] is not None, "placer_lost": placer_lost,
                "client": lease["client"], "gpu_id": lease["gpu_id"], "kept": kept}

    def cancel(self, run_id: str, reason: str = "cancelled by its placing process") -> dict[str, Any]:
        """Ask the body to stop: its next progress report raises; the slot is freed when it has."""
        lease = self.leases.get(run_id)
        if lease is None:
            return {"ok": False}
        self._ask_stop(lease, reason)
        return {"ok": True}

    # -- runs whose placing process was lost ---------------------------------------------
    def _hold(self, run_id: str, store: str, row: dict[str, Any] | None, client: str | None,
              gpu_id: str | None) -> None:
        if run_id not in self.undelivered and len(self.undelivered) >= MAX_UNDELIVERED:
            oldest = next(iter(self.undelivered))
            log.warning("gogh ledger: %d runs of lost placing processes were never collected; "
                        "dropping the oldest (run %s): start a placing process that logs to its tracking "
                        "store", MAX_UNDELIVERED, oldest)
            del self.undelivered[oldest]
            self._count("undelivered_dropped")
        self.undelivered[run_id] = {"store": store, "row": row, "gpu_id": gpu_id, "client": client,
                                    "since": time(), "taker": None, "taken_at": None}

    def deposit(self, run_id: str, store: str, row: dict[str, Any], client: str | None = None,
                gpu_id: str | None = None) -> dict[str, Any]:
        """Keep a lost placer's run measurement until a process logging to ``store`` collects it."""
        self._hold(run_id, store, row, client, gpu_id)
        self._count("deposited")
        return {"ok": True}

    def collect(self, store: str, client: str, limit: int = 100) -> dict[str, Any]:
        """Lost placers' runs for ``store`` nobody is delivering now; ``client`` delivers them from here on.

        Each is handed out a lease timeout after its placer's client left (to that client
        itself, back after a dropped connection, at once), with
        ``placer_gone``: whether that client is still away (a placer that only lost its
        connection and came back within that time ends its flow run itself; one with no
        measurement is then forgotten). One collected but not said delivered within a lease timeout (or whose
        collector left) is handed out again: delivery is at least once, and the idempotency
        key makes it once.
        """
        now = time()
        due = now - self.lease_timeout_s
        clients = self.scheduler.clients if self.scheduler is not None else {}
        rows = []
        for run_id, entry in list(self.undelivered.items()):
            # its own placer, back after a dropped connection, takes it at once: Dask cancelled
            # its run, and the worker's record of what the body did is the one to log
            if entry["store"] != store or (entry["since"] > due and entry["client"] != client):
                continue
            gone = entry["client"] is None or entry["client"] not in clients
            if entry["row"] is None and not gone:
                del self.undelivered[run_id]  # its placer is back and carries on with the run
                continue
            stale = entry["taken_at"] is not None and entry["taken_at"] < now - self.lease_timeout_s
            if entry["taker"] is None or stale:
                entry["taker"], entry["taken_at"] = client, now
                rows.append({"run_id": run_id, "row": entry["row"], "gpu_id": entry["gpu_id"],
                             "placer_gone": gone})
                if len(rows) >= limit:
                    break
        return {"rows": rows}

    def _keep(self, run_id: str, store: str, row: dict[str, Any], client: str, gpu_id: str) -> None:
        self.kept[run_id] = {"store": store, "row": row, "gpu_id": gpu_id, "client": client, "since": time()}
        self._count("kept")

    def _age_kept(self, now: float) -> None:
        """A record its placer has not said it logged for :data:`KEPT_FOR_S` becomes undelivered: the
        placer gave the run up (its record says nothing was measured, and this one supersedes it),
        or its word was lost (then logging it again by its key changes nothing)."""
        for run_id in [r for r, e in self.kept.items() if e["since"] < now - max(KEPT_FOR_S, 4 * self.lease_timeout_s)]:
            self._unkeep(run_id)
            self._count("kept_unacknowledged")

    def _unkeep(self, run_id: str) -> None:
        """A kept record up for collection, as a lost placer's (its placer first)."""
        e = self.kept.pop(run_id)
        self._hold(run_id, e["store"], e["row"], e["client"], e["gpu_id"])

    def logged(self, run_ids: list[str], client: str | None = None) -> dict[str, Any]:
        """The placing process (``client``) has logged these runs itself: their workers' records are
        not needed, kept or, after a blip of its connection, waiting for collection."""
        n = sum(self.kept.pop(r, None) is not None for r in run_ids)
        if client is not None:
            for r in run_ids:
                e = self.undelivered.get(r)
                if e is not None and e["client"] == client and e["taker"] is None:
                    del self.undelivered[r]
                    n += 1
        self._count("logged", n)
        return {"logged": n}

    def delivered(self, run_ids: list[str]) -> dict[str, Any]:
        taken = [e for e in (self.undelivered.pop(r, None) for r in run_ids) if e is not None]
        n = sum(e["row"] is not None for e in taken)
        self._count("delivered", n)  # measurements logged
        self._count("unstarted_reported", len(taken) - n)  # lost before their body started
        return {"delivered": n}


    def put_features(self, job_type: str, doc: str | None = None) -> dict[str, Any]:
        """Keep a job type's layer features (the first published stays: a job type names one model
        at one batch size); with no ``doc``, only say whether they are here (``ok``). A placer asks
        so at every placement and sends them when they are not (a restarted scheduler, or one
        past its cap, where the oldest entries go)."""
        if doc is None:
            return {"ok": job_type in self.features}
        if job_type not in self.features:
            if len(doc) > MAX_FEATURES_DOC:
                return {"ok": False, "reason": f"{len(doc)} characters, more than {MAX_FEATURES_DOC}"}
            while len(self.features) >= MAX_FEATURE_TYPES:
                del self.features[next(iter(self.features))]
            self.features[job_type] = doc
        return {"ok": True}

    def get_features(self, job_types: list[str]) -> dict[str, str | None]:
        return {t: self.features.get(t) for t in job_types}


def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload gogh_flows.runtime.ledger``: the ledger from the first second."""
    scheduler.add_plugin(LedgerPlugin(), name=PLUGIN_NAME, idempotent=True)

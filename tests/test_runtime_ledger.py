"""The pool's ledger, kept by its Dask scheduler: compare-and-set claims, leases, worker departure."""

from __future__ import annotations

import json

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from gogh_flows.runtime import emulated_pool
from gogh_flows.runtime.ledger import LedgerPlugin, lease_timeout_from_env
from gogh_flows.runtime.worker import RunNotStarted
from gogh_flows.truth.table import ThroughputTable
from waits import until


def _truth() -> ThroughputTable:
    rows = [{"job_type": "a", "gpu_type": t, "scale_factor": 1, "throughput": 100.0} for t in ("v100", "t4")]
    rows += [{"job_type": "a", "gpu_type": t, "scale_factor": 1, "partner": "a", "throughput": 50.0,
              "partner_throughput": 50.0} for t in ("v100", "t4")]
    return ThroughputTable.from_rows(rows, source="hand-made")


@pytest.fixture
def pool():
    with emulated_pool("v100=2,t4=1", truth=_truth(), capacity=2, lease_timeout_s=1.0) as p:
        yield p


def _claim(ledger, run_id, gpu="v100-0", version=None, capacity=2):
    if version is None:
        version = ledger.state().version(gpu)
    return ledger.claim(run_id, gpu, worker=gpu, capacity=capacity, job_type="a", required_throughput=5.0,
                        work=100.0, expect_version=version)


def test_claim_is_compare_and_set_on_the_version_the_decision_saw(pool):
    ledger = pool.ledger
    seen = ledger.state()
    first = _claim(ledger, "r1", version=seen.version("v100-0"))
    assert first.ok
    # a second decision taken on the same snapshot did not see r1: refused, re-plan
    stale = _claim(ledger, "r2", version=seen.version("v100-0"))
    assert not stale.ok and stale.reason == "changed" and stale.version == first.version
    assert _claim(ledger, "r2").ok  # decided again on the new state
    assert _claim(ledger, "r2").ok  # claiming what it holds: a retried call
    full = _claim(ledger, "r3")
    assert not full.ok and full.reason == "full"
    held = _claim(ledger, "r1", gpu="t4-0")
    assert not held.ok and held.reason == "held"
    occ = ledger.state().occupants()
    assert [lease.run_id for lease in occ["v100-0"]] == ["r1", "r2"]
    assert ledger.release("r1") and not ledger.release("r1")
    assert [lease.run_id for lease in ledger.state().occupants()["v100-0"]] == ["r2"]


def test_a_claim_on_a_gpu_whose_worker_is_not_in_the_pool_is_refused(pool):
    claim = pool.ledger.claim("r1", "v100-7", worker="v100-7", capacity=2, job_type="a",
                              required_throughput=1.0, work=1.0, expect_version=0)
    assert not claim.ok and claim.reason == "gone"


def test_forty_threads_deciding_on_one_snapshot_each_get_at_most_one_winner_per_version(pool):
    ledger = pool.ledger
    barrier = threading.Barrier(40)

    def race(i: int) -> bool:
        seen = ledger.state()
        barrier.wait()
        return _claim(ledger, f"r{i}", gpu=f"v100-{i % 2}", version=seen.version(f"v100-{i % 2}")).ok

    with ThreadPoolExecutor(max_workers=40) as ex:
        won = list(ex.map(race, range(40)))
    assert sum(won) == 2  # one per GPU: every other claim saw a stale version
    assert {len(v) for v in ledger.state().occupants().values()} == {1}


def test_a_claim_whose_client_leaves_is_dropped_at_once(pool):
    from distributed import Client

    from gogh_flows.runtime.leases import PoolLedger

    assert not pool.ledger.state().leases  # registered on the scheduler
    with Client(pool.client.scheduler.address, set_as_default=False) as other:
        doomed = PoolLedger(other, register=False)
        assert _claim(doomed, "doomed", gpu="t4-0").ok
        doomed.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pool.ledger.get("doomed") is not None:
        time.sleep(0.05)
    assert pool.ledger.get("doomed") is None and pool.ledger.state().counts["client_left"] == 1
    assert pool.ledger.why_dropped("doomed") == "client_left"


class _FakeScheduler:
    """Just what the ledger reads of Dask's state: connected clients, tasks, workers."""

    def __init__(self) -> None:
        self.clients: dict[str, object] = {"c1": SimpleNamespace(last_seen=time.time())}  # a ClientState
        self.tasks: dict[str, object] = {}
        self.workers: dict[str, object] = {}
        self.handlers: dict[str, object] = {}
        self.periodic_callbacks: dict[str, object] = {}


def test_a_lease_lapses_only_when_unrefreshed_and_dask_shows_its_holder_gone():
    import types

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}

    def claim(run_id: str, client: str) -> None:
        assert plugin.claim(run_id, "v100-0", "v100-0", 9, "a", 1.0, 1.0,
                            plugin.version_of("v100-0"), client=client)["ok"]

    claim("queued-live-client", "c1")
    claim("queued-dead-client", "c2")
    claim("running", "c1")
    claim("finished-unreleased", "c1")
    claim("running-on-a-hung-worker", "c1")
    plugin.begin("running", "v100-0", key="k-run")
    plugin.begin("finished-unreleased", "v100-0", key="k-done")
    plugin.begin("running-on-a-hung-worker", "v100-0", key="k-hung")
    now = time.time()
    sched.tasks["k-run"] = types.SimpleNamespace(state="processing",
                                                 processing_on=types.SimpleNamespace(name="v100-0", last_seen=now))
    # still "processing" for Dask, but its worker has sent no heartbeat for 5 s (stopped, or its
    # event loop blocked): Dask would wait for its worker-ttl, minutes
    sched.tasks["k-hung"] = types.SimpleNamespace(
        state="processing", processing_on=types.SimpleNamespace(name="v100-0", last_seen=now - 5.0))
    for lease in plugin.leases.values():
        lease["seen_at"] -= 5.0  # no refresh for 5 s: longer than the 1 s lease
    plugin._expire()
    # a refresh thread that missed its turn does not free a GPU whose holder Dask shows at work
    assert set(plugin.leases) == {"queued-live-client", "running"}
    assert plugin.counts["expired"] == 3
    assert set(plugin.why_dropped(list(plugin.dropped)).values()) == {"expired"} and len(plugin.dropped) == 3
    # a run that claims again is not the lease that was dropped: its old reason is not told of it
    claim("queued-dead-client", "c1")
    assert plugin.why_dropped(["queued-dead-client"]) == {"queued-dead-client": None}


def test_a_lease_kept_by_its_workers_heartbeat_lapses_a_timeout_after_that_heartbeat():
    """A lease whose refresh missed its turn is kept while Dask shows its worker heard; it was renewed
    to *now*, so a worker stopped just after its last heartbeat held its GPU for up to two lease
    timeouts (a review: 61 s for a 30 s lease). It counts from when the worker was last heard."""
    import types

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("running", "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_of("v100-0"),
                        client="c1")["ok"]
    plugin.begin("running", "v100-0", key="k-run")
    now = time.time()
    worker = types.SimpleNamespace(name="v100-0", last_seen=now - 0.5)  # heard half a timeout ago
    sched.tasks["k-run"] = types.SimpleNamespace(state="processing", processing_on=worker)
    plugin.leases["running"]["seen_at"] = now - 1.5  # its refreshes stopped
    plugin.awake_since = now - 10.0
    plugin._expire()
    assert "running" in plugin.leases  # the worker was heard: kept ...
    assert abs(plugin.leases["running"]["seen_at"] - (now - 0.5)) < 1e-6  # ... as of that heartbeat
    # the worker stopped after that heartbeat: 0.6 s on, a full timeout since it was last heard
    worker.last_seen -= 0.6
    plugin.leases["running"]["seen_at"] -= 0.6
    plugin._expire()
    assert "running" not in plugin.leases and plugin.counts["expired"] == 1


def test_the_ledgers_own_stall_restarts_every_leases_clock():
    """A scheduler that stood still (stopped, its event loop blocked) heard no refresh and no
    heartbeat meanwhile; its first expiry check on waking must not count that against the holders,
    or it frees GPUs that bodies still run on. Past a lease timeout after waking, unheard holders
    lapse as usual."""
    import types
    from time import monotonic

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    for run_id, client in (("running", "c1"), ("queued", "c2")):  # c2: a client Dask no longer shows
        assert plugin.claim(run_id, "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_of("v100-0"),
                            client=client)["ok"]
    plugin.begin("running", "v100-0", key="k-run")
    plugin._expire()  # the check runs, then the scheduler stands still for 5 s
    plugin._ticked = monotonic() - 5.0
    now = time.time()
    sched.tasks["k-run"] = types.SimpleNamespace(
        state="processing", processing_on=types.SimpleNamespace(name="v100-0", last_seen=now - 5.0))
    for lease in plugin.leases.values():
        lease["seen_at"] = now - 5.0  # the refreshes sent meanwhile are still unread
    plugin._expire()
    assert set(plugin.leases) == {"running", "queued"} and not plugin.counts.get("expired")
    # the holders are never heard from again: each lapses a lease timeout after the ledger woke
    plugin.awake_since -= 1.5
    plugin._expire()
    assert not plugin.leases and plugin.counts["expired"] == 2


def _last_heard(plugin, sched, at: float) -> None:
    """The running lease's worker and its refresh last heard at ``at`` (scheduler time)."""
    import types

    sched.tasks["k-run"] = types.SimpleNamespace(
        state="processing", processing_on=types.SimpleNamespace(name="v100-0", last_seen=at))
    plugin.leases["running"]["seen_at"] = at


def test_a_stall_of_more_than_half_the_lease_restarts_the_clocks_of_a_four_second_lease():
    """docs/runtime.md: a stall of more than half the lease timeout is forgiven. With a 4 s lease
    (1 s checks) a stall of 3 s was not (the bar was four checks), and a lease refreshed 1.5 s
    before it began looked lapsed on waking: its body would be stopped."""
    from time import monotonic

    plugin = LedgerPlugin(4.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin._every_s = 1.0  # what start() sets for a 4 s lease
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("running", "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_base, client="c1")["ok"]
    plugin.begin("running", "v100-0", key="k-run")
    plugin._expire()
    plugin._ticked = monotonic() - 3.0  # the scheduler stood still for 3 s
    now = time.time()
    _last_heard(plugin, sched, now - 4.5)
    plugin._expire()
    assert set(plugin.leases) == {"running"} and not plugin.counts.get("expired")
    # a gap of one check's period is no stall: the same lease, unheard, lapses
    plugin._ticked = monotonic() - 1.0
    plugin.awake_since = now - 10.0
    plugin._expire()
    assert not plugin.leases and plugin.counts["expired"] == 1


def test_a_claim_of_a_placing_process_that_hung_lapses_though_its_client_is_connected():
    """docs/runtime.md: a holder that hung without Dask noticing does not keep a GPU. Dask keeps a
    silent client connected, and an unstarted claim was kept for as long as its client was: a
    placing process stopped between its claim and its body's start held the slot indefinitely.
    Its client's heartbeats (every 5 s) must be heard too, three of them or a lease timeout."""
    import types

    plugin = LedgerPlugin(4.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    now = time.time()
    sched.clients = {"beating": types.SimpleNamespace(last_seen=now - 10.0),
                     "hung": types.SimpleNamespace(last_seen=now - 20.0)}
    for run_id in ("beating", "hung"):
        assert plugin.claim(run_id, "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_of("v100-0"),
                            client=run_id)["ok"]
        plugin.leases[run_id]["seen_at"] = now - 5.0  # its refreshes stopped a lease timeout ago
    plugin._expire()
    assert set(plugin.leases) == {"beating"} and plugin.counts["expired"] == 1


def test_an_unstarted_claim_nobody_refreshes_lapses_though_its_placers_client_beats():
    """A claim its placing process gave up on (timed out on a stalled scheduler, then taken) is
    refreshed by nobody, while that process's client goes on beating: the ledger kept it for the
    process's whole life (a review reproduced it with a stopped scheduler). Client liveness now
    excuses a missed refresh for UNSTARTED_GRACE lease timeouts, not for ever."""
    from gogh_flows.runtime.ledger import UNSTARTED_GRACE

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    for run_id in ("forgotten", "refreshed"):
        assert plugin.claim(run_id, "v100-0", "v100-0", 9, "a", 1.0, 1.0,
                            plugin.version_of("v100-0"), client="c1")["ok"]
    now = time.time()
    for lease in plugin.leases.values():
        lease["seen_at"] = lease["refreshed_at"] = now - 2.0  # a refresh missed: the client still beats
    plugin.scheduler.clients["c1"].last_seen = now
    plugin._expire()
    assert set(plugin.leases) == {"forgotten", "refreshed"}  # a missed refresh alone is forgiven
    plugin.refresh(["refreshed"])
    plugin.leases["forgotten"]["refreshed_at"] = now - UNSTARTED_GRACE * 1.0 - 0.5
    plugin.leases["forgotten"]["seen_at"] = now - 2.0
    plugin._expire()
    assert set(plugin.leases) == {"refreshed"} and plugin.why_dropped(["forgotten"]) == {"forgotten": "expired"}


def test_a_claim_that_reaches_the_ledger_after_its_release_is_refused():
    """The placing process gave its claim up (timed out) and released it; the claim, still in
    flight, may be read after the release. Taken then, nobody would hold or free it."""
    plugin = LedgerPlugin(1.0)
    plugin.scheduler = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.release("late", if_unstarted=True) == {"released": False, "started": None, "placer_lost": False}
    late = plugin.claim("late", "v100-0", "v100-0", 2, "a", 1.0, 1.0, plugin.version_base, client="c1")
    assert not late["ok"] and late["reason"] == "released" and "released before this claim" in late["detail"]
    assert not plugin.leases and plugin.counts["refused_released"] == 1
    # a run released after its claim cannot claim again under the same id either (a retry is a new id)
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, plugin.version_base, client="c1")["ok"]
    assert plugin.release("r1")["released"]
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, plugin.versions["v100-0"],
                        client="c1")["reason"] == "released"


def test_the_ledger_remembers_a_bounded_number_of_released_runs(monkeypatch):
    import gogh_flows.runtime.ledger as ledger_mod

    monkeypatch.setattr(ledger_mod, "RELEASED_KEPT", 3)
    plugin = LedgerPlugin(1.0)
    for i in range(5):
        plugin.release(f"r{i}")
    assert list(plugin.released) == ["r2", "r3", "r4"]


def test_a_step_of_the_schedulers_wall_clock_is_taken_for_a_stall():
    """NTP stepping the clock, or a resume from suspend (which the monotonic clock leaves out),
    ages every lease at once with no monotonic gap: the first check after it dropped live leases
    (a review: +45 s dropped a refreshing placer's claim). It restarts the clocks, as a stall does."""
    from time import monotonic

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = sched = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("running", "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_base, client="c1")["ok"]
    plugin.begin("running", "v100-0", key="k-run")
    plugin._expire()
    # the next check, one period later by the monotonic clock, finds the wall clock 45 s on
    plugin._ticked, plugin._ticked_wall = monotonic() - 0.25, time.time() - 45.25
    stepped = time.time()
    _last_heard(plugin, sched, stepped - 45.0)
    plugin._expire()
    assert set(plugin.leases) == {"running"} and not plugin.counts.get("expired")
    assert plugin.awake_since >= stepped


def test_a_step_back_of_the_wall_clock_does_not_keep_a_dead_holders_lease():
    """After the clock steps back an hour, times stamped before it lie in the future: a lease
    whose holder is gone outlived it by the size of the step (a review)."""
    from time import monotonic

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = _FakeScheduler()
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("orphan", "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_base, client="gone")["ok"]
    plugin._expire()
    plugin.leases["orphan"]["seen_at"] = plugin.leases["orphan"]["refreshed_at"] = time.time() + 3600.0
    plugin._ticked, plugin._ticked_wall = monotonic() - 0.25, time.time() + 3600.25  # the step back
    plugin._expire()
    assert plugin.leases["orphan"]["seen_at"] <= time.time()  # clamped to now, then it lapses as usual
    plugin.awake_since -= 1.5
    plugin.leases["orphan"]["seen_at"] -= 1.5
    plugin._expire()
    assert not plugin.leases


def test_each_started_ledger_counts_versions_from_its_own_random_base():
    """A decision read from a ledger a scheduler restart replaced must not match the new ledger's
    versions by coincidence (both counted from 0): each ledger starts at a random base, and the
    state it gives says where, so a fresh GPU's version is still known to placers."""
    import asyncio
    from unittest import mock

    from gogh_flows.runtime.leases import LedgerState

    bases = set()
    for _ in range(3):
        plugin = LedgerPlugin(1.0)
        sched = _FakeScheduler()
        plugin._every_s = 1.0
        with mock.patch("gogh_flows.runtime.ledger.PeriodicCallback"):  # no loop: no expiry checks
            asyncio.run(plugin.start(sched))
        state = plugin.state()
        bases.add(state["version_base"])
        view = LedgerState(**{k: state[k] for k in ("now", "lease_timeout_s", "versions", "counts")},
                           leases=(), workers=frozenset(), version_base=state["version_base"])
        plugin.names = {"tcp://w": "v100-0"}
        assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, view.version("v100-0"), client="c1")["ok"]
        assert not plugin.claim("r2", "v100-0", "v100-0", 2, "a", 1.0, 1.0, view.version("v100-0"),
                                client="c1")["ok"]  # the same stale view: refused
        # a placing process from before the base reads a GPU never claimed as version 0: taken
        assert plugin.claim("old", "v100-1", "v100-1", 2, "a", 1.0, 1.0, 0, client="c1")["ok"] is False  # gone
        plugin.names["tcp://w1"] = "v100-1"
        assert plugin.claim("old", "v100-1", "v100-1", 2, "a", 1.0, 1.0, 0, client="c1")["ok"]
        assert plugin.claim("old2", "v100-1", "v100-1", 2, "a", 1.0, 1.0, 0, client="c1")["reason"] == "changed"
    assert len(bases) == 3


def test_a_release_the_scheduler_did_not_answer_is_sent_again_until_it_is(pool):
    """The placing process's clean-up release timed out (the scheduler stood still): it raised,
    and nothing sent it again, so a claim taken late stayed held. The process's keeper sends it
    again until the scheduler answers."""
    import logging

    ledger = pool.ledger
    assert _claim(ledger, "given-up", gpu="t4-0").ok
    real_call, failed = ledger._call, []

    def stalled(op, **kwargs):
        if op == "gogh_ledger_release" and not failed:
            failed.append(op)
            raise TimeoutError("the scheduler did not answer")
        return real_call(op, **kwargs)

    said: list[str] = []

    # a handler on the library's logger itself: caplog's, on the root logger, missed the keeper's
    # line when the test ran alone (a logging setup stopped it propagating)
    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    ledger._call = stalled
    said_handler, runtime_log = Said(logging.INFO), logging.getLogger("gogh_flows.runtime")
    level = runtime_log.level
    runtime_log.addHandler(said_handler)
    runtime_log.setLevel(logging.INFO)
    try:
        with pytest.raises(TimeoutError):
            ledger.release("given-up", if_unstarted=True, timeout_s=0.1)
        assert ledger.pending_releases() == ["given-up"]
        assert ledger.get("given-up") is not None  # still held: the release never reached the ledger
        # the keeper says so after the release has returned: wait for the line too, not only the state
        until(lambda: ledger.get("given-up") is None and not ledger.pending_releases()
              and "gogh: the release of run given-up reached the pool's scheduler" in said, "the release sent again",
              timeout_s=10)
    finally:
        runtime_log.removeHandler(said_handler)
        runtime_log.setLevel(level)
    assert failed == ["gogh_ledger_release"]
    assert ledger.state().counts.get("expired", 0) == 0  # released, not lapsed


def test_a_silent_worker_is_not_offered_to_placements_until_it_is_heard_again():
    """A hung worker (stopped, its event loop blocked) stays registered until Dask's worker-ttl
    (5 minutes): its running leases lapse within the lease timeout, but new runs were still
    pinned to it and waited in its queue (a Dask review). Placements now see only the workers
    heard from lately; `gogh pool status` lists the silent ones."""
    from gogh_flows.runtime.ledger import SILENT_WORKER_S

    plugin = LedgerPlugin(1.0)
    plugin.scheduler = sched = _FakeScheduler()
    now = time.time()
    sched.workers = {"tcp://a": SimpleNamespace(last_seen=now), "tcp://b": SimpleNamespace(last_seen=now - 60.0)}
    plugin.names = {"tcp://a": "v100-0", "tcp://b": "v100-1"}
    state = plugin.state()
    assert state["workers"] == ["v100-0"] and state["silent_workers"] == ["v100-1"]
    sched.workers["tcp://b"].last_seen = now - SILENT_WORKER_S + 2.0  # heard again
    assert plugin.state()["workers"] == ["v100-0", "v100-1"] and plugin.state()["silent_workers"] == []
    # nobody is heard while the scheduler itself stands still: a stall silences no worker
    sched.workers["tcp://b"].last_seen = now - 60.0
    plugin.awake_since = now
    assert plugin.state()["workers"] == ["v100-0", "v100-1"]


def test_worker_leaving_drops_its_leases_and_its_gpu_leaves_the_live_devices(pool):
    ledger = pool.ledger
    assert _claim(ledger, "r1", gpu="t4-0").ok and _claim(ledger, "r2", gpu="v100-0").ok
    address = next(a for a, w in pool.client.scheduler_info()["workers"].items() if w["name"] == "t4-0")
    pool.client.retire_workers([address], close_workers=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ledger.get("r1") is not None:
        time.sleep(0.05)
    state = ledger.state()
    assert ledger.get("r1") is None and ledger.get("r2") is not None
    assert "t4-0" not in state.workers and state.counts["worker_left"] == 1
    # why, for the placing process's error (it said "lease lapsed" of a killed worker's run)
    assert ledger.why_dropped("r1") == "worker_left" and ledger.why_dropped("r2") is None
    assert [d.id for d in pool.live_devices(state.workers)] == ["v100-0", "v100-1"]


def _advance(steps: int) -> int:
    from gogh_flows.runtime import current_gpu

    current_gpu().advance(steps)
    return steps


# bodies shipped to in-process workers are pickled: what they share with the test lives here
_GATE = threading.Event()
_GONE = SimpleNamespace(started_at=None)  # a lease no longer in the ledger: its body never starts there
_STEPS: list[int] = []


def _gated() -> str:
    _GATE.wait(10)
    return "done"


def _reporting() -> None:
    from gogh_flows.runtime import current_gpu

    for _ in range(200):
        current_gpu().report(1)
        _STEPS.append(1)
        time.sleep(0.05)


def test_the_worker_holds_the_lease_while_the_body_runs_and_frees_it_after(pool):
    ledger = pool.ledger
    assert _claim(ledger, "run-1").ok
    _GATE.clear()
    gate = _GATE
    future = pool.submit(_gated, gpu_id="v100-0", job_type="a", run_id="run-1", hold_lease=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ledger.get("run-1").started_at is None:
        time.sleep(0.02)
    assert ledger.get("run-1").started_at is not None
    # the placing process lets go: a started body keeps its slot
    assert not ledger.release("run-1", if_unstarted=True)
    time.sleep(1.5)  # longer than the lease: the worker refreshes it
    assert ledger.get("run-1") is not None
    gate.set()
    assert future.result(timeout=10).value == "done"
    assert ledger.get("run-1") is None  # freed by the worker when the body ended


def test_a_body_whose_lease_is_gone_is_not_started(pool):
    _STEPS.clear()
    outcome = pool.run(_STEPS.append, 1, gpu_id="v100-0", job_type="a", run_id="never-claimed",
                       hold_lease=True)
    assert not _STEPS and isinstance(outcome.exception, RunNotStarted)
    with pytest.raises(RunNotStarted, match="place the run again"):
        outcome.unwrap()


def test_a_body_whose_start_the_scheduler_never_answers_is_not_started(pool, monkeypatch):
    """The worker asks the scheduler whether the body may start; one that never answers made the
    task wait for good. Asked with a bound (60 s or two lease timeouts; 1 s here), the run comes
    back not started, saying why, rather than failing with a bare TimeoutError."""
    import asyncio
    import functools

    import gogh_flows.runtime.worker as worker_module
    from gogh_flows.runtime.leases import WorkerLease

    async def hang(**_):
        await asyncio.sleep(3600)

    ledger = pool.ledger  # registers the ledger's handlers on the scheduler first
    monkeypatch.setattr(worker_module, "WorkerLease", functools.partial(WorkerLease, call_timeout_s=1.0))
    monkeypatch.setitem(pool.cluster.scheduler.handlers, "gogh_ledger_begin", hang)
    assert _claim(ledger, "unanswered").ok
    _STEPS.clear()
    t0 = time.monotonic()
    outcome = pool.run(_STEPS.append, 1, gpu_id="v100-0", job_type="a", run_id="unanswered", hold_lease=True)
    assert time.monotonic() - t0 < 20
    assert not _STEPS and isinstance(outcome.exception, RunNotStarted)
    assert "did not answer whether it may start" in str(outcome.exception)


def test_cancel_stops_the_body_at_its_next_report_and_then_frees_the_slot(pool):
    from gogh_flows.runtime.context import RunCancelled

    ledger = pool.ledger
    assert _claim(ledger, "run-c").ok
    steps = _STEPS
    steps.clear()
    future = pool.submit(_reporting, gpu_id="v100-0", job_type="a", run_id="run-c", hold_lease=True)
    until(lambda: (ledger.get("run-c") or _GONE).started_at is not None, "run-c's body started")
    assert ledger.cancel("run-c")
    outcome = future.result(timeout=10)
    assert isinstance(outcome.exception, RunCancelled) and len(steps) < 200
    assert outcome.telemetry.steps == len(steps)  # measured up to where it stopped
    assert ledger.get("run-c") is None


def test_a_started_body_whose_placing_process_leaves_is_stopped_then_its_slot_freed(pool):
    """A killed placer: nobody waits for the body any more, so it stops at its next report."""
    from distributed import Client

    from gogh_flows.runtime.context import RunCancelled
    from gogh_flows.runtime.leases import PoolLedger
    from gogh_flows.runtime.ledger import PLACER_LOST

    _STEPS.clear()
    assert not pool.ledger.state().leases  # registered on the scheduler
    with Client(pool.client.scheduler.address, set_as_default=False) as placer:
        led = PoolLedger(placer, register=False)
        assert _claim(led, "orphan").ok
        future = pool.submit(_reporting, gpu_id="v100-0", job_type="a", run_id="orphan", hold_lease=True)
        until(lambda: (pool.ledger.get("orphan") or _GONE).started_at is not None, "the orphan's body started")
        led.close()
    # while the body runs on, its slot stays taken (it is still computing)
    assert pool.ledger.get("orphan") is not None or future.done()
    outcome = future.result(timeout=10)
    assert isinstance(outcome.exception, RunCancelled) and PLACER_LOST in str(outcome.exception)
    assert len(_STEPS) < 200 and outcome.telemetry.steps == len(_STEPS)
    assert pool.ledger.get("orphan") is None
    assert pool.ledger.state().counts["orphaned"] == 1


def _row_for(store, outcome):
    return store, {"run_id": outcome.run_id, "steps": outcome.telemetry.steps, "error": outcome.error}


def _collect_when_due(ledger, store, timeout_s=5.0):
    """What the ledger hands out for ``store``: held a lease timeout after the placer's client left."""
    deadline = time.monotonic() + timeout_s
    while not (got := ledger.collect(store)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_the_measurement_of_a_lost_placers_run_is_kept_by_the_ledger_until_delivered(pool):
    """The worker hands it in; one collector at a time; a collector that leaves hands it back."""
    import functools

    from distributed import Client

    from gogh_flows.runtime.leases import PoolLedger

    _STEPS.clear()
    assert pool.ledger.state().undelivered == 0  # registered on the scheduler
    with Client(pool.client.scheduler.address, set_as_default=False) as placer:
        led = PoolLedger(placer, register=False)
        assert _claim(led, "lost").ok
        future = pool.submit(_reporting, gpu_id="v100-0", job_type="a", run_id="lost", hold_lease=True,
                             record_if_placer_lost=functools.partial(_row_for, "store-1"))
        until(lambda: (pool.ledger.get("lost") or _GONE).started_at is not None, "the lost run's body started")
        led.close()
    outcome = future.result(timeout=10)
    deadline = time.monotonic() + 5
    while pool.ledger.state().undelivered == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.ledger.state().undelivered == 1
    with Client(pool.client.scheduler.address, set_as_default=False) as first:
        taken = _collect_when_due(PoolLedger(first, register=False), "store-1")
        assert [x.run_id for x in taken] == ["lost"] and taken[0].placer_gone and taken[0].gpu_id == "v100-0"
        row = taken[0].row
        assert row["steps"] == outcome.telemetry.steps == len(_STEPS) and "RunCancelled" in row["error"]
        assert pool.ledger.collect("store-1") == []  # one collector at a time
    assert pool.ledger.collect("another-store") == []
    # the first collector left without saying it delivered: handed out again
    again = pool.ledger.collect("store-1")
    assert [x.run_id for x in again] == ["lost"]
    assert pool.ledger.delivered(["lost"]) == 1 and pool.ledger.delivered(["lost"]) == 0
    assert pool.ledger.state().undelivered == 0


def test_an_unstarted_claim_of_a_lost_placer_is_handed_to_its_store(pool):
    """No body ran, nothing was measured, but its flow run must still be ended by someone."""
    from distributed import Client

    from gogh_flows.runtime.leases import PoolLedger

    assert pool.ledger.state().undelivered == 0  # registered on the scheduler
    with Client(pool.client.scheduler.address, set_as_default=False) as placer:
        led = PoolLedger(placer, register=False)
        led.store = "store-1"
        assert _claim(led, "never-started").ok
        led.close()
    (lost,) = _collect_when_due(pool.ledger, "store-1")
    assert (lost.run_id, lost.row, lost.gpu_id, lost.placer_gone) == ("never-started", None, "v100-0", True)
    assert pool.ledger.get("never-started") is None  # its slot was freed when its client left
    assert pool.ledger.delivered(["never-started"]) == 0  # no measurement: counted apart
    counts = pool.ledger.state().counts
    assert counts["unstarted_reported"] == 1 and "delivered" not in counts


def test_a_placer_that_comes_back_is_not_reported_lost():
    """A client that reconnects (same id) carries on with its runs: nobody else ends them."""

    class Scheduler:
        clients = {"placer-1": SimpleNamespace(last_seen=time.time())}

    plugin = LedgerPlugin(0.4)
    plugin.scheduler = Scheduler()
    plugin.names = {"tcp://w": "v100-0"}
    base = plugin.version_base
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, base, client="placer-1", store="s")["ok"]
    assert plugin.claim("r2", "v100-0", "v100-0", 2, "a", 1.0, 1.0, base + 1, client="placer-1", store="s")["ok"]
    plugin.begin("r2", "v100-0", key="k2")
    plugin.remove_client(Scheduler(), "placer-1")  # the connection dropped...
    plugin.deposit("r2", "s", {"run_id": "r2"}, client="placer-1", gpu_id="v100-0")
    assert plugin.collect("s", "other")["rows"] == []  # not before a lease timeout
    # ...but its own placer, back, takes its worker's record at once (Dask cancelled the run)
    mine = plugin.collect("s", "placer-1")["rows"]
    assert [(r["run_id"], r["placer_gone"]) for r in mine] == [("r2", False)]
    plugin.undelivered["r2"]["taker"] = None  # as if that collector had left
    time.sleep(0.45)
    rows = plugin.collect("s", "other")["rows"]  # ...and it came back: r1 forgotten, r2's measurement kept
    assert [(r["run_id"], r["placer_gone"]) for r in rows] == [("r2", False)]
    assert set(plugin.undelivered) == {"r2"}


def test_a_collector_that_stays_connected_but_never_says_delivered_loses_the_run_after_a_lease():
    """Delivery is at least once: a taker still connected but silent for a lease timeout (hung,
    or its tracking store down) no longer holds the row, and its late word counts once."""

    class Scheduler:
        clients = {"collector-a": SimpleNamespace(last_seen=time.time()),
                   "collector-b": SimpleNamespace(last_seen=time.time())}

    plugin = LedgerPlugin(0.4)
    plugin.scheduler = Scheduler()
    plugin.deposit("r1", "s", {"run_id": "r1"}, client="placer-gone", gpu_id="v100-0")
    plugin.undelivered["r1"]["since"] -= 1.0  # its placer left more than a lease timeout ago
    taken = plugin.collect("s", "collector-a")["rows"]
    assert [(r["run_id"], r["placer_gone"]) for r in taken] == [("r1", True)]
    assert plugin.collect("s", "collector-b")["rows"] == []  # collector-a has it, and is connected
    time.sleep(0.45)  # ...but says nothing for a lease timeout
    again = plugin.collect("s", "collector-b")["rows"]
    assert [r["run_id"] for r in again] == ["r1"] and again[0]["row"] == {"run_id": "r1"}
    assert plugin.collect("s", "collector-a")["rows"] == []  # collector-b holds it now
    assert plugin.delivered(["r1"]) == {"delivered": 1}
    assert plugin.delivered(["r1"]) == {"delivered": 0}  # collector-a's late word: logged once
    assert plugin.counts["delivered"] == 1 and plugin.undelivered == {}


def test_a_run_whose_placer_stays_is_not_handed_in(pool):
    import functools

    assert _claim(pool.ledger, "kept").ok
    outcome = pool.run(_exits, gpu_id="v100-0", job_type="a", run_id="kept", hold_lease=True,
                       record_if_placer_lost=functools.partial(_row_for, "store-1"))
    assert outcome.telemetry.steps == 30
    assert pool.ledger.state().undelivered == 0 and "deposited" not in pool.ledger.state().counts
    # the worker's record is kept until the placer says it logged the run itself
    assert pool.ledger.state().counts["kept"] == 1
    assert pool.ledger.logged(["kept"]) == 1 and pool.ledger.logged(["kept"]) == 0


def test_a_placer_lost_after_its_runs_body_ended_still_gets_the_run_logged():
    """The worker frees the slot when the body ends, while the placer is still connected; the
    placer then logs the run. Killed in between, nobody held the measurement: the ledger had
    dropped the lease and the worker kept nothing (a concurrency review, replaying the handlers).
    The worker's record now comes with its release and stays until the placer says it logged
    the run, or, if its client leaves first, goes to the next placing process of the store."""

    class Scheduler:
        clients = {"placer-1": SimpleNamespace(last_seen=time.time()),
                   "collector": SimpleNamespace(last_seen=time.time())}

    plugin = LedgerPlugin(0.4)
    plugin.scheduler = Scheduler()
    plugin.names = {"tcp://w": "v100-0"}
    def ended(run: str, acks: bool = True) -> dict:
        assert plugin.claim(run, "v100-0", "v100-0", 9, "a", 1.0, 1.0, plugin.version_of("v100-0"),
                            client="placer-1", store="s", acks_logged=acks)["ok"]
        plugin.begin(run, "v100-0", key=f"k-{run}")
        return plugin.release(run, store="s", row={"run_id": run, "steps": 30.0})

    for run in ("r1", "r2"):
        released = ended(run)
        assert released["released"] and released["kept"] and not released["placer_lost"]  # the placer waits
    assert not ended("old", acks=False)["kept"]  # a placer that never says it logged a run: as before
    assert plugin.logged(["r1"], client="placer-1") == {"logged": 1}  # r1: the placer logged it itself
    assert plugin.collect("s", "collector")["rows"] == []  # r2 is still its placer's to log
    del Scheduler.clients["placer-1"]
    plugin.remove_client(Scheduler(), "placer-1")  # ...which was killed before it did
    time.sleep(0.45)  # a lease timeout later, the next placing process of the store logs it
    rows = plugin.collect("s", "collector")["rows"]
    assert [(r["run_id"], r["row"]["steps"], r["placer_gone"]) for r in rows] == [("r2", 30.0, True)]
    assert plugin.delivered(["r2"]) == {"delivered": 1} and plugin.kept == {} and plugin.undelivered == {}

    # a placer back after a blip that logged the run itself takes the handed-out record back
    Scheduler.clients["placer-1"] = SimpleNamespace(last_seen=time.time())
    ended("r3")
    plugin.remove_client(Scheduler(), "placer-1")
    assert set(plugin.undelivered) == {"r3"}
    assert plugin.logged(["r3"], client="placer-1") == {"logged": 1} and plugin.undelivered == {}
    # a placer that gave its run up (or whose word was lost) never says it: the record is handed
    # out after KEPT_FOR_S, its own placer first (it supersedes that placer's record of a lost run)
    ended("r4")
    plugin.kept["r4"]["since"] -= 3600
    plugin._expire()
    assert plugin.kept == {} and set(plugin.undelivered) == {"r4"}
    mine = plugin.collect("s", "placer-1")["rows"]
    assert [(r["run_id"], r["placer_gone"]) for r in mine] == [("r4", False)]
    # a record whose lease lapsed while the body ran on goes to its placer the same way
    assert plugin.release("gone-lease", store="s", row={"run_id": "gone-lease"}, client="placer-1")["released"] is False
    assert "gone-lease" in plugin.undelivered and plugin.undelivered["gone-lease"]["client"] == "placer-1"


def test_delivering_a_lost_placers_measurement_twice_logs_it_once(tmp_path):
    from gogh_flows.flows.lost_runs import deliver_lost_runs
    from gogh_flows.runtime.leases import LostRun
    from gogh_flows.tracking.measurements import Measurement, MeasurementLog

    log = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "measurements")
    m = Measurement(run_id="r1", flow_name="f", job_type="ResNet-50:64", family="ResNet-50", batch_size=64,
                    gpu_id="a100-0", gpu_type="a100", device="a100-0@a100-0", partners=(),
                    required_throughput=5.0, predicted_throughput=6.0, steps=40.0, duration_s=8.0,
                    throughput=5.0, mean_power_w=None, energy_j=None, status="failed", telemetry="emulated",
                    started_at=1.0, flow_run_url=None, extra={"logged_by": "worker"})

    class Ledger:
        def __init__(self):
            self.done = []

        def collect(self, store):
            assert store == log.store
            return [LostRun("r1", m.to_row(), "a100-0", placer_gone=False)]

        def delivered(self, run_ids):
            self.done += run_ids
            return len(run_ids)

    ledger = Ledger()
    assert deliver_lost_runs(ledger, log) == 1
    assert deliver_lost_runs(ledger, log) == 1  # handed out again (e.g. a lapsed collector)
    log.flush_spool()
    assert ledger.done == ["r1", "r1"]
    table = log.read()
    assert table.height == 1 and table["steps"].to_list() == [40.0]
    runs = log._client.search_runs([log._experiment_id_or_create()])
    assert len(runs) == 1


def _exits() -> None:
    import sys

    from gogh_flows.runtime import current_gpu

    current_gpu().advance(30)
    sys.exit(3)


def test_system_exit_in_a_body_is_measured_and_frees_the_slot(pool):
    ledger = pool.ledger
    assert _claim(ledger, "run-x").ok
    outcome = pool.run(_exits, gpu_id="v100-0", job_type="a", run_id="run-x", hold_lease=True)
    assert outcome.error.startswith("SystemExit") and outcome.telemetry.steps == 30
    assert ledger.get("run-x") is None
    with pytest.raises(SystemExit):
        outcome.unwrap()


def test_lease_timeout_is_checked():
    assert LedgerPlugin(2.5).lease_timeout_s == 2.5
    for bad in (0, -1, float("nan"), "soon"):
        with pytest.raises(ValueError, match="lease timeout"):
            lease_timeout_from_env(bad)


def test_a_user_models_features_are_published_again_to_a_ledger_that_forgot_them(tmp_path):
    """A restarted scheduler forgets what was published; a placer that sent its features once
    never sent them again, and the other machines' placements failed beside its runs."""
    from gogh_flows.flows.features import FeatureStore
    from gogh_flows.runtime.ledger import LedgerPlugin
    from gogh_flows.workloads import zoo_features

    class Wire:  # the two PoolLedger calls, straight to a ledger in this process
        def __init__(self) -> None:
            self.plugin = LedgerPlugin()

        def put_features(self, job_type, doc=None):
            return self.plugin.put_features(job_type, doc)["ok"]

        def features(self, job_types):
            return {t: d for t, d in self.plugin.get_features(job_types).items() if d is not None}

    wire = Wire()
    mine = FeatureStore(tmp_path / "a", shared=lambda: wire)
    theirs = FeatureStore(tmp_path / "b", shared=lambda: wire)
    feats = zoo_features("ResNet-18", 16)
    mine.put("MyNet (batch size 16)", feats)
    assert theirs.get("MyNet (batch size 16)").to_dict() == feats.to_dict()
    wire.plugin = LedgerPlugin()  # the scheduler restarted
    elsewhere = FeatureStore(tmp_path / "c", shared=lambda: wire)
    with pytest.raises(KeyError, match="no layer features recorded for job type 'MyNet"):
        elsewhere.get("MyNet (batch size 16)")
    mine.put("MyNet (batch size 16)", feats)  # its next placement sends them again
    assert FeatureStore(tmp_path / "d", shared=lambda: wire).get("MyNet (batch size 16)").to_dict() == feats.to_dict()
    # a zoo job type is never sent: every process rebuilds it from its name
    mine.put("ResNet-18 (batch size 16)", feats)
    assert "ResNet-18 (batch size 16)" not in wire.plugin.features


def test_a_worker_releasing_to_an_older_ledger_frees_its_slot_and_hands_in_a_lost_placers_run():
    """A scheduler preloaded with an older gogh takes no record with the release (TypeError): the
    worker frees the slot the old way and, as before, hands the record in only for a lost placer."""
    from gogh_flows.runtime.leases import WorkerLease

    class OlderLedger(LedgerPlugin):
        def release(self, run_id, if_unstarted=False):  # the signature before records came with it
            return super().release(run_id, if_unstarted)

    class Scheduler:
        clients = {"placer-1": SimpleNamespace(last_seen=time.time())}

    plugin = OlderLedger(1.0)
    plugin.scheduler = Scheduler()
    plugin.names = {"tcp://w": "v100-0"}

    def call(op, *, timeout_s=None, **kwargs):
        return {"gogh_ledger_release": plugin.release, "gogh_ledger_deposit": plugin.deposit}[op](**kwargs)

    for run, lost in (("r1", False), ("r2", True)):
        assert plugin.claim(run, "v100-0", "v100-0", 2, "a", 1.0, 1.0, plugin.version_of("v100-0"),
                            client="placer-1", store="s")["ok"]
        plugin.begin(run, "v100-0", key=f"k-{run}")
        if lost:
            del Scheduler.clients["placer-1"]
        assert WorkerLease(run, call, on_cancel=lambda reason: None).end(("s", {"run_id": run})) is lost
    assert run not in plugin.leases and list(plugin.undelivered) == ["r2"] and plugin.kept == {}


def test_a_damaged_features_file_is_set_aside_and_the_features_found_again(tmp_path, caplog):
    """A features file left empty (a power loss after an unsynced rename) or truncated made every
    retraining fail with its JSON error (a concurrency review). It is kept aside as ``.bad`` and
    the features rebuilt (a zoo type) or looked up again (a user model, from the ledger); new
    files are written whole and synced (``gogh_flows.durable``)."""
    from gogh_flows.flows.features import FeatureStore
    from gogh_flows.workloads import zoo_features

    store = FeatureStore(tmp_path)
    feats = zoo_features("ResNet-18", 16)
    store.put("ResNet-18 (batch size 16)", feats)
    path = store._path("ResNet-18 (batch size 16)")
    assert json.loads(path.read_text())["features"] == feats.to_dict()
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]  # no temporary file left behind
    path.write_text("")  # what a power loss left
    with caplog.at_level("WARNING", logger="gogh_flows"):
        again = FeatureStore(tmp_path).get("ResNet-18 (batch size 16)")
    assert again.to_dict() == feats.to_dict()
    assert path.with_suffix(".json.bad").exists() and "is damaged" in caplog.text


def test_the_ledgers_keeps_are_bounded_and_drop_the_oldest(monkeypatch, caplog):
    """A scheduler lives for weeks: the runs of lost placing processes nobody collects, and the
    features of job types published, are capped, the oldest dropped first, and a drop is counted
    and said (a test-suite review: no test reached the caps)."""
    from gogh_flows.runtime import ledger as ledger_mod

    monkeypatch.setattr(ledger_mod, "MAX_UNDELIVERED", 3)
    monkeypatch.setattr(ledger_mod, "MAX_FEATURE_TYPES", 2)
    monkeypatch.setattr(ledger_mod, "MAX_FEATURES_DOC", 10)
    plugin = LedgerPlugin(1.0)
    with caplog.at_level("WARNING", logger="gogh_flows"):
        for i in range(5):
            plugin.deposit(f"run-{i}", "team", {"steps": float(i)})
        plugin.deposit("run-4", "team", {"steps": 4.5})  # a run already kept is replaced, nothing dropped
    assert list(plugin.undelivered) == ["run-2", "run-3", "run-4"]
    assert plugin.undelivered["run-4"]["row"] == {"steps": 4.5}
    assert plugin.counts["undelivered_dropped"] == 2
    assert caplog.text.count("were never collected; dropping the oldest") == 2 and "(run run-0)" in caplog.text
    # features: a document over the size cap is refused with the reason; past the count cap the
    # oldest type goes; the first published for a type stays
    assert plugin.put_features("big", "x" * 11) == {"ok": False, "reason": "11 characters, more than 10"}
    for t in ("a", "b", "c"):
        assert plugin.put_features(t, f"doc-{t}")["ok"]
    assert plugin.put_features("c", "other")["ok"] and plugin.get_features(["a", "b", "c"]) == {
        "a": None, "b": "doc-b", "c": "doc-c"}
    assert plugin.put_features("a") == {"ok": False}  # a placer asked: not here, send it again


def test_a_worker_leaving_drops_its_leases_unless_another_process_serves_its_name():
    """A worker restarted under its name (a nanny's restart, a new process before the old one's
    removal reached the scheduler) keeps the GPU's runs: only the last process serving a name
    takes its leases with it (a test-suite review: the branch had no test)."""
    plugin = LedgerPlugin(1.0)
    plugin.scheduler = _FakeScheduler()
    plugin.names = {"tcp://old": "v100-0", "tcp://new": "v100-0", "tcp://t4": "t4-0"}
    for run_id, gpu in (("on-v100", "v100-0"), ("on-t4", "t4-0")):
        assert plugin.claim(run_id, gpu, gpu, 2, "a", 1.0, 1.0, plugin.version_base, client="c1")["ok"]
    plugin.remove_worker(plugin.scheduler, "tcp://old", stimulus_id="test")
    assert set(plugin.leases) == {"on-v100", "on-t4"}  # the new process still serves v100-0
    plugin.remove_worker(plugin.scheduler, "tcp://new", stimulus_id="test")
    assert set(plugin.leases) == {"on-t4"} and plugin.counts.get("worker_left") == 1
    plugin.remove_worker(plugin.scheduler, "tcp://unknown", stimulus_id="test")  # never seen: nothing
    assert set(plugin.leases) == {"on-t4"}


def test_a_workers_lease_keeper_passes_a_stop_on_and_says_when_the_lease_is_gone(caplog):
    """The worker's side of a lease: a stop asked at the scheduler reaches the body (``on_cancel``);
    a lease dropped under a running body is said once, the body asked to stop (its GPU may be given
    away; a body running on did, unseen by the ledger, until it returned: 60 s in the hung-worker
    test), and no longer refreshed."""
    from gogh_flows.runtime.leases import WorkerLease

    answers = iter([{"cancel": {}, "gone": []}, {"cancel": {"r1": "cancelled in Prefect"}, "gone": []},
                    {"cancel": {}, "gone": ["r1"]}])
    calls: list[str] = []

    def call(op: str, **kwargs):
        calls.append(op)
        if op == "gogh_ledger_begin":
            return {"ok": True, "lease_timeout_s": 0.04}
        return next(answers)

    stops: list[str] = []
    lease = WorkerLease("r1", call, stops.append)
    with caplog.at_level("WARNING", logger="gogh_flows"):
        assert lease.begin("v100-0")
        lease._thread.join(10)
    assert not lease._thread.is_alive()  # it stopped refreshing a lease that is gone
    assert calls == ["gogh_ledger_begin"] + ["gogh_ledger_refresh"] * 3
    assert stops[0] == "cancelled in Prefect" and len(stops) == 2 and "lease was dropped" in stops[1], stops
    assert caplog.text.count("the lease of run r1 was dropped while its body runs") == 1


def test_a_scheduler_that_never_answers_holds_the_worker_no_longer_than_the_lease():
    """A scheduler that takes the call and never answers (hung, not gone) kept a worker's
    release waiting for good: the body's task never ended. Every call of the worker's lease is
    bounded, the release by the lease timeout (the lease lapses on its own then)."""
    import asyncio

    from distributed import Client, LocalCluster, get_worker

    from gogh_flows.runtime.leases import WorkerLease
    from gogh_flows.runtime.worker import _scheduler_call

    async def hang(**_):
        await asyncio.sleep(3600)

    def run_lease() -> tuple[bool, bool, float]:
        lease = WorkerLease("r1", _scheduler_call(get_worker()), on_cancel=lambda reason: None)
        started = lease.begin("w")
        t0 = time.monotonic()
        lost = lease.end(("store", {"run_id": "r1"}))
        return started, lost, time.monotonic() - t0

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        scheduler = cluster.scheduler
        scheduler.handlers["gogh_ledger_begin"] = lambda **_: {"ok": True, "lease_timeout_s": 1.0}
        scheduler.handlers["gogh_ledger_refresh"] = lambda **_: {"cancel": {}, "gone": []}
        scheduler.handlers["gogh_ledger_release"] = hang
        started, lost, took = client.submit(run_lease, pure=False).result(timeout=60)
    assert started and lost is False
    assert 0.9 <= took < 10.0  # the lease timeout (1 s), plus the keeper thread's join

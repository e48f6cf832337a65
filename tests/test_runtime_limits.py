"""Power limits chosen by a placement, enacted by the runtime (docs/runtime.md, "Power limits")."""

from __future__ import annotations

import json
import logging

import polars as pl
import pytest

from gogh_flows.energy import EnergyModel
from gogh_flows.flows.blocks import PlacementPolicy
from gogh_flows.flows.observations import observations_from_measurements
from gogh_flows.runtime import GpuDevice, current_gpu, emulated_pool
from gogh_flows.runtime.emulation import EmulatedMeter
from gogh_flows.runtime.ledger import LedgerPlugin
from gogh_flows.runtime.worker import Occupancy, RunSpec, execute
from test_runtime import small_truth

V100 = GpuDevice("v100-0", "v100", "v100-0")


def test_the_emulator_slows_and_caps_a_limited_board_by_the_energy_model():
    meter = EmulatedMeter(V100, job_type="a", truth=small_truth())
    meter.set_power_limit(160.0)
    meter.start()
    meter.advance(500)
    reading = meter.stop()
    # 'a' alone on a V100: 100 steps/s at 196 W at the maximum limit (test_runtime, by hand)
    slow, watts = EnergyModel().at_limit("v100", 196.0, 160.0)
    assert slow > 1 and watts < 196.0
    assert reading.throughput == pytest.approx(100.0 / slow)
    assert reading.mean_power_w == pytest.approx(watts)
    assert reading.power_limit_w == 160.0 and reading.limit_slowdown == pytest.approx(slow)


def test_a_join_sets_the_boards_limit_for_both_runs_and_an_empty_board_forgets_it():
    occ = Occupancy()
    first = EmulatedMeter(V100, job_type="a", truth=small_truth())
    second = EmulatedMeter(V100, job_type="b", truth=small_truth())
    first.start(), second.start()
    occ.join("v100-0", "r1", "a", first, None)
    occ.join("v100-0", "r2", "b", second, 150.0)
    assert first._limit == 150.0 and second._limit == 150.0 and occ.limit("v100-0") == 150.0
    occ.leave("v100-0", "r2")
    assert first._limit == 150.0  # the board keeps its limit while a run is on it
    occ.leave("v100-0", "r1")
    assert occ.limit("v100-0") is None


def _advance(steps: float) -> float:
    current_gpu().advance(steps)
    return steps


def test_a_pool_run_with_a_limit_is_measured_at_it():
    with emulated_pool({"v100": 1}, truth=small_truth()) as pool:
        full = pool.run(_advance, 500, gpu_id="v100-0", job_type="a").telemetry
        limited = pool.run(_advance, 500, gpu_id="v100-0", job_type="a", power_limit_w=160.0).telemetry
    assert full.power_limit_w is None and full.limit_slowdown == 1.0
    assert limited.power_limit_w == 160.0
    assert limited.throughput < full.throughput and limited.mean_power_w < full.mean_power_w
    assert limited.throughput * limited.limit_slowdown == pytest.approx(full.throughput)


def test_a_real_board_says_the_limit_is_not_applied(caplog):
    spec = RunSpec(device=GpuDevice("t4-0", "t4", "t4-0"), mode="remote", emulated=False, run_key="k",
                   run_id="run-1", check_worker=False, power_limit_w=50.0)
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"):
        outcome = execute(lambda: 7, (), {}, spec)
    assert outcome.value == 7
    assert "power limit 50 W chosen for run run-1 on t4-0 is not applied" in caplog.text


def test_the_ledger_sets_a_claims_limit_on_every_lease_of_the_board():
    plugin = LedgerPlugin(5.0)
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, 0)["ok"]
    assert plugin.claim("r2", "v100-0", "v100-0", 2, "b", 1.0, 1.0, 1, power_limit_w=180.0)["ok"]
    leases = {d["run_id"]: d for d in plugin.state()["leases"]}
    assert leases["r1"]["power_limit_w"] == 180.0 and leases["r2"]["power_limit_w"] == 180.0


def test_observations_are_learned_at_full_power():
    rows = [{"job_type": "a", "gpu_type": "v100", "partners": [], "throughput": 80.0, "steps": 500.0,
             "telemetry": "emulated", "window": "emulated", "extra": json.dumps({"limit_slowdown": "1.25"})},
            {"job_type": "b", "gpu_type": "v100", "partners": [], "throughput": 40.0, "steps": 500.0,
             "telemetry": "emulated", "window": "emulated", "extra": json.dumps({})}]
    obs = observations_from_measurements(pl.DataFrame(rows))
    got = dict(zip(obs["job_type"].to_list(), obs["throughput"].to_list()))
    assert got == {"a": pytest.approx(100.0), "b": pytest.approx(40.0)}


def test_placement_policy_levels_are_checked():
    assert PlacementPolicy(power_limit_levels=[0.0, 0.5]).power_limit_levels == [0.0, 0.5]
    with pytest.raises(ValueError, match="fractions of each GPU type's limit range"):
        PlacementPolicy(power_limit_levels=[1.5])


def test_a_body_that_starts_late_runs_at_the_boards_limit_not_its_own():
    """r1 is placed alone at 100 W; r2 joins and its placement puts the board back to full power.
    If r1's body starts after r2's, the board must stay at the last claim's limit: r1's own
    100 W would slow both runs far below what r2's decision promised (seen in the demo: a pair
    on an A100 at 100 W ran 6x slower than predicted)."""
    plugin = LedgerPlugin(5.0)
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, 0, power_limit_w=100.0)["ok"]
    assert plugin.claim("r2", "v100-0", "v100-0", 2, "b", 1.0, 1.0, 1, power_limit_w=None)["ok"]
    assert plugin.begin("r2", "v100-0", key="k2")["power_limit_w"] is None
    assert plugin.begin("r1", "v100-0", key="k1")["power_limit_w"] is None  # not its own 100 W

    calls = {"gogh_ledger_begin": lambda **kw: plugin.begin(kw["run_id"], kw["worker"], kw.get("key"))}
    from gogh_flows.runtime.leases import WorkerLease

    lease = WorkerLease("r1", lambda name, **kw: calls[name](**kw), on_cancel=lambda reason: None)
    assert lease.begin("v100-0", key="k1")
    assert lease.board_limit_known and lease.board_limit_w is None
    lease._stop.set()


# -- the limit guard: a run short of its requirement under a lowered limit lifts it ---------------
def _advance_chunks(n: int, chunk: float) -> float:
    for _ in range(n):
        current_gpu().advance(chunk)
    return n * chunk


def test_a_run_below_its_requirement_at_a_limit_lifts_the_board_to_its_maximum(caplog):
    """'a' alone on a V100 runs 100 steps/s at full power and 100 / slow at 160 W; promised 95,
    the board goes back to its maximum as soon as the warm-up is done (an emulated rate is exact)."""
    slow = EnergyModel().at_limit("v100", 196.0, 160.0)[0]
    assert 100.0 / slow < 95
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"), \
            emulated_pool({"v100": 1}, truth=small_truth()) as pool:
        lifted = pool.run(_advance_chunks, 100, 5.0, gpu_id="v100-0", job_type="a", power_limit_w=160.0,
                          required_throughput=95.0, run_id="short-run").telemetry
        kept = pool.run(_advance_chunks, 100, 5.0, gpu_id="v100-0", job_type="a", power_limit_w=160.0,
                        required_throughput=100.0 / slow * 0.99).telemetry
    assert "run short-run measured" in caplog.text and "below its required 95, at the board's 160 W limit: " \
        "the board goes back to its full limit" in caplog.text
    assert lifted.power_limit_w is None and lifted.limit_lifted_from_w == 160.0  # it ended at full power
    assert lifted.limit_lifted_rate == pytest.approx(100.0 / slow)  # what the next run of 'a' learns 160 W gives
    # the 5 warm-up steps at the limit, the other 495 at full power
    assert lifted.limit_slowdown == pytest.approx((5 * slow + 495) / 500)
    assert kept.power_limit_w == 160.0 and kept.limit_slowdown == pytest.approx(slow)  # met: left alone
    assert kept.limit_lifted_from_w is None


def test_a_body_that_advances_its_whole_work_at_once_is_guarded_after_its_warm_up():
    """One advance(500) (a body that reports once, or the declared work counted at the end) on a
    board whose limit leaves the run short: looked at when the warm-up ends, as a real board
    reporting step by step would be, so 5 steps run at the limit and 495 at full power, not all
    500 at a limit lifted once the work is done."""
    slow = EnergyModel().at_limit("v100", 196.0, 160.0)[0]
    with emulated_pool({"v100": 1}, truth=small_truth()) as pool:
        tel = pool.run(_advance_chunks, 1, 500.0, gpu_id="v100-0", job_type="a", power_limit_w=160.0,
                       required_throughput=95.0, warmup_steps=5).telemetry
    assert tel.limit_lifted_from_w == 160.0 and tel.limit_lifted_rate == pytest.approx(100.0 / slow)
    assert tel.limit_slowdown == pytest.approx((5 * slow + 495) / 500)


def test_the_guard_acts_only_on_enough_steps_and_only_on_a_limited_board():
    from gogh_flows.runtime.telemetry import WallClockMeter
    from gogh_flows.runtime.worker import LimitGuard

    t = [0.0]
    meter = WallClockMeter(clock=lambda: t[0], warmup_steps=5)
    occ = Occupancy()
    occ.join("v100-0", "r", "a", meter, 150.0)
    meter.watch = guard = LimitGuard(V100, "r", 50.0, occ)
    meter.start()
    for _ in range(9):  # 10 steps/s, far below 50, but the warm-up and 5 more steps are not done yet
        t[0] += 0.1
        meter.report(1)
    assert occ.limit("v100-0") == 150.0 and guard.lifted == []
    t[0] += 0.1
    meter.report(1)
    assert occ.limit("v100-0") is None and guard.lifted == [(150.0, pytest.approx(10.0))]
    t[0] += 0.1
    meter.report(1)  # at full power already: nothing more to do
    assert len(guard.lifted) == 1


def test_a_required_throughput_and_a_power_limit_must_be_possible():
    with emulated_pool({"v100": 1}, truth=small_truth()) as pool:
        with pytest.raises(ValueError, match="required_throughput must be > 0 steps/s or None, got 0"):
            pool.submit(_advance, 5, gpu_id="v100-0", job_type="a", required_throughput=0)
        # an emulated board enacts exactly what it is given: a limit no V100 can have is refused
        for bad, says in ((float("nan"), "watts > 0"), (-10.0, "watts > 0"), (50.0, "outside v100's range 150-300 W")):
            with pytest.raises(ValueError, match=says):
                pool.submit(_advance, 5, gpu_id="v100-0", job_type="a", power_limit_w=bad)


def test_the_ledger_hears_of_a_lift_and_a_decision_on_the_old_limit_is_refused():
    plugin = LedgerPlugin(5.0)
    plugin.names = {"tcp://w": "v100-0"}
    assert plugin.claim("r1", "v100-0", "v100-0", 2, "a", 1.0, 1.0, 0, power_limit_w=160.0)["ok"]
    assert plugin.claim("r2", "v100-0", "v100-0", 2, "b", 1.0, 1.0, 1, power_limit_w=160.0)["ok"]
    before = plugin.versions["v100-0"]
    assert not plugin.lift("r1", 200.0)["ok"]  # not the board's limit (a later claim changed it): left alone
    assert plugin.lift("r1", 160.0) == {"ok": True, "version": before + 1}
    leases = {d["run_id"]: d for d in plugin.state()["leases"]}
    assert leases["r1"]["power_limit_w"] is None and leases["r2"]["power_limit_w"] is None
    assert plugin.counts["limits_lifted"] == 1
    # a third run decided while the board was at 160 W: its claim names the old version
    assert plugin.claim("r3", "v100-0", "v100-0", 3, "c", 1.0, 1.0, before)["reason"] == "changed"


def test_a_pool_run_holding_its_lease_tells_the_ledger_when_its_board_is_lifted():
    with emulated_pool({"v100": 1}, truth=small_truth()) as pool:
        ledger = pool.ledger
        version = ledger.state().version("v100-0")
        assert ledger.claim("short", "v100-0", worker=pool.device("v100-0").worker, capacity=2, job_type="a",
                            required_throughput=95.0, work=500.0, expect_version=version, power_limit_w=160.0).ok
        outcome = pool.run(_advance_chunks, 100, 5.0, gpu_id="v100-0", job_type="a", run_id="short",
                           hold_lease=True, power_limit_w=160.0, required_throughput=95.0)
        assert outcome.telemetry.limit_lifted_from_w == 160.0
        assert ledger.state().counts["limits_lifted"] == 1


def test_a_failed_run_is_learned_from_by_what_it_did_before_it_failed():
    """The retraining said failed runs were not learned from while it learned from them (a new-user
    review): a failed run's steady window is the GPU's rate all the same, and is learned; a failed
    run with no step (nothing heard from it) is not."""
    rows = [{"job_type": "a", "gpu_type": "v100", "partners": [], "throughput": 40.0, "steps": 50.0,
             "status": "failed", "telemetry": "emulated", "window": "emulated", "extra": json.dumps({})},
            {"job_type": "b", "gpu_type": "v100", "partners": [], "throughput": 0.0, "steps": 0.0,
             "status": "failed", "telemetry": "none", "window": None, "extra": json.dumps({})}]
    obs = observations_from_measurements(pl.DataFrame(rows))
    assert obs["job_type"].to_list() == ["a"] and obs["throughput"].to_list() == [40.0]

from dataclasses import dataclass

import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.placement import BASELINES, GoghOptimizer, Gpu, get_policy
from gogh_flows.sim.engine import SimConfig, simulate
from gogh_flows.truth.table import ThroughputTable


@dataclass(frozen=True)
class J:
    id: str
    job_type: str
    total_steps: float
    arrival_s: float
    required_throughput: float | None
    num_gpus: int = 1


def _table() -> ThroughputTable:
    rows = []
    for jt, v100, t4, act in (("a", 10.0, 4.0, 0.5), ("b", 20.0, 5.0, 0.8)):
        rows.append({"job_type": jt, "gpu_type": "v100", "scale_factor": 1, "throughput": v100, "activity": act})
        rows.append({"job_type": jt, "gpu_type": "t4", "scale_factor": 1, "throughput": t4, "activity": act})
        rows.append({"job_type": jt, "gpu_type": "v100", "scale_factor": 2, "throughput": 1.8 * v100, "activity": act})
    rows.append({"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "partner": "b",
                 "throughput": 6.0, "partner_throughput": 12.0})
    return ThroughputTable.from_rows(rows)


def test_hand_computed_scenario_energy_and_jct():
    """One V100 and one T4; job 'a' needs 8 steps/s, only the V100 can do it."""
    v100, t4 = get_gpu_type("v100"), get_gpu_type("t4")
    res = simulate([J("x", "a", 1000.0, 5.0, 8.0)], [Gpu("v", "v100"), Gpu("t", "t4")], _table(),
                   GoghOptimizer())
    rec = res.jobs["x"]
    assert rec.gpu_type == "v100" and rec.placed_s == 5.0
    assert rec.finished_s == pytest.approx(105.0)  # 1000 steps at 10 steps/s
    busy = v100.idle_w + 0.5 * (v100.tdp_w - v100.idle_w)
    expected = (v100.idle_w + t4.idle_w) * 5.0 + (busy + t4.idle_w) * 100.0
    assert res.energy_j == pytest.approx(expected)
    s = res.summary()
    assert s["avg_jct_s"] == pytest.approx(100.0) and s["avg_queue_s"] == 0.0
    assert s["sla_attainment"] == 1.0 and s["jobs_completed"] == 1
    # Parking empty GPUs removes their idle draw.
    parked = simulate([J("x", "a", 1000.0, 5.0, 8.0)], [Gpu("v", "v100"), Gpu("t", "t4")], _table(),
                      GoghOptimizer(), config=SimConfig(park_idle=True))
    assert parked.energy_j == pytest.approx(busy * 100.0)


def test_partner_departure_speeds_survivor_back_up():
    """'a' and 'b' share the V100 (6 and 12 steps/s); when 'b' finishes, 'a' runs at 10."""
    jobs = [J("a1", "a", 600.0, 0.0, 5.0), J("b1", "b", 120.0, 0.0, 10.0)]
    res = simulate(jobs, [Gpu("v", "v100")], _table(), GoghOptimizer())
    assert res.jobs["b1"].finished_s == pytest.approx(10.0)  # 120 / 12
    # a did 60 steps while sharing, then 540 at 10 steps/s
    assert res.jobs["a1"].finished_s == pytest.approx(10.0 + 54.0)
    assert res.summary()["sla_attainment"] == 1.0


def _random_stream(n: int, seed: int) -> list[J]:
    import random

    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1 / 30.0)
        jt = rng.choice("ab")
        gang = 2 if rng.random() < 0.1 else 1
        best = _table().isolated(jt, "v100", gang)
        out.append(J(f"j{i}", jt, rng.uniform(200, 3000), t, rng.uniform(0.2, 0.9) * best, gang))
    return out


@pytest.mark.parametrize("policy", ["optimizer", *BASELINES])
def test_conservation_and_power_integral(policy):
    jobs = _random_stream(40, seed=3)
    gpus = [Gpu(f"v{i}", "v100") for i in range(3)] + [Gpu(f"t{i}", "t4") for i in range(3)]
    res = simulate(jobs, gpus, _table(), get_policy(policy))
    for j in jobs:  # every job completes, and did exactly its work
        rec = res.jobs[j.id]
        assert rec.finished_s is not None, j.id
        assert rec.steps_done == pytest.approx(j.total_steps, rel=1e-6)
        assert rec.finished_s >= rec.placed_s >= rec.arrival_s
    assert res.energy_j == pytest.approx(sum((b - a) * w for a, b, w in res.power_trace))
    assert all(b2 == pytest.approx(a2) for (_, b2, _), (a2, _, _) in zip(res.power_trace, res.power_trace[1:]))


def test_oracle_never_runs_below_requirement():
    jobs = _random_stream(60, seed=5)
    gpus = [Gpu(f"v{i}", "v100") for i in range(3)] + [Gpu(f"t{i}", "t4") for i in range(2)]
    res = simulate(jobs, gpus, _table(), GoghOptimizer())
    assert res.summary()["sla_attainment"] == pytest.approx(1.0)


def test_deterministic_for_a_seed_and_noise_changes_rates():
    jobs = _random_stream(30, seed=1)
    gpus = [Gpu("v0", "v100"), Gpu("t0", "t4"), Gpu("t1", "t4")]
    cfg = SimConfig(seed=2, noise=0.1)
    a = simulate(jobs, gpus, _table(), GoghOptimizer(), config=cfg).summary()
    b = simulate(jobs, gpus, _table(), GoghOptimizer(), config=cfg).summary()
    c = simulate(jobs, gpus, _table(), GoghOptimizer(), config=SimConfig(seed=3, noise=0.1)).summary()
    drop = ("decision_p50_ms", "decision_p99_ms")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert a["energy_kwh"] != c["energy_kwh"]


def test_unplaceable_job_is_reported_unfinished_not_lost():
    jobs = [J("ok", "a", 100.0, 0.0, 5.0), J("never", "a", 100.0, 0.0, 50.0)]
    res = simulate(jobs, [Gpu("v", "v100")], _table(), GoghOptimizer())
    assert res.unfinished == ["never"]
    assert res.summary()["jobs_completed"] == 1


def test_missing_requirement_is_a_clear_error():
    with pytest.raises(ValueError, match="assign_requirements"):
        simulate([J("x", "a", 10.0, 0.0, None)], [Gpu("v", "v100")], _table(), GoghOptimizer())


def test_occupancy_counts_busy_gpus_per_type():
    jobs = [J("a1", "a", 600.0, 0.0, 5.0), J("b1", "b", 120.0, 0.0, 10.0), J("g", "a", 100.0, 50.0, 2.0, 2)]
    gpus = [Gpu("v0", "v100"), Gpu("v1", "v100"), Gpu("v2", "v100"), Gpu("t0", "t4")]
    res = simulate(jobs, gpus, _table(), GoghOptimizer())
    assert res.fleet == {"v100": 3, "t4": 1}
    assert res.occupancy[0] == (0.0, {"v100": 0, "t4": 0})
    for _, counts in res.occupancy:
        assert 0 <= counts["v100"] <= 3 and 0 <= counts["t4"] <= 1
    assert res.occupancy[-1][1] == {"v100": 0, "t4": 0}  # everything finished
    assert max(c["v100"] for _, c in res.occupancy) >= 2  # the gang took two V100s


def _planning_and_truth():
    """Planning believes 'a' barely slows next to 'b'; in truth it drops to 3 steps/s."""
    base = [r for r in _table().frame.iter_rows(named=True) if r["partner"] is None]
    plan = ThroughputTable.from_rows(base + [{"job_type": "a", "gpu_type": "v100", "scale_factor": 1,
                                              "partner": "b", "throughput": 9.5, "partner_throughput": 19.0}])
    truth = ThroughputTable.from_rows(base + [{"job_type": "a", "gpu_type": "v100", "scale_factor": 1,
                                               "partner": "b", "throughput": 3.0, "partner_throughput": 19.0}])
    return plan, truth


def test_job_below_requirement_is_migrated_once_with_its_cost():
    from gogh_flows.placement import TableThroughputs

    plan, truth = _planning_and_truth()
    jobs = [J("b1", "b", 1e5, 0.0, 10.0), J("a1", "a", 5000.0, 10.0, 5.0)]
    gpus = [Gpu("v0", "v100"), Gpu("v1", "v100")]
    cfg = SimConfig(observe_after_s=100.0, migration_s=60.0)
    res = simulate(jobs, gpus, truth, GoghOptimizer(), planning=TableThroughputs(plan), config=cfg)
    assert res.migrations == 1
    rec = res.jobs["a1"]
    # 100 s shared at 3 steps/s, evicted at t=110, paused 60 s on the free V100, then 10 steps/s.
    assert rec.finished_s == pytest.approx(110.0 + 60.0 + (5000.0 - 300.0) / 10.0)
    assert rec.steps_done == pytest.approx(5000.0)
    # Running time below requirement: the 100 s shared and the 60 s restart.
    assert rec.run_s - rec.ok_s == pytest.approx(160.0)
    # Without re-placement the job would stay below its requirement until it finishes.
    stuck = simulate(jobs, gpus, truth, GoghOptimizer(), planning=TableThroughputs(plan),
                     config=SimConfig(replace_below_requirement=False))
    assert stuck.migrations == 0
    assert stuck.jobs["a1"].finished_s == pytest.approx(10.0 + 5000.0 / 3.0)
    assert res.summary()["sla_attainment"] > stuck.summary()["sla_attainment"]


@pytest.mark.parametrize("window", [1, 2, 64])
def test_decision_window_does_not_leave_free_gpus_idle(window):
    """Five jobs arrive at once; with any window, all five start at t=0 on five free GPUs."""
    jobs = [J(f"j{i}", "a", 100.0, 0.0, 8.0) for i in range(5)]
    gpus = [Gpu(f"v{i}", "v100", capacity=1) for i in range(5)] + [Gpu("t", "t4", capacity=1)]
    res = simulate(jobs, gpus, _table(), GoghOptimizer(), config=SimConfig(decision_window=window))
    assert all(res.jobs[j.id].placed_s == 0.0 for j in jobs)
    # The arrival event takes ceil(5 / window) chunks; no later event has anything queued.
    assert len(res.decision_ms) == -(-5 // window)


def test_decision_window_is_validated():
    with pytest.raises(ValueError, match="decision_window"):
        SimConfig(decision_window=0)

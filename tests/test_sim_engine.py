
import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.placement import BASELINES, GoghOptimizer, Gpu, get_policy
from gogh_flows.sim.engine import SimConfig, simulate
from gogh_flows.sim.traces import TraceJob
from gogh_flows.truth.table import ThroughputTable


def J(id: str, job_type: str, total_steps: float, arrival_s: float,  # noqa: N802 - reads like a record
      required_throughput: float | None, num_gpus: int = 1) -> TraceJob:
    return TraceJob(id, job_type, total_steps, num_gpus, arrival_s, required_throughput=required_throughput)


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
    drop = ("decision_p50_ms", "decision_p99_ms", "rebalance_p99_ms")
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
    # a1 and b1 share one V100 from t=0; the gang arrives at 50 and takes two more, for 100 steps
    # at 1.8 x 10 steps/s
    g = res.jobs["g"]
    assert (g.gpu_type, g.placed_s) == ("v100", 50.0) and g.finished_s == pytest.approx(50.0 + 100.0 / 18.0)
    at_50 = [c for t, c in res.occupancy if t == 50.0]
    assert at_50[-1] == {"v100": 3, "t4": 0}
    assert max(c["v100"] for _, c in res.occupancy) == 3


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
    # Running time below requirement: the 100 s shared; the 60 s restart is reported apart.
    assert rec.run_s - rec.ok_s == pytest.approx(100.0)
    assert rec.restart_s == pytest.approx(60.0) and res.summary()["restart_h"] == pytest.approx(60 / 3600)
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


@pytest.mark.parametrize("field, value", [("rebalance_gain", 1.0), ("rebalance_gain", -0.1),
                                          ("rebalance_candidates", 0)])
def test_rebalance_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})


# "Clearly better slot": one V100 and one T4, one job each; the V100 frees at t=100.
_FREED = [J("b1", "b", 2000.0, 0.0, 10.0), J("a1", "a", 4000.0, 10.0, 2.0)]
_FLEET = [Gpu("v", "v100", capacity=1), Gpu("t", "t4", capacity=1)]


def test_job_moves_to_a_freed_faster_gpu_with_its_migration_cost():
    """greedy-fastest: b1 runs on the V100 (20 steps/s) until t=100, a1 on the T4 (4 steps/s)."""
    res = simulate(_FREED, _FLEET, _table(), get_policy("greedy-fastest"),
                   config=SimConfig(migration_s=60.0))
    assert res.migrations == 1 and res.rebalances == 1
    rec = res.jobs["a1"]
    # 90 s at 4 steps/s on the T4 (360 steps); staying would take 3640/4 = 910 s more, moving
    # 60 + 3640/10 = 424 s: better by far more than 20%.
    assert rec.gpu_type == "v100"
    assert rec.finished_s == pytest.approx(100.0 + 60.0 + 3640.0 / 10.0)
    assert res.summary()["avg_jct_s"] == pytest.approx((100.0 + (524.0 - 10.0)) / 2)
    assert rec.steps_done == pytest.approx(4000.0) and rec.restart_s == pytest.approx(60.0)
    assert res.summary()["sla_attainment"] == 1.0  # the restart is not running time
    assert res.energy_j == pytest.approx(sum((b - a) * w for a, b, w in res.power_trace))
    assert len(res.rebalance_ms) >= 1
    # Switched off, a1 stays on the T4: 4000 steps at 4 steps/s from t=10.
    off = simulate(_FREED, _FLEET, _table(), get_policy("greedy-fastest"),
                   config=SimConfig(migration_s=60.0, rebalance=False))
    assert off.migrations == 0 and off.jobs["a1"].finished_s == pytest.approx(1010.0)
    assert off.jobs["a1"].gpu_type == "t4"


def test_move_must_beat_the_threshold_including_the_migration():
    """A 700 s restart makes the move 1064 s against 910 s staying: no move."""
    res = simulate(_FREED, _FLEET, _table(), get_policy("greedy-fastest"),
                   config=SimConfig(migration_s=700.0))
    assert res.migrations == 0 and res.jobs["a1"].finished_s == pytest.approx(1010.0)
    # 60 s restart but a 60% threshold: 424 s is not <= 0.4 * 910 s.
    res = simulate(_FREED, _FLEET, _table(), get_policy("greedy-fastest"),
                   config=SimConfig(rebalance_gain=0.6))
    assert res.migrations == 0


@pytest.mark.parametrize("name", ["first-fit", "first-fit-interleaved", "random"])
def test_heterogeneity_unaware_policies_never_rebalance(name):
    res = simulate(_FREED, _FLEET, _table(), get_policy(name))
    assert res.migrations == 0 and res.rebalances == 0
    jobs = _random_stream(40, seed=3)
    gpus = [Gpu(f"v{i}", "v100") for i in range(2)] + [Gpu(f"t{i}", "t4") for i in range(3)]
    assert simulate(jobs, gpus, _table(), get_policy(name)).rebalances == 0


def test_oracle_moves_for_energy_even_to_a_slower_gpu():
    """The T4 uses less energy per step than the V100 for both job types (_table, catalog power).

    b1 takes the T4 (5 steps/s) until t=100; a1 arrives at t=10 and gets the V100 (10 steps/s).
    At t=100 a1 has 3100 steps left. GPUs always on, only dynamic power differs: 310 s x 130 W
    = 40.3 kJ staying against (60 + 775) s x 30 W = 25.1 kJ on the T4. Parked: 310 s x 170 W
    = 52.7 kJ against 835 s x 40 W = 33.4 kJ. The oracle moves it.
    """
    jobs = [J("b1", "b", 500.0, 0.0, 3.0), J("a1", "a", 4000.0, 10.0, 2.0)]
    for park in (False, True):
        res = simulate(jobs, _FLEET, _table(), GoghOptimizer(), config=SimConfig(park_idle=park))
        assert res.rebalances == 1 and res.jobs["a1"].gpu_type == "t4"
        assert res.jobs["a1"].finished_s == pytest.approx(100.0 + 60.0 + 3100.0 / 4.0)
    stay = simulate(jobs, _FLEET, _table(), GoghOptimizer(),
                    config=SimConfig(rebalance=False, park_idle=True))
    assert stay.jobs["a1"].finished_s == pytest.approx(410.0)
    assert res.energy_j == pytest.approx(stay.energy_j - 52_700.0 + 33_400.0)
    # greedy-fastest put b1 on the V100 and a1 on the T4, and moves a1 the other way.
    fastest = simulate(jobs, _FLEET, _table(), get_policy("greedy-fastest"))
    assert fastest.rebalances == 1 and fastest.jobs["a1"].gpu_type == "v100"
    # Forced to the time objective, the oracle keeps a1 on the faster V100.
    timed = simulate(jobs, _FLEET, _table(), GoghOptimizer(), rebalance_by="time")
    assert timed.rebalances == 0


def test_waiting_jobs_get_freed_gpus_before_running_jobs_move():
    """a2 waits from t=50; when the V100 frees at t=100 it goes to a2, not to a1 on the T4.

    a1 moves only when a2 leaves the V100 at t=200: 760 steps done on the T4, then a 60 s
    restart and 3240 steps at 10 steps/s.
    """
    jobs = [*_FREED, J("a2", "a", 1000.0, 50.0, 2.0)]
    res = simulate(jobs, _FLEET, _table(), get_policy("greedy-fastest"))
    assert res.jobs["a2"].placed_s == pytest.approx(100.0) and res.jobs["a2"].gpu_type == "v100"
    assert res.jobs["a2"].finished_s == pytest.approx(200.0)
    assert res.rebalances == 1 and res.jobs["a1"].finished_s == pytest.approx(200.0 + 60.0 + 324.0)


def test_rebalancing_is_deterministic_and_conserves_work():
    jobs = _random_stream(40, seed=2)
    gpus = [Gpu("v0", "v100"), Gpu("v1", "v100")] + [Gpu(f"t{i}", "t4") for i in range(3)]
    drop = ("decision_p50_ms", "decision_p99_ms", "rebalance_p99_ms")
    for name in ("greedy-fastest", "optimizer", "greedy-efficiency"):
        cfg = SimConfig(seed=4, noise=0.1, migration_s=30.0)
        a = simulate(jobs, gpus, _table(), get_policy(name), config=cfg)
        b = simulate(jobs, gpus, _table(), get_policy(name), config=cfg)
        sa, sb = a.summary(), b.summary()
        assert {k: v for k, v in sa.items() if k not in drop} == {k: v for k, v in sb.items() if k not in drop}
        assert {j: (r.finished_s, r.gpu_type) for j, r in a.jobs.items()} == \
            {j: (r.finished_s, r.gpu_type) for j, r in b.jobs.items()}
        for j in jobs:
            assert a.jobs[j.id].steps_done == pytest.approx(j.total_steps, rel=1e-6)
        assert a.energy_j == pytest.approx(sum((t1 - t0) * w for t0, t1, w in a.power_trace))
        assert a.rebalances >= 1, name  # the scenario does exercise moves


def test_observations_reach_a_learning_base():
    from gogh_flows.placement import TableThroughputs
    from gogh_flows.placement.problem import Job
    from gogh_flows.sim.engine import ObservedThroughputs

    class Learner(TableThroughputs):
        def __init__(self, table):
            super().__init__(table)
            object.__setattr__(self, "heard", [])

        def observe(self, job, gpu_type, partner, rate):
            self.heard.append((job.id, gpu_type, partner.id if partner else None, rate))

    base = Learner(_table())
    view = ObservedThroughputs(base)
    job, partner = Job("x", "a", 1.0, 10.0), Job("y", "b", 1.0, 10.0)
    view.observe(job, "v100", partner, 5.5)
    view.observe(job, "t4", None, 3.0)
    assert base.heard == [("x", "v100", "y", 5.5), ("x", "t4", None, 3.0)]
    assert view.isolated(job, "t4") == 3.0
    ObservedThroughputs(TableThroughputs(_table())).observe(job, "t4", None, 3.0)  # no observe(): fine

"""Power limits in the simulator: the optimiser chooses them, the engine enacts them."""

from __future__ import annotations

import pytest

from gogh_flows.energy import EnergyModel
from gogh_flows.sim.engine import ObservedThroughputs, SimConfig, simulate
from gogh_flows.sim.run import LIMIT_POLICIES, make_policy, parse_cluster, run_policies
from test_sim_engine import _random_stream, _table


def test_limits_save_energy_at_full_sla_on_the_same_stream():
    jobs = _random_stream(30, seed=4)
    gpus = parse_cluster("v100=3,t4=3")
    res = run_policies(jobs, gpus, _table(), ["oracle", "oracle+limits"], config=SimConfig(park_idle=True))
    with_limits, without = res["oracle+limits"].summary(), res["oracle"].summary()
    assert with_limits["jobs_completed"] == 30
    # the truth is the model the oracle plans with: every job keeps its requirement at its limit
    assert with_limits["sla_attainment"] == pytest.approx(1.0)
    assert res["oracle+limits"].energy_j < res["oracle"].energy_j
    assert without["sla_attainment"] == pytest.approx(1.0)


def test_the_engine_slows_a_limited_board_and_observes_its_full_power_rate():
    jobs = _random_stream(6, seed=1)
    gpus = parse_cluster("v100=2")
    policy = make_policy("oracle+limits", _table())
    seen = []

    class Spy(ObservedThroughputs):
        def observe(self, job, gpu_type, partner, rate):
            seen.append((job, gpu_type, partner, rate))
            super().observe(job, gpu_type, partner, rate)

    truth = _table()
    from gogh_flows.placement.problem import TableThroughputs

    base = TableThroughputs(truth)
    chosen = []

    class Recording:
        name = "recording"

        def place(self, problem):
            placement = policy.policy.place(problem)
            chosen.extend(placement.assignments)
            return placement

    res = simulate(jobs, gpus, truth, Recording(), planning=Spy(base), config=SimConfig(observe_after_s=1.0))
    assert res.summary()["jobs_completed"] == 6
    # what the monitor reports is the rate at the maximum limit, the table's own figures
    assert seen
    for job, gpu_type, partner, rate in seen:
        expect = base.isolated(job, gpu_type) if partner is None else base.pair(job, partner, gpu_type)[0]
        assert rate == pytest.approx(expect, rel=1e-9)
    assert any(a.power_limit_w is not None for a in chosen)  # and limits were set in this run


def test_limit_policies_are_the_optimisers_only():
    assert set(LIMIT_POLICIES) == {"oracle+limits", "gogh+limits", "gogh-p1+limits"}
    with pytest.raises(ValueError, match="unknown simulation policy 'greedy-fastest\\+limits'"):
        make_policy("greedy-fastest+limits", _table())
    p = make_policy("oracle+limits", _table())
    assert p.policy.power_limit_levels and p.policy.name == "oracle+limits"


def test_energy_model_limits_are_relative_to_the_maximum_for_a_board_at_tdp():
    energy = EnergyModel()
    top = energy.max_limit("v100")
    tdp = energy.gpu("v100").tdp_w
    assert energy.at_limit("v100", tdp, top) == (1.0, tdp)
    slow, watts = energy.at_limit("v100", tdp, 0.6 * top)
    assert slow > 1 and watts < tdp


def test_fleet_reoptimisation_runs_in_the_simulator_and_keeps_every_requirement():
    jobs = _random_stream(30, seed=4)
    gpus = parse_cluster("v100=3,t4=3")
    res = run_policies(jobs, gpus, _table(), ["oracle+fleet", "oracle+limits+fleet"])
    for name, r in res.items():
        s = r.summary()
        assert s["jobs_completed"] == 30, name
        assert s["sla_attainment"] == pytest.approx(1.0), name
    with pytest.raises(ValueError, match="reoptimize_s"):
        simulate(jobs, gpus, _table(), make_policy("oracle", _table()).policy, reoptimize_s=-1.0)


def test_a_job_short_only_because_of_its_limit_gets_the_limit_raised_not_the_same_plan_again():
    """The planner predicts a limit's slowdown from the power a job draws, here assumed far lower
    than it is (activity 0.3 against 1.0): it picks a limit that is too low. Re-placing the job
    on its measurement repeated the same plan for ever (attainment 0); raising the board's limit
    to the level its observed slowdown says suffices brings it to its requirement after one
    observation (a level at a time took one observation per level)."""
    from gogh_flows.placement import GoghOptimizer, Gpu
    from gogh_flows.placement.problem import TableThroughputs
    from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS
    from gogh_flows.sim.traces import TraceJob
    from gogh_flows.truth.table import ThroughputTable

    def table(activity: float) -> ThroughputTable:
        return ThroughputTable.from_rows([{"job_type": "hot", "gpu_type": "h100", "scale_factor": 1,
                                           "throughput": 100.0, "activity": activity}])

    jobs = [TraceJob("a", "hot", 100.0 * 36000, 1, 0.0, required_throughput=70.0)]
    policy = GoghOptimizer(name="oracle", power_limit_levels=DEFAULT_LIMIT_LEVELS)
    run = simulate(jobs, [Gpu("h", "h100", 1)], table(1.0), policy, planning=TableThroughputs(table(0.3)))
    s = run.summary()
    assert s["sla_attainment"] > 0.95 and s["jobs_completed"] == 1
    assert s["avg_jct_s"] < 36000 / 0.7 * 1.05  # at about its requirement's pace, not the lowest limit's
    rec = run.jobs["a"]
    assert rec.run_s - rec.ok_s == pytest.approx(SimConfig().observe_after_s)  # short until its first observation only

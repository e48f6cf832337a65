"""The energy floor: hand-computed on one job, binding when a scarce GPU is contended, and never
above what a simulated policy that met every requirement actually spent."""

from __future__ import annotations

from collections import Counter

import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.energy import J_PER_KWH
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.bound import INFEASIBLE, energy_floor, job_configurations
from gogh_flows.sim.engine import SimConfig, TrueRates
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS, parse_cluster, run_policies
from test_sim_engine import J, _random_stream, _table


def test_one_job_alone_by_hand():
    v100 = get_gpu_type("v100")
    job = J("x", "a", 1000.0, 0.0, 8.0)  # only the V100 (10 steps/s) meets 8 steps/s; activity 0.5
    floor = energy_floor([job], {"v100": 1, "t4": 1}, TrueRates(_table(), 0.0, 0), levels=(), window_s=500.0)
    above = 0.5 * (v100.tdp_w - v100.idle_w) * 1000.0 / 10.0 / J_PER_KWH
    assert floor.per_job_above_kwh == pytest.approx(above)
    assert floor.per_job_total_kwh == pytest.approx((v100.idle_w + 0.5 * (v100.tdp_w - v100.idle_w)) * 100.0 / J_PER_KWH)
    # one job, room to spare: the capacity relaxation adds nothing
    assert floor.fleet_above_kwh == pytest.approx(above, rel=1e-6)
    assert floor.infeasible == ()


def test_a_job_no_type_can_serve_is_reported_not_counted():
    floor = energy_floor([J("x", "a", 100.0, 0.0, 50.0)], {"v100": 1}, TrueRates(_table(), 0.0, 0), levels=())
    assert floor.infeasible == ("x",) and floor.per_job_above_kwh == 0.0


def test_a_gang_needs_as_many_gpus_of_its_type_in_the_fleet():
    gang = J("g", "a", 1000.0, 0.0, 12.0, num_gpus=2)  # only two V100s together (18 steps/s) serve it
    rates = TrueRates(_table(), 0.0, 0)
    assert energy_floor([gang], {"v100": 1, "t4": 4}, rates, levels=()).infeasible == ("g",)
    v100 = get_gpu_type("v100")
    floor = energy_floor([gang], {"v100": 2}, rates, levels=())
    assert floor.per_job_above_kwh == pytest.approx(2 * 0.5 * (v100.tdp_w - v100.idle_w) * 1000.0 / 18.0 / J_PER_KWH)


def test_sharing_and_limits_are_configurations_that_meet_both_requirements():
    jobs = [J("x", "a", 100.0, 0.0, 5.0), J("y", "b", 100.0, 0.0, 11.0)]
    configs = job_configurations(jobs, {"t4": 1, "v100": 1}, TrueRates(_table(), 0.0, 0), levels=DEFAULT_LIMIT_LEVELS)
    # every configuration meets the job's own requirement
    for job in jobs:
        assert (configs[job.id].rate >= job.required_throughput * (1 - 1e-9)).all()
    # 'a' shares a V100 with 'b' at 6 steps/s (>= 5) while 'b' gets 12 (>= 11): both kept
    v100 = 1
    assert ((configs["x"].gpu_type == v100) & (configs["x"].rate <= 6.0 + 1e-9)).any()
    # a tighter partner requirement rules the pair out: 'b' needing 13 cannot share
    strict = [J("x", "a", 100.0, 0.0, 5.0), J("y", "b", 100.0, 0.0, 13.0)]
    cfg = job_configurations(strict, {"v100": 1}, TrueRates(_table(), 0.0, 0), levels=())
    assert (cfg["x"].rate > 6.0).all()  # only alone (10 steps/s) is left for 'x'


def test_capacity_binds_when_jobs_contend_for_the_efficient_gpu():
    # four 'b' jobs at once, each needing 4.5 steps/s: the one T4 (5 steps/s, 70 W board) is far
    # cheaper per step than a V100 (20 steps/s, 300 W); by a 450 s deadline it can do 2,250 of
    # their 8,000 steps, so the rest must go to V100s
    t4, v100 = get_gpu_type("t4"), get_gpu_type("v100")
    assert 0.8 * (t4.tdp_w - t4.idle_w) / 5.0 < 0.8 * (v100.tdp_w - v100.idle_w) / 20.0
    jobs = [J(f"j{i}", "b", 2000.0, 0.0, 4.5) for i in range(4)]
    rates = TrueRates(_table(), 0.0, 0)
    fleet = {"v100": 4, "t4": 1}
    loose = energy_floor(jobs, fleet, rates, levels=(), window_s=10_000.0)
    # buckets end at the deadline, so the relaxation is exact here (a coarser cut is looser, still valid)
    tight = energy_floor(jobs, fleet, rates, levels=(), window_s=900.0, buckets=2,
                         deadlines={j.id: 450.0 for j in jobs})
    assert loose.fleet_above_kwh == pytest.approx(loose.per_job_above_kwh, rel=1e-6)  # all on the T4, in turn
    per_step = {t.name: 0.8 * (t.tdp_w - t.idle_w) / rate for t, rate in ((t4, 5.0), (v100, 20.0))}
    expect = (2250.0 * per_step["t4"] + 5750.0 * per_step["v100"]) / J_PER_KWH
    assert tight.fleet_above_kwh == pytest.approx(expect, rel=1e-6)
    # impossible deadlines: no schedule meets them, so there is no floor to report
    none = energy_floor(jobs, fleet, rates, levels=(), window_s=10_000.0, deadlines={j.id: 50.0 for j in jobs})
    assert none.fleet_above_kwh is None and none.notes == (INFEASIBLE,)


@pytest.mark.parametrize("seed", [1, 4, 9])
def test_no_policy_that_met_every_requirement_spent_less_than_the_floor(seed):
    jobs = _random_stream(40, seed=seed)
    cluster = "v100=2,t4=3"
    gpus = parse_cluster(cluster)
    fleet = Counter(g.gpu_type for g in gpus)
    names = ["greedy-fastest", "first-fit", "oracle", "oracle+limits", "oracle+limits+fleet"]
    on = run_policies(jobs, gpus, _table(), names, config=SimConfig(seed=seed))
    parked = run_policies(jobs, gpus, _table(), names, config=SimConfig(seed=seed, park_idle=True))
    acc_on, acc_p = energy_accounts(on), energy_accounts(parked, parked_run=True)
    window = max(acc_on["greedy-fastest"].window_s, acc_p["greedy-fastest"].window_s)
    rates = TrueRates(_table(), 0.0, seed)
    floor = energy_floor(jobs, fleet, rates, levels=DEFAULT_LIMIT_LEVELS, window_s=window)
    assert floor.fleet_above_kwh is not None and floor.fleet_total_kwh is not None
    assert floor.per_job_above_kwh <= floor.fleet_above_kwh * (1 + 1e-9)
    checked = 0
    for name in names:
        if on[name].summary()["sla_attainment"] < 1 - 1e-9 or parked[name].summary()["sla_attainment"] < 1 - 1e-9:
            continue
        checked += 1
        a = acc_on[name]
        assert a.always_on_kwh - a.idle_floor_kwh >= floor.fleet_above_kwh * (1 - 1e-6), name
        assert acc_p[name].parked_kwh >= floor.fleet_total_kwh * (1 - 1e-6), name
    assert checked >= 3
    # a policy finished every job by its own finish times: its energy is above that floor too
    gf = on["greedy-fastest"]
    due = energy_floor(jobs, fleet, rates, levels=DEFAULT_LIMIT_LEVELS, window_s=window,
                       deadlines={j: r.finished_s for j, r in gf.jobs.items()})
    assert due.fleet_above_kwh >= floor.fleet_above_kwh * (1 - 1e-9)
    g = acc_on["greedy-fastest"]
    assert g.always_on_kwh - g.idle_floor_kwh >= due.fleet_above_kwh * (1 - 1e-6)


def test_when_glop_gives_up_highs_solves_the_same_program(monkeypatch):
    """GLOP answered ABNORMAL on a badly conditioned program (the MSR trace with noise and
    deadlines); the floor then asks HiGHS, which must give the same optimum as GLOP does."""
    from ortools.linear_solver.python import model_builder as mb

    jobs = _random_stream(12, seed=3)
    fleet = {"v100": 1, "t4": 2}
    rates = TrueRates(_table(), 0.0, 3)
    glop = energy_floor(jobs, fleet, rates, levels=DEFAULT_LIMIT_LEVELS, window_s=40_000.0, buckets=12)
    monkeypatch.setattr(mb.Solver, "solve", lambda self, model: mb.SolveStatus.ABNORMAL)
    highs = energy_floor(jobs, fleet, rates, levels=DEFAULT_LIMIT_LEVELS, window_s=40_000.0, buckets=12)
    assert glop.fleet_above_kwh is not None and highs.notes == ()
    assert highs.fleet_above_kwh == pytest.approx(glop.fleet_above_kwh, rel=1e-6)
    assert highs.fleet_total_kwh == pytest.approx(glop.fleet_total_kwh, rel=1e-6)


def test_a_pair_that_runs_a_job_faster_than_alone_does_not_lift_the_floor_above_the_run():
    """Measured tables have pairs where a job runs faster shared than alone (two in Gavel's
    physical file, more under noise). The engine caps its load share at its isolated rate, so
    the floor must too: it once charged such a job shared/iso times its share, 0.7% above what
    `oracle` spent on the two jobs here."""
    from gogh_flows.truth.table import ThroughputTable

    rows = [{"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "throughput": 10.0, "activity": 0.6},
            {"job_type": "b", "gpu_type": "v100", "scale_factor": 1, "throughput": 20.0, "activity": 0.9},
            {"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "partner": "b",
             "throughput": 12.0, "partner_throughput": 15.0}]
    table = ThroughputTable.from_rows(rows)
    jobs = [J("x", "a", 3000.0, 0.0, 5.0), J("y", "b", 3000.0, 0.0, 10.0)]
    gpus = parse_cluster("v100=1")
    names = ["oracle", "greedy-fastest", "first-fit"]
    on = run_policies(jobs, gpus, table, names, config=SimConfig())
    parked = run_policies(jobs, gpus, table, names, config=SimConfig(park_idle=True))
    acc_on, acc_p = energy_accounts(on), energy_accounts(parked, parked_run=True)
    window = max(acc_on["oracle"].window_s, acc_p["oracle"].window_s)
    floor = energy_floor(jobs, {"v100": 1}, TrueRates(table, 0.0, 0), levels=(), window_s=window)
    shared = 0
    for name in names:
        assert on[name].summary()["sla_attainment"] == pytest.approx(1.0)
        a = acc_on[name]
        assert a.always_on_kwh - a.idle_floor_kwh >= floor.fleet_above_kwh * (1 - 1e-9), name
        assert acc_p[name].parked_kwh >= floor.fleet_total_kwh * (1 - 1e-9), name
        shared += on[name].jobs["x"].placed_s == on[name].jobs["y"].placed_s == 0.0
    assert shared  # some policy ran them together, the case the floor must not overcharge

"""Fleet-level re-optimisation (placement.reoptimize)."""

from __future__ import annotations

import pytest

from gogh_flows.placement import Gpu, Job, PlacementProblem
from gogh_flows.placement.reoptimize import reoptimize
from gogh_flows.truth.table import ThroughputTable


def _table() -> ThroughputTable:
    """'gain' uses far less energy per step on the H100 (20x faster); 'flat' far less on the T4."""
    rows = []
    for jt, h100, t4, act in (("gain", 200.0, 10.0, 0.9), ("flat", 12.0, 10.0, 0.5)):
        rows.append({"job_type": jt, "gpu_type": "h100", "scale_factor": 1, "throughput": h100, "activity": act})
        rows.append({"job_type": jt, "gpu_type": "t4", "scale_factor": 1, "throughput": t4, "activity": act})
        rows.append({"job_type": jt, "gpu_type": "h100", "scale_factor": 2, "throughput": 1.9 * h100, "activity": act})
        rows.append({"job_type": jt, "gpu_type": "t4", "scale_factor": 2, "throughput": 1.9 * t4, "activity": act})
    rows.append({"job_type": "gain", "gpu_type": "t4", "scale_factor": 1, "partner": "flat",
                 "throughput": 8.0, "partner_throughput": 8.0})
    return ThroughputTable.from_rows(rows)


def test_a_swap_gives_the_fast_gpu_to_the_job_that_gains_most():
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    jobs = [Job("f", "flat", 1.0, 1e6, gpus=("h",)), Job("g", "gain", 1.0, 1e6, gpus=("t",))]
    plan = reoptimize(PlacementProblem.build(gpus, jobs, _table()), migration_s=60.0, budget=2)
    moved = {m.job_id: (m.from_gpus, m.to_gpus) for m in plan.moves}
    assert moved == {"g": (("t",), ("h",)), "f": (("h",), ("t",))}
    assert plan.status == "optimal" and plan.saving_j > 0 and plan.gap == 0.0


def test_the_budget_bounds_moves_and_a_small_gain_moves_nothing():
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    jobs = [Job("f", "flat", 1.0, 1e6, gpus=("h",)), Job("g", "gain", 1.0, 1e6, gpus=("t",))]
    problem = PlacementProblem.build(gpus, jobs, _table())
    assert reoptimize(problem, budget=1).moves == ()  # the swap needs two moves
    assert reoptimize(problem, budget=0).moves == ()
    # a job on a T4 that an idle H100 would run for about 4% less energy (40 W x 1e5 s on the T4;
    # 'flat' of _table gains nothing at any bar, so it could not show the bar at work)
    near = ThroughputTable.from_rows([{"job_type": "near", "gpu_type": t, "scale_factor": 1, "throughput": rate,
                                       "activity": 0.5} for t, rate in (("h100", 100.0), ("t4", 10.0))])
    lone = PlacementProblem.build([Gpu("h", "h100"), Gpu("t", "t4")], [Job("n", "near", 1.0, 1e6, gpus=("t",))],
                                  near)
    free = reoptimize(lone, min_gain=0.0, migration_s=0.0)
    assert [(m.job_id, m.to_type) for m in free.moves] == [("n", "h100")]
    assert 0.03 < free.saving_j / 4e6 < 0.05
    assert reoptimize(lone, min_gain=0.05, migration_s=0.0).moves == ()  # below the bar: it stays
    assert reoptimize(lone, migration_s=0.0).moves == ()  # the default bar, 10%


def test_pinned_jobs_and_a_pair_member_leaving_its_board():
    gpus = [Gpu("h", "h100"), Gpu("t", "t4")]
    jobs = [Job("g", "gain", 1.0, 1e6, gpus=("t",)), Job("f", "flat", 1.0, 1e6, gpus=("t",))]
    problem = PlacementProblem.build(gpus, jobs, _table())
    plan = reoptimize(problem)
    assert [(m.job_id, m.to_gpus) for m in plan.moves] == [("g", ("h",))]  # the one that gains leaves
    assert reoptimize(problem, pinned=frozenset({"g"})).moves == ()  # 'flat' gains nothing by moving


def test_a_gang_moves_as_a_whole():
    gpus = [Gpu("h0", "h100"), Gpu("h1", "h100"), Gpu("t0", "t4"), Gpu("t1", "t4")]
    jobs = [Job("gang", "gain", 1.0, 1e6, num_gpus=2, gpus=("t0", "t1"))]
    plan = reoptimize(PlacementProblem.build(gpus, jobs, _table()))
    assert [(m.job_id, m.from_gpus, set(m.to_gpus), m.to_type) for m in plan.moves] == [
        ("gang", ("t0", "t1"), {"h0", "h1"}, "h100")]


def test_limits_are_rechosen_for_boards_that_stay():
    gpus = [Gpu("h", "h100")]
    running = Job("g", "gain", 10.0, 1e6, gpus=("h",))  # 200 steps/s, needs 10: lots of slack
    plan = reoptimize(PlacementProblem.build(gpus, [running], _table(), power_limit_levels=(0.0, 0.25, 0.5, 0.75)))
    assert plan.moves == () and plan.limits.get("h") is not None and plan.saving_j > 0
    # and a board already at that limit is left alone
    again = Job("g", "gain", 10.0, 1e6, gpus=("h",), power_limit_w=plan.limits["h"])
    assert reoptimize(PlacementProblem.build(gpus, [again], _table(), power_limit_levels=(0.0, 0.25, 0.5, 0.75))).limits == {}


@pytest.mark.parametrize(("kwargs", "match"), [({"budget": -1}, "budget"), ({"min_gain": 1.0}, "min_gain"),
                                                ({"migration_s": -1.0}, "migration_s")])
def test_bad_settings_are_refused(kwargs, match):
    problem = PlacementProblem.build([Gpu("h", "h100")], [], _table())
    with pytest.raises(ValueError, match=match):
        reoptimize(problem, **kwargs)

"""Power limits as a placement decision (docs/optimizer.md, "Power limits")."""

from __future__ import annotations

import pytest

from gogh_flows.energy import EnergyModel, Occupant
from gogh_flows.placement import BASELINES, GoghOptimizer, Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.verify import placement_energy, violations
from gogh_flows.power_limits import default_limit_model
from gogh_flows.truth.table import ThroughputTable

LEVELS = (0.0, 0.25, 0.5, 0.75)


def _table() -> ThroughputTable:
    """One compute-heavy job type (activity 0.95) and one light one, on an H100."""
    rows = [
        {"job_type": "heavy", "gpu_type": "h100", "scale_factor": 1, "throughput": 10.0, "activity": 0.95},
        {"job_type": "light", "gpu_type": "h100", "scale_factor": 1, "throughput": 20.0, "activity": 0.3},
        {"job_type": "heavy", "gpu_type": "h100", "scale_factor": 1, "partner": "light",
         "throughput": 8.0, "partner_throughput": 16.0},
        {"job_type": "heavy", "gpu_type": "h100", "scale_factor": 1, "partner": "heavy",
         "throughput": 6.0, "partner_throughput": 6.0},
    ]
    return ThroughputTable.from_rows(rows)


def test_energy_model_at_limit_slows_and_caps_and_is_neutral_at_the_maximum():
    energy = EnergyModel()
    top = energy.max_limit("h100")
    p0 = energy.power_alone("h100", 0.95)
    assert energy.at_limit("h100", p0, None) == (1.0, p0)
    assert energy.at_limit("h100", p0, top) == (1.0, p0)
    slow, board = energy.at_limit("h100", p0, 350.0)
    assert slow > 1.0 and board < p0
    occ = Occupant(work=1000.0, isolated=10.0, activity=0.95)
    assert energy.energy_alone("h100", occ, limit_w=top) == pytest.approx(energy.energy_alone("h100", occ))
    # the shipped model predicts a saving for a job drawing near TDP at a moderate limit
    assert energy.energy_alone("h100", occ, limit_w=450.0) < energy.energy_alone("h100", occ)


def test_slack_buys_a_lower_limit_and_the_explanation_says_what_it_saved():
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [Job("j", "heavy", 5.0, 1e5)], _table(),
                                     power_limit_levels=LEVELS)
    p = GoghOptimizer().place(problem)
    a = p.assignment("j")
    lo, hi = EnergyModel().gpu("h100").power_limit_range_w
    assert a.power_limit_w is not None and lo <= a.power_limit_w < hi
    assert a.throughput >= 5.0
    chosen = p.explanations["j"].chosen
    assert chosen is not None and chosen.limit_saving_j > 0
    assert f"at {a.power_limit_w:g} W" in chosen.where
    assert p.to_frame()["power_limit_w"][0] == a.power_limit_w
    assert violations(problem, p) == []
    assert placement_energy(problem, p) == pytest.approx(p.energy_j, rel=1e-9)
    # the same job at full power costs exactly what the explanation says was saved
    full = GoghOptimizer().place(PlacementProblem.build([Gpu("h-0", "h100")], [Job("j", "heavy", 5.0, 1e5)], _table()))
    assert full.assignment("j").power_limit_w is None
    assert full.energy_j - p.energy_j == pytest.approx(chosen.limit_saving_j, rel=1e-9)


def test_a_tight_requirement_keeps_the_maximum():
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [Job("j", "heavy", 9.99, 1e5)], _table(),
                                     power_limit_levels=LEVELS)
    for name in ("optimizer", *BASELINES):
        a = get_policy(name).place(problem).assignment("j")
        assert a.power_limit_w is None and a.throughput == 10.0, name


def test_a_join_never_lowers_the_limit_below_what_the_running_partner_needs():
    table = _table()
    running = Job("r", "heavy", required_throughput=7.9, work=1e5, gpus=("h-0",))
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [running, Job("n", "light", 1.0, 1e4)], table,
                                     power_limit_levels=LEVELS)
    energy = problem.energy
    for name in ("optimizer", *BASELINES):
        p = get_policy(name).place(problem)
        assert violations(problem, p) == [], name
        if name == "greedy-efficiency":  # takes a GPU of its own only: none is free
            assert "n" not in p.placed_ids
            continue
        a = p.assignment("n")
        # the running job gets 8 steps/s shared at full power; any binding limit drops it below 7.9
        if a.power_limit_w is not None:
            p0 = energy.power_shared("h100", ((0.95, 0.8), (0.3, 0.8)))
            assert 8.0 / energy.at_limit("h100", p0, a.power_limit_w)[0] >= 7.9, name


def test_a_running_limit_is_kept_when_limits_are_not_chosen():
    table = _table()
    running = Job("r", "heavy", 1.0, 1e5, gpus=("h-0",), power_limit_w=400.0)
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [running, Job("n", "light", 1.0, 1e4)], table)
    p = GoghOptimizer().place(problem)
    assert p.assignment("n").power_limit_w == 400.0
    assert violations(problem, p) == []
    assert placement_energy(problem, p) == pytest.approx(p.energy_j, rel=1e-9)


def test_two_arrivals_sharing_a_free_gpu_get_one_limit():
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [Job("a", "heavy", 2.0, 1e4), Job("b", "heavy", 2.0, 1e4)],
                                     _table(), power_limit_levels=LEVELS)
    p = GoghOptimizer().place(problem)
    assert len(p.assignments) == 2
    assert len({a.power_limit_w for a in p.assignments}) == 1
    assert violations(problem, p) == []


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"power_limit_levels": (1.5,)}, "fractions of each GPU type's limit range"),
    ({"power_limit_levels": (-0.1,)}, "fractions of each GPU type's limit range"),
])
def test_bad_levels_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlacementProblem.build([Gpu("h-0", "h100")], [Job("j", "heavy", 1.0, 1.0)], _table(), **kwargs)


def test_limits_on_jobs_are_checked():
    with pytest.raises(ValueError, match="only a running job carries"):
        Job("j", "heavy", 1.0, 1.0, power_limit_w=300.0)
    with pytest.raises(ValueError, match="watts > 0"):
        Job("j", "heavy", 1.0, 1.0, gpus=("h-0",), power_limit_w=-5)
    jobs = [Job("a", "heavy", 1.0, 1.0, gpus=("h-0",), power_limit_w=300.0),
            Job("b", "light", 1.0, 1.0, gpus=("h-0",), power_limit_w=400.0)]
    with pytest.raises(ValueError, match="a board has one limit"):
        PlacementProblem.build([Gpu("h-0", "h100")], jobs, _table())


def test_violations_catch_a_limit_outside_the_range_and_a_requirement_missed_at_the_limit():
    import dataclasses

    problem = PlacementProblem.build([Gpu("h-0", "h100")], [Job("j", "heavy", 9.0, 1e5)], _table(),
                                     power_limit_levels=LEVELS)
    p = GoghOptimizer().place(problem)
    bad = dataclasses.replace(p, assignments=(dataclasses.replace(p.assignments[0], power_limit_w=50.0),))
    found = " ".join(violations(problem, bad))
    assert "outside h100's range" in found and "< required" in found


def test_shipped_model_round_trips_through_json():
    model = default_limit_model()
    from gogh_flows.power_limits import PowerLimitModel

    again = PowerLimitModel.from_json(model.to_json())
    assert again.form == model.form
    assert again.response(500.0, 70.0, 400.0) == pytest.approx(model.response(500.0, 70.0, 400.0), rel=1e-3)
    with pytest.raises(ValueError, match="need 'form' and 'params'"):
        PowerLimitModel.from_json({"params": {}})


@pytest.mark.parametrize("name", BASELINES)
def test_a_baseline_given_limit_levels_places_as_without_them_at_full_power(name):
    """The baselines stand for schedulers that choose no limit: levels on the problem change
    nothing of theirs (with the optimiser's limited options greedy-fastest was slower)."""
    gpus = [Gpu("h-0", "h100"), Gpu("h-1", "h100")]
    jobs = [Job("a", "heavy", 5.0, 1e5), Job("b", "light", 4.0, 1e5)]
    plain = get_policy(name).place(PlacementProblem.build(gpus, jobs, _table()))
    levels = get_policy(name).place(PlacementProblem.build(gpus, jobs, _table(), power_limit_levels=LEVELS))
    assert plain.assignments, name
    assert [(a.job_id, a.gpus, a.partner, a.throughput, a.power_limit_w) for a in levels.assignments] == \
        [(a.job_id, a.gpus, a.partner, a.throughput, a.power_limit_w) for a in plain.assignments]
    assert all(a.power_limit_w is None for a in levels.assignments)


def test_a_baseline_joining_a_board_at_a_lowered_limit_keeps_that_limit():
    """A board's limit was chosen for the run on it: a baseline's join neither lowers nor lifts it."""
    running = Job("r", "heavy", 1.0, 1e5, gpus=("h-0",), power_limit_w=350.0)
    problem = PlacementProblem.build([Gpu("h-0", "h100")], [running, Job("n", "light", 1.0, 1e4)], _table(),
                                     power_limit_levels=LEVELS)
    for name in ("greedy-fastest", "first-fit"):
        p = get_policy(name).place(problem)
        a = p.assignment("n")
        assert a.gpus == ("h-0",) and a.partner == "r" and a.power_limit_w == 350.0, name
        assert violations(problem, p) == [], name

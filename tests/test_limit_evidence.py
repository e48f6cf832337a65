"""Learning from runs at limits: a level a job type measured too slow at is not offered again
(PlacementProblem.limit_evidence; docs/energy.md, "Learning from runs at limits")."""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

from gogh_flows.flows.observations import limit_evidence_from_measurements
from gogh_flows.placement import BASELINES, GoghOptimizer, Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.result import Assignment, Placement
from gogh_flows.placement.verify import placement_energy, violations
from gogh_flows.power_limits import informed_rate, probe_limit
from test_placement_limits import LEVELS, _table


def _problem(evidence=None, jobs=None, gpus=None, trials=True) -> PlacementProblem:
    return PlacementProblem.build(gpus or [Gpu("h-0", "h100")], jobs or [Job("j", "heavy", 5.0, 1e5)], _table(),
                                  power_limit_levels=LEVELS, limit_evidence=evidence, limit_trials=trials)


def test_a_level_measured_too_slow_is_not_chosen_again_by_any_policy():
    first = GoghOptimizer().place(_problem()).assignment("j")
    assert first.power_limit_w is not None  # the model says a lower limit meets 5 steps/s
    # ... but a run of the type there measured 4.2 steps/s
    problem = _problem({("heavy", "h100"): ((first.power_limit_w, 4.2),)})
    for name in ("optimizer", *BASELINES):
        a = get_policy(name).place(problem).assignment("j")
        assert a.power_limit_w is None or a.power_limit_w > first.power_limit_w, name
        assert violations(problem, get_policy(name).place(problem)) == [], name


def test_evidence_at_a_limit_bounds_every_limit_below_it_and_nothing_above():
    problem = _problem({("heavy", "h100"): ((500.0, 6.0),)})
    job = problem.job("j")
    assert problem.rate_bound(job, "h100", 500.0) == 6.0
    assert problem.rate_bound(job, "h100", 300.0) == 6.0  # a lower limit is no faster
    assert problem.rate_bound(job, "h100", 600.0) == float("inf")
    assert problem.rate_bound(job, "h100", None) == float("inf")  # the maximum: predictions alone
    assert problem.rate_bound(job, "a100", 300.0) == float("inf")  # another GPU type: nothing known
    gang = Job("g", "heavy", 5.0, 1e5, num_gpus=2)
    assert problem.rate_bound(gang, "h100", 300.0) == float("inf")  # measured single-GPU runs only
    # the least of the limits at or above
    two = _problem({("heavy", "h100"): ((500.0, 6.0), (400.0, 7.0))})
    assert two.rate_bound(job, "h100", 400.0) == 6.0


def test_a_partner_is_bounded_by_its_own_evidence_when_a_join_lowers_the_limit():
    # a light job runs alone; the heavy one joining may set a lower limit for the pair
    running = Job("r", "light", 1.0, 1e5, gpus=("h-0",))
    arriving = Job("j", "heavy", 1.0, 1e5)
    plain = GoghOptimizer().place(_problem(jobs=[running, arriving]))
    a = plain.assignment("j")
    assert a.partner == "r" and a.power_limit_w is not None
    # the light job's runs measured it slower than its requirement at that limit and below
    problem = _problem({("light", "h100"): ((a.power_limit_w, 0.5),)}, jobs=[running, arriving])
    after = GoghOptimizer().place(problem)
    b = after.assignment("j")
    assert b.power_limit_w is None or b.power_limit_w > a.power_limit_w
    assert violations(problem, after) == []


def test_verify_flags_a_placement_at_a_level_the_evidence_rules_out():
    problem = _problem({("heavy", "h100"): ((400.0, 4.0),)})
    bad = Placement("hand", (Assignment("j", "h100", ("h-0",), 5.5, 0.0, power_limit_w=300.0),), (), "heuristic",
                    float("nan"), 0.0)
    assert any("< required 5" in v and "at 300 W" in v for v in violations(problem, bad))


@pytest.mark.parametrize("evidence, match", [
    ({"heavy": ((300.0, 4.0),)}, "keyed by \\(job type, GPU type\\)"),
    ({("heavy", "h100"): ((0.0, 4.0),)}, "limit > 0"),
    ({("heavy", "h100"): ((300.0, float("nan")),)}, "rate >= 0"),
    ({("heavy", "h100"): (300.0, 4.0)}, "pairs, or .* triples, with a limit > 0"),
])
def test_malformed_evidence_says_what_it_should_be(evidence, match):
    with pytest.raises(ValueError, match=match):
        _problem(evidence)


def _row(run: str, *, gpu_type="h100", job_type="heavy", throughput=5.0, partners=(), window="emulated",
         mean_power_w=None, **extra) -> dict:
    return {"run_id": run, "job_type": job_type, "gpu_type": gpu_type, "throughput": throughput, "steps": 100.0,
            "partners": list(partners), "telemetry": "emulated", "window": window, "mean_power_w": mean_power_w,
            "extra": json.dumps({k: str(v) for k, v in extra.items()})}


def test_measurements_give_the_rate_at_the_limit_a_lifted_run_left_and_a_kept_one_ran_at():
    frame = pl.DataFrame([
        _row("lifted", throughput=6.5, power_limit_w="", limit_lifted_from_w=300.0, limit_lifted_rate=4.1),
        _row("kept-a", throughput=7.0, power_limit_w=400.0),
        _row("kept-b", throughput=9.0, power_limit_w=400.0),
        _row("kept-c", throughput=7.5, power_limit_w=400.0),
        _row("kept-w", job_type="light", throughput=7.5, power_limit_w=400.0, mean_power_w=350.0),
        _row("kept-x", job_type="light", throughput=7.0, power_limit_w=400.0, mean_power_w=360.0),
        _row("full", throughput=10.0, power_limit_w=""),  # at the maximum: nothing to learn here
        _row("paired", throughput=2.0, power_limit_w=300.0, partners=("other",)),  # slowed by its partner
        _row("cpu-timed", throughput=0.1, power_limit_w=300.0, window="whole_run"),  # not its GPU's rate
        _row("t4", gpu_type="t4", throughput=1.0, power_limit_w=50.0),
    ], schema_overrides={"partners": pl.List(pl.String)})
    evidence = limit_evidence_from_measurements(frame)
    assert evidence == {("heavy", "h100"): ((300.0, 4.1), (400.0, 7.5)),  # runs at one limit: their median
                        ("light", "h100"): ((400.0, 7.25, 355.0),),  # and the board power they measured
                        ("heavy", "t4"): ((50.0, 1.0),)}
    assert limit_evidence_from_measurements(pl.DataFrame()) == {}


def _levels_below(problem: PlacementProblem, limit_w: float) -> list[float]:
    return sorted((w for w in problem.limit_levels("h100") if w is not None and w < limit_w - 1e-6), reverse=True)


def test_a_limit_runs_met_comfortably_leads_to_one_level_lower_and_no_further_than_the_runs_allow():
    """The placement probes one level below the best measured limit, once per run, and stops at
    a level measured too slow or costlier per step (docs/energy.md, "Learning from runs at limits")."""
    first = GoghOptimizer().place(_problem()).assignment("j").power_limit_w
    assert first is not None
    probe = _levels_below(_problem(), first)[0]
    # runs at the model's choice met 5 steps/s with room: the next run tries the level below
    met = _problem({("heavy", "h100"): ((first, 9.0, 0.9 * first),)})
    placed = GoghOptimizer().place(met)
    assert placed.assignment("j").power_limit_w == probe
    assert violations(met, placed) == []
    assert placement_energy(met, placed) == pytest.approx(placed.assignment("j").energy_j)
    for name in BASELINES:  # the baselines place at full power and break no requirement either
        assert violations(met, get_policy(name).place(met)) == [], name
    # PlacementPolicy(limit_trials=False): the measured level as measured, nothing lower tried
    assert GoghOptimizer().place(_problem(met.limit_evidence, trials=False)).assignment("j").power_limit_w == first
    # that run fell short (the worker's guard lifted its limit): back to the level above
    short = _problem({("heavy", "h100"): ((first, 9.0, 0.9 * first), (probe, 4.0))})
    assert GoghOptimizer().place(short).assignment("j").power_limit_w == first
    # it met the requirement but cost more per step: the level above stays, nothing lower is tried
    costly = _problem({("heavy", "h100"): ((first, 9.0, 0.9 * first), (probe, 5.2, 0.99 * probe))})
    assert GoghOptimizer().place(costly).assignment("j").power_limit_w == first
    # cheaper per step: the next run goes one level lower again, if there is one
    cheaper = _problem({("heavy", "h100"): ((first, 9.0, 0.9 * first), (probe, 8.8, 0.8 * probe))})
    lower = _levels_below(cheaper, probe)
    assert GoghOptimizer().place(cheaper).assignment("j").power_limit_w == (lower[0] if lower else probe)


def test_probe_and_informed_rate_follow_the_measurements():
    levels = [200.0, 325.0, 450.0, 575.0]
    board = lambda w: 0.9 * w  # noqa: E731 - the model's draw at a limit
    assert probe_limit(levels, [], 5.0, board, 700.0, 10.0) is None  # nothing measured: the model alone
    assert probe_limit(levels, [(450.0, 9.0, 400.0)], 5.0, board, 700.0, 10.0) == 325.0
    assert probe_limit(levels, [(450.0, 9.0), (325.0, 4.0)], 5.0, board, 700.0, 10.0) is None  # short there
    assert probe_limit(levels, [(450.0, 9.0, 400.0), (325.0, 8.0, 300.0)], 5.0, board, 700.0, 10.0) == 200.0
    assert probe_limit(levels, [(450.0, 9.0, 400.0), (325.0, 5.1, 320.0)], 5.0, board, 700.0, 10.0) is None
    assert probe_limit(levels, [(200.0, 9.0)], 5.0, board, 700.0, 10.0) is None  # the lowest level: nothing below
    seen = [(450.0, 9.0, 400.0)]
    assert informed_rate(seen, 450.0, 6.0) == 9.0  # measured: the measurement, not the model
    assert informed_rate(seen, 325.0, 6.0, probe_w=325.0) == 9.0  # the probe: hoping for no further slowdown
    assert informed_rate(seen, 325.0, 6.0) == 6.0  # elsewhere the model, bounded by what was measured above
    assert informed_rate(seen, 325.0, 12.0) == 9.0
    assert informed_rate(seen, 575.0, 9.5) == 9.5
    # a lowered limit measured short, nothing measured better than the full limit: no probe
    assert probe_limit(levels, [(450.0, 4.0)], 5.0, board, 700.0, 10.0) is None


def test_a_join_onto_a_job_whose_type_was_measured_is_costed_as_the_verifier_costs_it():
    """The partner's energy alone before the join is costed from its measurements too, so the
    option the optimiser picks is the one the verifier says is cheapest (review: a join was
    picked at 4.77 MJ that the verifier put at 5.73 MJ, above going alone)."""
    from gogh_flows.placement.result import Assignment, Placement

    running = Job("r", "light", 1.0, 1e5, gpus=("h-0",), power_limit_w=325.0)
    problem = PlacementProblem.build([Gpu("h-0", "h100"), Gpu("h-1", "h100")], [running, Job("j", "heavy", 1.0, 1e5)],
                                     _table(), power_limit_levels=LEVELS,
                                     limit_evidence={("light", "h100"): ((325.0, 30.0, 100.0),)})
    placed = GoghOptimizer().place(problem)
    ex = placed.explanations["j"]
    for c in (ex.chosen, *ex.alternatives):
        alone = Placement("x", (Assignment("j", c.gpu_type, c.gpus, c.throughput, c.energy_j, partner=c.partner,
                                           power_limit_w=c.power_limit_w),), (), "heuristic", float("nan"), 0.0)
        assert placement_energy(problem, alone) == pytest.approx(c.energy_j), c.where
    for name in ("optimizer", *BASELINES):
        p = get_policy(name).place(problem)
        assert placement_energy(problem, p) == pytest.approx(sum(a.energy_j for a in p.assignments)), name


def test_one_trial_at_a_time_per_job_type_and_gpu_type():
    evidence = {("heavy", "h100"): ((450.0, 9.0, 400.0),)}
    gpus = [Gpu("h-0", "h100", 1), Gpu("h-1", "h100", 1), Gpu("h-2", "h100", 1)]
    alone = _problem(evidence, gpus=gpus)
    probe = alone.probe_limit(alone.job("j"), "h100")
    assert probe == 325.0 and GoghOptimizer().place(alone).assignment("j").power_limit_w == probe
    # a run of the type is trying that level now, or ran short there and was lifted (its lease then
    # shows the board's full limit), or runs at any limit: the next waits for its measurement
    for limit in (probe, None, 450.0):
        trying = Job("t", "heavy", 5.0, 1e5, gpus=("h-0",), power_limit_w=limit)
        busy = _problem(evidence, jobs=[trying, Job("j", "heavy", 5.0, 1e5)], gpus=gpus)
        assert busy.probe_limit(busy.job("j"), "h100") is None, limit
        assert GoghOptimizer().place(busy).assignment("j").power_limit_w != probe
    # a run that ended there with its measurement still to come (its record not yet written)
    pending = PlacementProblem.build(gpus, [Job("j", "heavy", 5.0, 1e5)], _table(), power_limit_levels=LEVELS,
                                     limit_evidence=evidence, measuring={("heavy", "h100")})
    assert pending.probe_limit(pending.job("j"), "h100") is None
    # a run of another job type does not hold the trial back
    other = _problem(evidence, jobs=[Job("t", "light", 1.0, 1e5, gpus=("h-0",)), Job("j", "heavy", 5.0, 1e5)],
                     gpus=gpus)
    assert other.probe_limit(other.job("j"), "h100") == probe
    # two arrivals of the type in one decision: only the first is offered the trial
    two = _problem(evidence, jobs=[Job("x", "heavy", 5.0, 1e5), Job("y", "heavy", 5.0, 1e5)], gpus=gpus)
    assert two.probe_limit(two.job("x"), "h100") == probe and two.probe_limit(two.job("y"), "h100") is None
    for name in ("optimizer", *BASELINES):
        limits = [a.power_limit_w for a in get_policy(name).place(two).assignments]
        assert limits.count(probe) <= 1, (name, limits)


def test_a_run_measured_a_hair_below_a_level_counts_at_that_level():
    """Measured at 449.96 W is measured at the 450 W level, for the bound too (review: the rate
    there came out infinite and the option free)."""
    problem = _problem({("heavy", "h100"): ((449.96, 9.0, 400.0),)})
    assert informed_rate(((449.96, 9.0, 400.0),), 450.0, 7.0) == 9.0
    placed = GoghOptimizer().place(problem)
    a = placed.assignment("j")
    assert math.isfinite(a.throughput) and a.energy_j > 0 and violations(problem, placed) == []


def test_a_choice_at_a_measured_limit_shows_the_board_power_its_runs_measured():
    """The draw a choice shows (and the lowest-power policy ranks by) is the measured one where
    runs of the type measured the board at that limit, as its energy is costed."""
    from gogh_flows.placement.options import FleetState, options_for

    def choice(problem):
        (c,) = options_for(problem, FleetState(problem), problem.jobs[0]).choices
        return c

    levels = [w for w in _problem().limit_levels("h100") if w is not None]
    measured = _problem({("heavy", "h100"): tuple((w, 6.0, 0.5 * w) for w in levels)}, trials=False)
    c = choice(measured)
    assert c.power_limit_w in levels and c.power_w == pytest.approx(0.5 * c.power_limit_w)
    # points without board power keep the model's draw
    rate_only = _problem({("heavy", "h100"): tuple((w, 6.0) for w in levels)}, trials=False)
    r = choice(rate_only)
    assert r.power_limit_w == c.power_limit_w
    assert r.power_w == pytest.approx(measured.energy.power_alone("h100", _occupant_activity(rate_only), r.power_limit_w))
    assert r.power_w != pytest.approx(c.power_w)


def _occupant_activity(problem) -> float:
    from gogh_flows.placement.options import _occupant

    job = problem.jobs[0]
    return _occupant(problem, job, "h100", problem.throughputs.isolated(job, "h100")).activity

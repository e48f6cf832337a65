"""The learned policies in the simulator: gogh (P1 + online P2) and gogh-p1 (P1 only)."""


import pytest

from gogh_flows.placement import Gpu
from gogh_flows.placement.problem import Job
from gogh_flows.sim.engine import ObservedThroughputs, SimConfig
from gogh_flows.sim.learned import LearnedThroughputs
from gogh_flows.sim.run import make_policy, run_policies
from gogh_flows.sim.traces import TraceJob
from gogh_flows.truth.table import ThroughputTable

TYPES = ("v100", "t4")
HELD_OUT = "ResNet-50"
# (job type, steps/s on v100, on t4): three training families and the held-out one
SPEEDS = [
    ("ResNet-18 (batch size 32)", 30.0, 9.0), ("ResNet-18 (batch size 64)", 18.0, 5.0),
    ("ResNet-18 (batch size 128)", 10.0, 2.6), ("LM (batch size 20)", 12.0, 4.0),
    ("LM (batch size 40)", 7.0, 2.2), ("Transformer (batch size 32)", 9.0, 2.5),
    ("Transformer (batch size 64)", 5.0, 1.3),
    ("ResNet-50 (batch size 32)", 11.0, 2.8), ("ResNet-50 (batch size 64)", 6.0, 1.5),
]


def J(id: str, job_type: str, total_steps: float, arrival_s: float,  # noqa: N802 - reads like a record
      required_throughput: float | None, num_gpus: int = 1) -> TraceJob:
    return TraceJob(id, job_type, total_steps, num_gpus, arrival_s, required_throughput=required_throughput)


def _truth() -> ThroughputTable:
    rows = []
    for jt, v, t in SPEEDS:
        rows += [{"job_type": jt, "gpu_type": "v100", "scale_factor": 1, "throughput": v},
                 {"job_type": jt, "gpu_type": "t4", "scale_factor": 1, "throughput": t}]
    for i, (a, va, ta) in enumerate(SPEEDS):
        for b, vb, tb in SPEEDS[i:]:
            for g, x, y in (("v100", va, vb), ("t4", ta, tb)):
                rows.append({"job_type": a, "gpu_type": g, "scale_factor": 1, "partner": b,
                             "throughput": 0.6 * x, "partner_throughput": 0.6 * y})
    return ThroughputTable.from_rows(rows)


@pytest.fixture(scope="module")
def truth() -> ThroughputTable:
    return _truth()


@pytest.fixture(scope="module")
def predictors(truth):
    from gogh_flows.sim.holdout import train_holdout

    return train_holdout(truth, HELD_OUT, p1_epochs=5, p2_epochs=20, seed=0)


def _stream(n: int = 16) -> list[J]:
    """Jobs of the held-out family only; every requirement reachable alone on a V100."""
    held = [s for s in SPEEDS if s[0].startswith(HELD_OUT)]
    out = []
    for i in range(n):
        jt, v, _ = held[i % len(held)]
        out.append(J(f"j{i}", jt, 600.0 * v, 120.0 * i, (0.3 + 0.04 * (i % 10)) * v))
    return out


GPUS = [Gpu("v0", "v100"), Gpu("v1", "v100"), Gpu("t0", "t4"), Gpu("t1", "t4")]


def test_gogh_runs_end_to_end_on_jobs_of_an_unseen_family(truth, predictors):
    jobs = _stream()
    res = run_policies(jobs, GPUS, truth, ["oracle", "gogh", "gogh-p1"],
                       config=SimConfig(seed=0, observe_after_s=60.0), predictors=predictors)
    for name, r in res.items():
        s = r.summary()
        assert s["jobs_completed"] == len(jobs) and not r.unfinished, name
        assert s["energy_kwh"] > 0 and 0 <= s["sla_attainment"] <= 1, name
    assert predictors.p2 is not None and not any(
        n.startswith(HELD_OUT) for n in predictors.p2.layout.partners)  # never trained on it


def test_an_observation_moves_the_jobs_predictions_on_other_gpu_types(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    job = Job("x", "ResNet-50 (batch size 32)", 1.0, 100.0)
    before = {g: view.isolated(job, g) for g in TYPES}
    # the planner's wrapper (as the simulator uses it) forwards the observation
    planning = ObservedThroughputs(view)
    planning.observe(job, "v100", None, 3.0 * before["v100"])
    assert planning.isolated(job, "v100") == pytest.approx(3.0 * before["v100"])
    after_t4 = planning.isolated(job, "t4")  # never observed: P2 spread the news
    assert after_t4 != pytest.approx(before["t4"], rel=1e-3)
    assert view.refinements == 1
    # the learning base is per job type: a later job of the same type starts from what was
    # learned (exact on the measured type), a job of another type keeps its prior
    later = Job("y", job.job_type, 1.0, 100.0)
    assert view.isolated(later, "v100") == pytest.approx(3.0 * before["v100"])
    assert view.isolated(later, "t4") == pytest.approx(after_t4)
    stranger = Job("z", "ResNet-50 (batch size 64)", 1.0, 100.0)
    fresh = LearnedThroughputs(predictors, TYPES, refine=True)
    assert view.isolated(stranger, "t4") == pytest.approx(fresh.isolated(stranger, "t4"))


def test_measured_pairs_and_gangs_answer_for_later_jobs_of_their_types(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    a, b = Job("a", "ResNet-50 (batch size 32)", 1.0, 100.0), Job("b", "ResNet-50 (batch size 64)", 1.0, 100.0)
    view.observe(a, "t4", b, 0.7)
    view.observe(b, "t4", a, 0.4)
    a2, b2 = Job("a2", a.job_type, 1.0, 100.0), Job("b2", b.job_type, 1.0, 100.0)
    assert view.pair(a2, b2, "t4") == pytest.approx((0.7, 0.4))
    gang = Job("g", a.job_type, 1.0, 100.0, num_gpus=4)
    view.observe(gang, "v100", None, 25.0)
    view.observe(Job("g1", a.job_type, 1.0, 100.0, num_gpus=4), "v100", None, 36.0)
    assert view.isolated(Job("g2", a.job_type, 1.0, 100.0, num_gpus=4), "v100") == pytest.approx(30.0)


def test_a_direct_measurement_outweighs_one_implied_through_a_pair_or_gang(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    job, mate = Job("a", "ResNet-50 (batch size 32)", 1.0, 100.0), Job("m", "ResNet-50 (batch size 64)", 1.0, 100.0)
    view.observe(job, "v100", None, 8.0)
    view.observe(job, "v100", mate, 1.0)  # implies some isolated rate through P1's ratio
    view.observe(Job("g", job.job_type, 1.0, 100.0, num_gpus=4), "v100", None, 5.0)
    assert view.isolated(Job("x", job.job_type, 1.0, 100.0), "v100") == pytest.approx(8.0)


def test_a_pair_observation_refines_the_isolated_row_too(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    job = Job("x", "ResNet-50 (batch size 32)", 1.0, 100.0)
    mate = Job("m", "ResNet-50 (batch size 64)", 1.0, 100.0)
    before = view.isolated(job, "t4")
    own, _ = view.pair(job, mate, "v100")
    view.observe(job, "v100", mate, 2.0 * own)
    assert view.isolated(job, "v100") > 1.5 * (own / view.ratio(job.job_type, mate.job_type)[0])
    assert view.isolated(job, "t4") != pytest.approx(before, rel=1e-3)


def test_gogh_p1_ignores_observations(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=False)
    job = Job("x", "ResNet-50 (batch size 32)", 1.0, 100.0)
    before = {g: view.isolated(job, g) for g in TYPES}
    view.observe(job, "v100", None, 5.0 * before["v100"])
    assert {g: view.isolated(job, g) for g in TYPES} == before
    assert view.refinements == 0


def test_an_underestimated_job_is_still_tried_where_it_looks_best(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    low = Job("a", "ResNet-50 (batch size 32)", 1.0, 100.0)
    row = {g: view.isolated(low, g) for g in TYPES}
    need = 10.0 * max(row.values())
    high = Job("b", low.job_type, need, 100.0)
    floored = {g: view.isolated(high, g) for g in TYPES}
    assert max(floored.values()) >= need
    assert floored["v100"] / floored["t4"] == pytest.approx(row["v100"] / row["t4"])


def test_deterministic_for_a_seed(truth, predictors):
    jobs = _stream(10)
    cfg = SimConfig(seed=1, noise=0.1, observe_after_s=60.0)
    drop = ("decision_p50_ms", "decision_p99_ms", "rebalance_p99_ms")
    runs = [run_policies(jobs, GPUS, truth, ["gogh"], config=cfg, predictors=predictors)["gogh"]
            for _ in range(2)]
    a, b = ({k: v for k, v in r.summary().items() if k not in drop} for r in runs)
    assert a == b
    assert {j: r.gpu_type for j, r in runs[0].jobs.items()} == {j: r.gpu_type for j, r in runs[1].jobs.items()}


def test_learned_policy_without_predictors_is_a_clear_error(truth):
    with pytest.raises(ValueError, match="--predictors"):
        make_policy("gogh", truth)


def test_cli_simulate_gogh_with_holdout_family_and_with_a_predictors_dir(tmp_path, truth,
                                                                         predictors, capsys):
    import json

    from gogh_flows.cli import main
    from gogh_flows.predict.io import save_model

    # the CLI reads Gavel-format JSON or 'synthetic': write this small truth as Gavel JSON
    doc: dict = {}
    for r in truth.frame.iter_rows(named=True):
        key = f"('{r['job_type']}', 1)"
        entry = doc.setdefault(r["gpu_type"], {}).setdefault(key, {})
        if r["partner"] is None:
            entry["null"] = r["throughput"]
        else:
            entry[f"('{r['partner']}', 1)"] = [r["throughput"], r["partner_throughput"]]
    (tmp_path / "truth.json").write_text(json.dumps(doc))
    trace = tmp_path / "x.trace"
    trace.write_text("".join(f"{jt}\tpython3 main.py\tdir\t--num_steps\t1\t{600 * v:.0f}\t1\t1\t"
                             f"-1.000000\t{120 * i}\n" for i, (jt, v, _) in enumerate(SPEEDS)))
    out = tmp_path / "r.json"
    rc = main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
               "--cluster", "v100=2,t4=2", "--policy", "oracle,gogh,gogh-p1",
               "--holdout-family", HELD_OUT, "--p1-epochs", "5", "--p2-epochs", "20",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    figures = json.loads(out.read_text())
    assert set(figures["policies"]) == {"oracle", "gogh", "gogh-p1"}
    assert figures["holdout_family"] == HELD_OUT and "without family" in figures["predictors"]
    assert figures["policies"]["gogh"]["jobs_completed"] == figures["jobs"]
    assert figures["risk_level"] is None  # point predictions; a level is recorded with the figures it made

    save_model(predictors.p1, tmp_path / "m" / "p1")
    save_model(predictors.p2, tmp_path / "m" / "p2")
    rc = main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
               "--cluster", "v100=2,t4=2", "--policy", "gogh", "--predictors", str(tmp_path / "m"),
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["predictors"].startswith("loaded from")
    # predictors saved without intervals cannot plan at a risk level: said in the CLI's words
    assert main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
                 "--cluster", "v100=2,t4=2", "--policy", "gogh", "--predictors", str(tmp_path / "m"),
                 "--risk-level", "0.9"]) != 0
    err = capsys.readouterr().err
    assert f"gogh predictors calibrate --model {tmp_path / 'm'}`, or drop --risk-level" in err, err
    # every family unseen: the trace keeps its own types (all four families), each planned without its own
    rc = main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
               "--cluster", "v100=2,t4=2", "--policy", "oracle,gogh", "--holdout-family", "Each",
               "--p1-epochs", "3", "--p2-epochs", "10", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "once for each family of the jobs (LM, ResNet-18, ResNet-50, Transformer)" in capsys.readouterr().err
    figures = json.loads(out.read_text())
    assert figures["holdout_family"] == "each" and figures["jobs"] == len(SPEEDS)
    assert "once per family, each without it (LM, ResNet-18, ResNet-50, Transformer)" in figures["predictors"]
    assert figures["policies"]["gogh"]["jobs_completed"] == len(SPEEDS)
    assert main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
                 "--cluster", "v100=2,t4=2", "--policy", "gogh", "--predictors", str(tmp_path / "m"),
                 "--holdout-family", "each"]) != 0
    assert "--holdout-family each trains P1/P2 here once per family" in capsys.readouterr().err
    # refused before anything runs: nothing learned to train for; a misspelt family names 'each' too
    assert main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
                 "--cluster", "v100=2,t4=2", "--policy", "oracle", "--holdout-family", " each "]) != 0
    assert "none of ['oracle'] is a learned policy" in capsys.readouterr().err
    assert main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
                 "--cluster", "v100=2,t4=2", "--policy", "gogh", "--holdout-family", "eahc"]) != 0
    assert "or 'each' to keep the jobs' own types" in capsys.readouterr().err
    # several seeds: one training (the first seed's) serves them all, for the families of their jobs
    lm_only = tmp_path / "lm.trace"
    lm_only.write_text("".join(line for line in trace.read_text().splitlines(keepends=True)
                               if line.startswith(("LM", "ResNet-50"))))
    rc = main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(lm_only),
               "--cluster", "v100=2,t4=2", "--policy", "gogh", "--holdout-family", "each", "--seeds", "0,1",
               "--p1-epochs", "3", "--p2-epochs", "10", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.count("training P1") == 1 and "once for each family of the jobs (LM, ResNet-50)" in err, err
    figures = json.loads(out.read_text())
    assert figures["predictors"].endswith("seed 0)") and set(figures["per_seed"]) == {"0", "1"}
    assert main(["simulate", "--truth", str(tmp_path / "truth.json"), "--trace", str(trace),
                 "--cluster", "v100=2,t4=2", "--policy", "gogh"]) != 0
    assert "--predictors" in capsys.readouterr().err


@pytest.mark.parametrize("refine", [False, True])
def test_a_floored_job_measured_short_is_tried_on_its_next_best_type(predictors, refine):
    """Once its floored best type is measured below the requirement, another type is lifted.

    Without this, gogh-p1 left such jobs queued forever: the overlay answered with the low
    measurement and the other types stayed below the requirement.
    """
    view = LearnedThroughputs(predictors, TYPES, refine=refine)
    planning = ObservedThroughputs(view)
    probe = Job("a", "ResNet-50 (batch size 32)", 1.0, 100.0)
    need = 10.0 * max(view.isolated(probe, g) for g in TYPES)
    job = Job("b", probe.job_type, need, 100.0)
    best = max(TYPES, key=lambda g: planning.isolated(job, g))
    assert planning.isolated(job, best) >= need
    planning.observe(job, best, None, 0.5 * need)
    assert planning.isolated(job, best) == pytest.approx(0.5 * need)
    other = next(g for g in TYPES if g != best)
    assert planning.isolated(job, other) >= need


def test_nothing_is_lifted_while_a_measured_sibling_type_meets_the_requirement(predictors):
    """A sibling measured on the V100 fast enough: the job goes there, the T4 stays short.

    Lifting the unmeasured T4 too (the floor once did, as nothing *unmeasured* met the
    requirement) offered a cheaper type predicted just fast enough, measured short: on a
    five-type fleet jobs visited V100, T4 and K80 in turn before the H100 their type's
    measurement had already shown to be enough (SLA attainment 0.89, 132 migrations).
    """
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    planning = ObservedThroughputs(view)
    jt = "ResNet-50 (batch size 32)"
    sibling = Job("s", jt, 1.0, 100.0)
    planning.observe(sibling, "v100", None, 11.0)
    job = Job("b", jt, 10.0, 100.0)
    t4 = planning.isolated(job, "t4")
    assert planning.isolated(job, "v100") >= 10.0 and t4 < 10.0
    # ... and not once the job itself ran there fast enough (the rebalancer would move it to a
    # lifted T4 otherwise)
    planning.observe(job, "v100", None, 11.0)
    assert planning.isolated(job, "t4") < 10.0


def test_a_gang_measured_short_where_single_gpus_promise_enough_is_still_placed_somewhere(predictors):
    """The floor judges a gang by what it would be told: a gang size measured on a type answers
    as measured, however fast single GPUs of the type were. (Judged by the single-GPU row, a
    2-GPU job whose type's 2-GPU runs on the V100 fell short was thought feasible there, nothing
    was lifted, and it was never placed: six unfinished jobs in a run.)"""
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    planning = ObservedThroughputs(view)
    jt = "ResNet-50 (batch size 32)"
    planning.observe(Job("s1", jt, 1.0, 100.0), "v100", None, 11.0)  # one GPU: 11 steps/s
    planning.observe(Job("s2", jt, 1.0, 100.0, num_gpus=2), "v100", None, 12.0)  # two: only 12
    gang = Job("b", jt, 15.0, 100.0, num_gpus=2)
    assert planning.isolated(gang, "v100") == pytest.approx(12.0)
    assert max(planning.isolated(gang, g) for g in TYPES) >= 15.0


def test_a_gang_whose_size_was_measured_short_everywhere_is_still_tried_somewhere(predictors):
    """Siblings measured 2-GPU runs on every type, all below this gang's requirement: the floor
    lifts what the planner answers (the measured gang rates), so the job is tried where it looks
    best instead of waiting forever (its own rate may meet the requirement under noise)."""
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    planning = ObservedThroughputs(view)
    jt = "ResNet-50 (batch size 32)"
    planning.observe(Job("s1", jt, 1.0, 100.0, num_gpus=2), "v100", None, 19.0)
    planning.observe(Job("s2", jt, 1.0, 100.0, num_gpus=2), "t4", None, 5.0)
    gang = Job("b", jt, 20.0, 100.0, num_gpus=2)
    lifted = {g: planning.isolated(gang, g) for g in TYPES}
    assert max(lifted.values()) >= 20.0
    assert lifted["v100"] / lifted["t4"] == pytest.approx(19.0 / 5.0)  # lifted alike, order kept


def test_a_gang_is_lifted_on_the_one_type_that_can_host_it(predictors):
    """A 4-GPU job predicted fast enough on a type the fleet has two of was "feasible somewhere",
    so nothing was lifted on the type with four, the only one that could run it, and it waited
    for ever (a review: `--risk-level 0.9`, one job never placed, the policy's mean ratio then
    below the floor). The floor looks only at types with enough GPUs for the gang."""
    jt = "ResNet-50 (batch size 32)"
    free = LearnedThroughputs(predictors, TYPES, refine=True)
    probe = Job("p", jt, 1e-6, 100.0, num_gpus=4)
    rates = {g: free.isolated(probe, g) for g in TYPES}
    fast, slow = sorted(TYPES, key=rates.get, reverse=True)
    need = (rates[fast] + rates[slow]) / 2  # met on the fast type only
    gang = Job("g", jt, need, 100.0, num_gpus=4)
    assert free.isolated(gang, slow) < need  # no counts: the fast type "can" host it, nothing lifted
    view = LearnedThroughputs(predictors, TYPES, refine=True, gpu_counts={fast: 2, slow: 4})
    assert view.isolated(gang, slow) >= need  # lifted where it can run
    assert view.isolated(gang, fast) == pytest.approx(rates[fast])  # the other type is left as predicted


def test_a_measured_sibling_of_the_same_family_moves_an_unmeasured_type(predictors):
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    sib, new = "ResNet-50 (batch size 64)", "ResNet-50 (batch size 32)"
    before = view.isolated(Job("n", new, 1.0, 100.0), "t4")
    # the sibling runs 3x slower on a t4 than its own prediction
    view.observe(Job("s", sib, 1.0, 100.0), "t4", None, view.isolated(Job("s0", sib, 1.0, 100.0), "t4") / 3)
    assert view.isolated(Job("n2", new, 1.0, 100.0), "t4") == pytest.approx(before / 3, rel=1e-6)
    other_family = Job("o", "LM (batch size 20)", 1.0, 100.0)
    assert view.isolated(other_family, "t4") == pytest.approx(
        LearnedThroughputs(predictors, TYPES, refine=True).isolated(other_family, "t4"))


def test_a_pair_observation_still_refines_a_type_whose_siblings_were_measured(predictors):
    """The siblings' cache must not hide a later refinement of the type's own row."""
    view = LearnedThroughputs(predictors, TYPES, refine=True)
    a, sib = "ResNet-50 (batch size 32)", "ResNet-50 (batch size 64)"
    view.observe(Job("s", sib, 1.0, 100.0), "t4", None, 1.0)
    before = view.isolated(Job("a0", a, 1.0, 100.0), "v100")
    own, _ = view.pair(Job("a1", a, 1.0, 100.0), Job("m", sib, 1.0, 100.0), "v100")
    view.observe(Job("a1", a, 1.0, 100.0), "v100", Job("m", "LM (batch size 20)", 1.0, 100.0), 5.0 * own)
    assert view.isolated(Job("a2", a, 1.0, 100.0), "v100") != pytest.approx(before, rel=1e-3)


def test_a_risk_level_plans_unmeasured_entries_at_their_lower_bound(predictors):
    """Before a job type is measured every entry is lowered by the ``isolated`` width; once
    one entry is measured it is exact and the rest are lowered by the narrower
    ``isolated_1obs`` width (issue: calibrated uncertainty, planned with margin)."""
    import copy
    import math

    from gogh_flows.predict.intervals import CASES, LEVELS, Intervals, NoIntervalsError

    widths = {"isolated": 1.0, "isolated_1obs": 0.3, "colocated": 1.0, "colocated_1obs": 0.3}
    pred = copy.deepcopy(predictors)
    pred.p2.trained_on["intervals"] = Intervals(
        LEVELS, {c: tuple(widths[c] * lv for lv in LEVELS) for c in CASES}, "by hand").to_dict()
    point, careful = (LearnedThroughputs(pred, TYPES, refine=True, risk_level=r) for r in (None, 0.9))
    job = Job("x", "ResNet-50 (batch size 32)", 1e-6, 100.0)  # a requirement the floor never lifts to
    for g in TYPES:
        assert careful.isolated(job, g) == pytest.approx(point.isolated(job, g) * math.exp(-0.9))
    measured = 2.0 * point.isolated(job, "v100")
    for view in (point, careful):
        ObservedThroughputs(view).observe(job, "v100", None, measured)
    assert careful.isolated(job, "v100") == pytest.approx(measured)
    assert careful.isolated(job, "t4") == pytest.approx(point.isolated(job, "t4") * math.exp(-0.27))
    with pytest.raises(NoIntervalsError, match="intervals"):
        LearnedThroughputs(predictors, TYPES, risk_level=0.9)
    # gogh-p1 keeps its point predictions: the widths are the refiner's errors, not P1 alone's
    from gogh_flows.sim.run import make_policy
    from gogh_flows.truth.synthetic import synthetic_table

    truth = synthetic_table(list(TYPES))
    assert make_policy("gogh", truth, predictors=pred, gpu_types=TYPES, risk_level=0.9).planning.risk_level == 0.9
    p1_view = make_policy("gogh-p1", truth, predictors=pred, gpu_types=TYPES, risk_level=0.9).planning
    assert p1_view.risk_level is None
    assert p1_view.isolated(job, "t4") == pytest.approx(
        LearnedThroughputs(pred, TYPES, refine=False).isolated(job, "t4"))


def test_a_new_job_type_is_first_offered_only_the_type_chosen_to_measure_it_on(predictors):
    from gogh_flows.sim.learned import middle_types

    assert middle_types(["v100", "p100", "k80"]) == ("p100",)
    view = LearnedThroughputs(predictors, TYPES, refine=True, explore_types=("t4",))
    plain = LearnedThroughputs(predictors, TYPES, refine=True)
    easy = Job("x", "ResNet-50 (batch size 32)", 1e-6, 100.0)
    assert view.isolated(easy, "v100") == 0.0 and view.isolated(easy, "t4") == pytest.approx(plain.isolated(easy, "t4"))
    # a requirement the t4 is not predicted to meet: the whole fleet stays open
    hard = Job("y", "ResNet-50 (batch size 32)", 2 * plain.isolated(easy, "t4"), 100.0)
    assert view.isolated(hard, "v100") > 0
    # once a job of the type was measured, every type is open again
    ObservedThroughputs(view).observe(easy, "t4", None, plain.isolated(easy, "t4"))
    later = Job("z", "ResNet-50 (batch size 32)", 1e-6, 100.0)
    assert view.isolated(later, "v100") > 0


def test_too_few_families_left_for_the_ensemble_warn_without_a_risk_level_and_stop_with_one():
    """`gogh simulate --holdout-family` trains what `gogh predictors train` ships; where the families
    left cannot choose the ensemble (here A3C and one other family: an inner P2 would learn from A3C's
    single job type), a run without a risk level goes on with P2 alone and says so."""
    from gogh_flows.sim.holdout import train_holdout
    from gogh_flows.truth.synthetic import synthetic_table

    table = synthetic_table(["k80", "v100"])
    keep = [j for j in table.job_types if j == "A3C" or j.startswith(("ResNet-18", "ResNet-50"))]
    small = table.restrict(job_types=keep)
    with pytest.warns(UserWarning, match="choosing the ensemble's weights .* failed: .*P2 alone"):
        pred = train_holdout(small, "ResNet-50", p1_epochs=2, p2_epochs=2, intervals=True, strict=False)
    assert "ensemble" not in pred.p2.trained_on and "intervals" not in pred.p2.trained_on
    with pytest.raises(ValueError, match="calibrating the intervals on the 2 families left .*a risk level needs"):
        train_holdout(small, "ResNet-50", p1_epochs=2, p2_epochs=2, intervals=True)


def test_gogh_simulate_at_a_risk_level_names_its_flag_when_the_intervals_cannot_be_calibrated(gavel_dir, monkeypatch,
                                                                                           capsys):
    """The simulator's core says what is missing in its own words; the CLI names the flag to drop.
    (``gavel_dir``: ``generate:N`` draws its jobs from Gavel's Philly distribution.)"""
    from gogh_flows import cli
    from gogh_flows.sim import cli as sim_cli
    from gogh_flows.truth.synthetic import synthetic_table

    table = synthetic_table(["k80", "v100"])
    keep = [j for j in table.job_types if j == "A3C" or j.startswith(("ResNet-18", "ResNet-50"))]
    monkeypatch.setattr(sim_cli, "load_truth", lambda spec: table.restrict(job_types=keep))
    rc = cli.main(["simulate", "--truth", "synthetic", "--trace", "generate:2", "--cluster", "v100=1,k80=1",
                   "--policy", "gogh", "--holdout-family", "ResNet-50", "--p1-epochs", "2", "--p2-epochs", "2",
                   "--risk-level", "0.9"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--risk-level 0.9: choosing the ensemble's weights" in err and "(drop --risk-level)" in err


def test_every_family_unseen_plans_each_job_with_predictors_trained_without_its_family(truth):
    """A mixed stream (``sim.unseen``): each family's jobs are predicted, and learned from, by the
    predictors trained without that family; a pair asks each side's own family."""
    from gogh_flows.sim.holdout import train_each_unseen
    from gogh_flows.sim.unseen import UnseenThroughputs

    unseen = train_each_unseen(truth, p1_epochs=5, p2_epochs=20, seed=0)
    assert set(unseen.by_family) == {"ResNet-18", "LM", "Transformer", "ResNet-50"}
    assert "once per family, each without it" in unseen.description
    for fam, pred in unseen.by_family.items():  # none of them saw its own family, as job or partner
        assert pred.p2.layout.partners and not any(unseen.family_of[p] == fam for p in pred.p2.layout.partners)
    view = UnseenThroughputs(unseen, TYPES)
    a, b = Job("a", "ResNet-50 (batch size 32)", 1.0, 1.0), Job("b", "LM (batch size 20)", 1.0, 1.0)
    alone = {f: LearnedThroughputs(unseen.by_family[f], TYPES) for f in ("ResNet-50", "LM")}
    assert view.isolated(a, "t4") == pytest.approx(alone["ResNet-50"].isolated(a, "t4"))
    assert view.isolated(b, "t4") == pytest.approx(alone["LM"].isolated(b, "t4"))
    assert view.pair(a, b, "v100") == pytest.approx((alone["ResNet-50"].pair_side(a, b, "v100"),
                                                     alone["LM"].pair_side(b, a, "v100")))
    lm_before = view.isolated(b, "t4")
    view.observe(a, "v100", None, 3.0 * view.isolated(a, "v100"))  # goes to ResNet-50's learning base only
    assert view.isolated(Job("a2", a.job_type, 1.0, 1.0), "t4") != pytest.approx(alone["ResNet-50"].isolated(a, "t4"))
    assert view.views["ResNet-50"].refinements == 1 and view.refinements == 1
    assert view.isolated(b, "t4") == pytest.approx(lm_before)
    with pytest.raises(ValueError, match="'A3C' has no predictors trained without its family .*ResNet-50"):
        view.isolated(Job("x", "A3C", 1.0, 1.0), "v100")
    # the simulator runs the learned policies on it like on one family's predictors
    mixed = [J(f"m{i}", jt, 600.0 * v, 90.0 * i, 0.4 * v) for i, (jt, v, _) in enumerate(SPEEDS)]
    res = run_policies(mixed, GPUS, truth, ["gogh", "gogh+limits"], config=SimConfig(seed=0, observe_after_s=60.0),
                       predictors=unseen)
    for name, r in res.items():
        assert r.summary()["jobs_completed"] == len(mixed) and not r.unfinished, name

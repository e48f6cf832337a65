"""The product's ensemble: P2 averaged with a no-training baseline (gogh_flows/predict/ensemble.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gogh_flows.predict import evaluate as ev
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.encoding import job_summary
from gogh_flows.predict.ensemble import CASES, BaselineRows, Domain, Ensemble, roofline_log
from gogh_flows.predict.intervals import LEVELS, adjusted_level
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, train_p1
from gogh_flows.predict.p2 import P2Config, train_p2
from gogh_flows.predict.service import ThroughputPredictor, observations_frame
from gogh_flows.truth.synthetic import synthetic_table

GPUS = ("k80", "v100", "a100")
JOBS = ("A3C", "LM (batch size 20)", "Recommendation (batch size 1024)", "ResNet-18 (batch size 64)",
        "ResNet-50 (batch size 32)", "Transformer (batch size 64)")
CFG = ev.EvalConfig(p1=P1Config(hidden=8, epochs=20, pair_rows_per_epoch=128), p2=P2Config(hidden=8, epochs=20))


@pytest.fixture(scope="module")
def trained():
    data = MeasuredSet.from_table(synthetic_table(GPUS)).subset(JOBS)
    layout = Layout(data.gpus, data.names)
    oof = ev.out_of_family_p1(data, layout, dict(data.jobs), CFG.p1)
    p1 = train_p1(data, CFG.p1)
    p2 = train_p2(layout, oof, layout.truth(data, data.names), CFG.p2)
    intervals, ensemble = ev.calibrate_refiner(data, oof, CFG)
    return data, layout, p1, p2, intervals, ensemble, oof


def _with(p2, ensemble: Ensemble | None):
    from dataclasses import replace

    out = replace(p2, trained_on=dict(p2.trained_on))
    out.trained_on.pop("ensemble", None)
    if ensemble is not None:
        out.trained_on["ensemble"] = ensemble.to_dict()
    return out


def test_baseline_rows_are_the_evaluations_type_means_and_slowdowns():
    layout = Layout(("k80", "v100"), ("a", "b"))
    nan = math.nan
    # two jobs: isolated on k80, v100; then pairs with a (k80, v100), with b (k80, v100)
    known = np.log(np.array([[1.0, 4.0, 0.5, 2.0, nan, nan],
                             [4.0, 16.0, 1.0, 8.0, nan, 4.0]]))
    rows = BaselineRows.fit(layout, known)
    assert np.exp(rows.type_mean) == pytest.approx([2.0, 8.0])  # geometric means
    # next to a: slowdowns 1/2 and 1/4 on k80 (geometric mean 1/sqrt(8)), 1/2 on v100
    assert np.exp(rows.slowdown["a"]) == pytest.approx([8 ** -0.5, 0.5])
    # b never measured on k80: that type's mean over partners; on v100 its own 1/4
    assert rows.slow("b", "k80") == pytest.approx(rows.slowdown_per_type[0])
    assert math.exp(rows.slow("b", "v100")) == pytest.approx(0.25)
    assert rows.slow("someone else", "v100") == rows.slowdown_per_type[1]
    assert math.isnan(rows.prior("h100"))  # a type no training job ran on has no mean
    assert BaselineRows.from_dict(rows.to_dict()) == rows
    # the evaluation's partner-mean baseline is the same row
    pm = ev.PriorRow.partner_mean(known, 1, 2).rows[0]
    assert pm[:2] == pytest.approx(rows.type_mean)
    assert pm[2:4] == pytest.approx(np.array(rows.type_mean) + np.array(rows.slowdown["a"]))
    with pytest.raises(ValueError, match=r"measured alone on \['v100'\]"):
        BaselineRows.fit(layout, np.log(np.array([[1.0, nan, nan, nan, nan, nan]])))


def test_weights_are_checked_and_round_trip(trained):
    ensemble = trained[5]
    assert set(ensemble.weights) == set(CASES)
    assert set(ensemble.weights.values()) <= set(ev.ENSEMBLE_WEIGHTS)
    # with an observation, every setting with either baseline was a candidate
    assert set(ensemble.errors) == set(CASES) and all(
        len(v) == len(ev.ENSEMBLE_SETTINGS) * (2 if c.endswith("_1obs") else 1) for c, v in ensemble.errors.items())
    assert set(ensemble.reaches) == set(CASES) and ensemble.domain is not None
    assert set(ensemble.baselines) == set(CASES)
    assert Ensemble.from_dict(ensemble.to_dict()) == ensemble
    # stored before baselines were chosen: each case's old baseline
    old = ensemble.to_dict()
    del old["baselines"]
    assert {c: Ensemble.from_dict(old).baseline(c) for c in CASES} == {
        "isolated": "partner_mean", "colocated": "partner_mean", "isolated_1obs": "roofline",
        "colocated_1obs": "roofline"}
    with pytest.raises(ValueError, match="roofline ratio only for a measured job"):
        Ensemble(dict.fromkeys(CASES, 0.5), ensemble.rows, baselines={"isolated": "roofline"})
    with pytest.raises(ValueError, match="baselines name one of"):
        Ensemble(dict.fromkeys(CASES, 0.5), ensemble.rows, baselines={"colocated_1obs": "median"})
    with pytest.raises(ValueError, match="missing \\['colocated_1obs'\\]"):
        Ensemble({"isolated": 1.0, "colocated": 1.0, "isolated_1obs": 1.0}, ensemble.rows)
    with pytest.raises(ValueError, match="out of range"):
        Ensemble({**dict.fromkeys(CASES, 0.5), "isolated": 1.5}, ensemble.rows)


def test_the_weight_moves_predictions_between_p2_and_the_baseline(trained):
    data, layout, p1, p2, _, ensemble, _ = trained
    job = "ResNet-50 (batch size 32)"
    jobs = {job: data.jobs[job], "LM (batch size 20)": data.jobs["LM (batch size 20)"]}
    obs = observations_frame([{"job_type": job, "gpu_type": "v100", "throughput": 3.0}])
    alone = ThroughputPredictor(p1, _with(p2, None)).predict_table(jobs, GPUS, obs)
    full_p2 = Ensemble(dict.fromkeys(CASES, 1.0), ensemble.rows)
    same = ThroughputPredictor(p1, _with(p2, full_p2)).predict_table(jobs, GPUS, obs)
    assert same.frame.equals(alone.frame)  # weight 1 everywhere: P2 alone
    base = Ensemble(dict.fromkeys(CASES, 0.0), ensemble.rows)
    t = ThroughputPredictor(p1, _with(p2, base)).predict_table(jobs, GPUS, obs)
    # the measured job: the roofline ratio through its measurement (which itself stays)
    assert t.isolated(job, "v100") == 3.0
    for g in ("k80", "a100"):
        ratio = math.exp(roofline_log(data.jobs[job], g) - roofline_log(data.jobs[job], "v100"))
        assert t.isolated(job, g) == pytest.approx(3.0 * ratio, rel=1e-9)
    # the job with nothing measured: the per-type geometric mean, pairs times the partner's slowdown
    other = "LM (batch size 20)"
    for g in GPUS:
        assert t.isolated(other, g) == pytest.approx(math.exp(ensemble.rows.prior(g)), rel=1e-9)
        if t.pair(other, job, g)[0] > 0:
            assert t.pair(other, job, g)[0] == pytest.approx(
                math.exp(ensemble.rows.prior(g) + ensemble.rows.slow(job, g)), rel=1e-9)
    # the partner-mean row as a measured job's baseline: the ratio baseline through its
    # measurement, its pairs times the training jobs' slowdown next to the partner
    ratio = Ensemble(dict.fromkeys(CASES, 0.0), ensemble.rows,
                     baselines={"isolated_1obs": "partner_mean", "colocated_1obs": "partner_mean"})
    r = ThroughputPredictor(p1, _with(p2, ratio)).predict_table(jobs, GPUS, obs)
    assert r.isolated(job, "v100") == 3.0
    for g in GPUS:
        want = 3.0 * math.exp(ensemble.rows.prior(g) - ensemble.rows.prior("v100"))
        assert r.isolated(job, g) == pytest.approx(want, rel=1e-9)
        if r.pair(job, other, g)[0] > 0:
            assert r.pair(job, other, g)[0] == pytest.approx(want * math.exp(ensemble.rows.slow(other, g)), rel=1e-9)
        assert r.isolated(other, g) == pytest.approx(t.isolated(other, g), rel=1e-9)  # nothing measured: unchanged
    # measured only on a type no training job ran on (no per-type mean to shift by): the mean
    # unshifted, not P2 alone (the roofline row is still shifted through that measurement)
    rows_kv = BaselineRows(("k80", "v100"), ensemble.rows.type_mean[:1] + ensemble.rows.type_mean[2:3],
                           {p: (v[0], v[2]) for p, v in ensemble.rows.slowdown.items()},
                           ensemble.rows.slowdown_per_type[:1] + ensemble.rows.slowdown_per_type[2:3])
    on_a100 = observations_frame([{"job_type": job, "gpu_type": "a100", "throughput": 3.0}])
    half_pm = Ensemble(dict.fromkeys(CASES, 0.5), rows_kv, baselines={"isolated_1obs": "partner_mean"})
    p2_only = ThroughputPredictor(p1, _with(p2, None)).predict_table(jobs, GPUS, on_a100)
    m = ThroughputPredictor(p1, _with(p2, half_pm)).predict_table(jobs, GPUS, on_a100)
    for k, g in enumerate(("k80", "v100")):
        assert m.isolated(job, g) == pytest.approx(math.sqrt(p2_only.isolated(job, g) * math.exp(rows_kv.type_mean[k])),
                                                   rel=1e-6)
    # in between: the geometric mean of the two
    half = Ensemble(dict.fromkeys(CASES, 0.5), ensemble.rows)
    h = ThroughputPredictor(p1, _with(p2, half)).predict_table(jobs, GPUS, obs)
    for g in GPUS:
        assert h.isolated(other, g) == pytest.approx(math.sqrt(alone.isolated(other, g) * t.isolated(other, g)),
                                                     rel=1e-9)


def test_a_job_beyond_the_reach_is_predicted_by_the_baseline_alone(trained):
    """P2 where the job is like the training jobs, the per-type mean where it is farther from all
    of them than the reach; a reach over every job (or none stored) changes nothing."""
    data, layout, p1, p2, _, ensemble, _ = trained
    near, far = "ResNet-50 (batch size 32)", "A3C"
    domain = Domain.fit(np.stack([job_summary(data.jobs[n]) for n in JOBS if n not in (near, far)]))
    d_near, d_far = (domain.distance(job_summary(data.jobs[n])) for n in (near, far))
    assert 0 < d_near < d_far  # a ResNet-50 is nearer a ResNet-18 than A3C is to anything
    reach = (d_near + d_far) / 2
    jobs = {n: data.jobs[n] for n in (near, far)}
    gated = Ensemble(dict.fromkeys(CASES, 1.0), ensemble.rows, reaches=dict.fromkeys(CASES, reach), domain=domain)
    t = ThroughputPredictor(p1, _with(p2, gated)).predict_table(jobs, GPUS, observations_frame([]))
    alone = ThroughputPredictor(p1, _with(p2, None)).predict_table(jobs, GPUS, observations_frame([]))
    base = ThroughputPredictor(p1, _with(p2, Ensemble(dict.fromkeys(CASES, 0.0), ensemble.rows))).predict_table(
        jobs, GPUS, observations_frame([]))
    for g in GPUS:
        assert t.isolated(near, g) == alone.isolated(near, g)  # within reach: P2 (weight 1)
        assert t.isolated(far, g) == pytest.approx(base.isolated(far, g), rel=1e-12)  # beyond: the per-type mean
        assert t.isolated(far, g) == pytest.approx(math.exp(ensemble.rows.prior(g)), rel=1e-9)
    assert gated.weight(False, False, d_far) == 0.0 and gated.weight(False, False, d_near) == 1.0
    # stored and read back (JSON has no infinity: a reach over every job is null)
    wide = Ensemble(dict.fromkeys(CASES, 1.0), ensemble.rows, reaches=dict.fromkeys(CASES, math.inf), domain=domain)
    assert Ensemble.from_dict(gated.to_dict()) == gated and Ensemble.from_dict(wide.to_dict()) == wide
    assert set(wide.to_dict()["reaches"].values()) == {None}
    w = ThroughputPredictor(p1, _with(p2, wide)).predict_table(jobs, GPUS, observations_frame([]))
    assert w.frame.equals(alone.frame)
    old = {k: v for k, v in gated.to_dict().items() if k not in ("reaches", "domain")}  # stored before reaches
    assert Ensemble.from_dict(old).weight(False, False, 1e9) == 1.0
    with pytest.raises(ValueError, match="needs the training jobs' domain"):
        Ensemble(dict.fromkeys(CASES, 1.0), ensemble.rows, reaches={"isolated": 2.0})
    with pytest.raises(ValueError, match="distance > 0"):
        Ensemble(dict.fromkeys(CASES, 1.0), ensemble.rows, reaches={"isolated": 0.0}, domain=domain)


def _revealed(layout: Layout, truth: np.ndarray, job: str, gpu: str | None) -> tuple[np.ndarray, list[dict]]:
    """One job's truth row with only its isolated entry on ``gpu`` revealed (nothing for None), as
    the evaluation's observed row and as the product's logged observations."""
    obs_row = np.full(layout.size, np.nan)
    if gpu is None:
        return obs_row, []
    k = layout.isolated_index(gpu)
    obs_row[k] = truth[k]
    return obs_row, [{"job_type": job, "gpu_type": gpu, "throughput": math.exp(truth[k])}]


def test_the_product_predicts_what_the_evaluation_scores(trained):
    """The ensemble the evaluation reports is the one placements get: same P2, same rows, same
    weights -> the same isolated predictions for a job with one observation and with none."""
    data, layout, p1, p2, _, ensemble, _ = trained
    job = "Transformer (batch size 64)"
    weights = {"isolated": 0.25, "colocated": 0.5, "isolated_1obs": 0.5, "colocated_1obs": 0.75}
    chosen = Ensemble(weights, ensemble.rows)
    product = ThroughputPredictor(p1, _with(p2, chosen))
    methods = ev.build_methods(data, data, [job], layout, ev.p1_vectors(p1, layout, [job], dict(data.jobs)),
                               _with(p2, None), seed=0, ensemble=weights)
    truth = layout.truth(data, [job])[0]
    for revealed in (None, "k80"):
        obs_row, rows = _revealed(layout, truth, job, revealed)
        scored = methods["ensemble"](0, obs_row)
        table = product.predict_table({job: data.jobs[job]}, GPUS, observations_frame(rows))
        for g in GPUS:
            assert math.log(table.isolated(job, g)) == pytest.approx(scored[layout.isolated_index(g)], abs=1e-4)


@pytest.mark.parametrize("gated", ["nothing measured", "measured"])
def test_the_product_gates_by_reach_as_the_evaluation_does(trained, gated, monkeypatch):
    """A held-out job's family out of the training jobs: the same rows, domain, weights and reaches
    in the product and in the evaluation give the same predictions, isolated and co-located,
    gated and not."""
    data, layout, p1, p2, _, _, _ = trained
    job = "Transformer (batch size 64)"
    partner = "ResNet-18 (batch size 64)"
    train = data.without([data.family[job]])
    domain = Domain.fit(np.stack([job_summary(data.jobs[n]) for n in train.names]))
    d = domain.distance(job_summary(data.jobs[job]))
    weights = {"isolated": 0.75, "colocated": 0.75, "isolated_1obs": 0.5, "colocated_1obs": 0.5}
    short, wide = (d / 2, 2 * d) if gated == "nothing measured" else (2 * d, d / 2)
    reaches = {"isolated": short, "colocated": short, "isolated_1obs": wide, "colocated_1obs": wide}
    chosen = Ensemble(weights, BaselineRows.fit(layout, layout.truth(train, train.names)), reaches=reaches,
                      domain=domain)
    # the inner split's candidates at two reaches either side of this job
    monkeypatch.setattr(ev, "ENSEMBLE_SETTINGS", ((1.0, d / 2), (1.0, 2 * d)))
    p1_job = ev.p1_vectors(p1, layout, [job], dict(data.jobs))
    plain = ev.build_methods(data, train, [job], layout, p1_job, _with(p2, None), seed=0, ensemble=weights)
    product = ThroughputPredictor(p1, _with(p2, chosen))
    methods = ev.build_methods(data, train, [job], layout, p1_job, _with(p2, None), seed=0, ensemble=weights,
                               reaches=reaches)
    truth = layout.truth(data, [job])[0]
    for revealed in (None, "v100"):
        obs_row, rows = _revealed(layout, truth, job, revealed)
        scored = methods["ensemble"](0, obs_row)
        ungated = plain["ensemble"](0, obs_row)
        table = product.predict_table({job: data.jobs[job], partner: data.jobs[partner]}, GPUS,
                                      observations_frame(rows))
        beyond = (revealed is None) == (gated == "nothing measured")
        for g in GPUS:
            k, kp = layout.isolated_index(g), layout.pair_index(partner, g)
            assert math.log(table.isolated(job, g)) == pytest.approx(scored[k], abs=1e-4)
            if table.pair(job, partner, g)[0] > 0:
                assert math.log(table.pair(job, partner, g)[0]) == pytest.approx(scored[kp], abs=1e-4)
            if beyond:  # the gate changed something: the reach is not a no-op in either path
                assert not np.allclose(scored[[k, kp]], ungated[[k, kp]])
            if beyond and revealed is None:  # beyond the nothing-measured reach: the per-type mean
                assert math.log(table.isolated(job, g)) == pytest.approx(chosen.rows.prior(g), abs=1e-9)
                assert scored[kp] == pytest.approx(chosen.rows.prior(g) + chosen.rows.slow(partner, g), abs=1e-9)
        far_candidate = methods[ev.ensemble_candidate("isolated" if revealed is None else "isolated_1obs", 1.0, d / 2)]
        near_candidate = methods[ev.ensemble_candidate("isolated" if revealed is None else "isolated_1obs", 1.0, 2 * d)]
        p2_row = plain["p2"](0, obs_row)
        assert np.allclose(near_candidate(0, obs_row), p2_row, equal_nan=True)  # within reach, weight 1: P2
        assert not np.allclose(far_candidate(0, obs_row), p2_row, equal_nan=True)  # beyond: the baseline


def test_a_refiner_without_an_ensemble_predicts_as_before_and_a_broken_one_says_what_to_do(trained):
    _, _, p1, p2, *_ = trained
    assert ThroughputPredictor(p1, _with(p2, None)).ensemble is None
    bad = _with(p2, None)
    bad.trained_on["ensemble"] = {"weights": {"isolated": 0.5}, "rows": {}}
    with pytest.raises(ValueError, match="gogh predictors calibrate"):
        ThroughputPredictor(p1, bad)


def test_the_intervals_are_the_ensembles_own(trained):
    """Calibrated on the errors of the ensemble's choice, case by case: the intervals are of what
    the product predicts, chosen as it was, not of P2 alone."""
    data, layout, _, _, intervals, ensemble, oof = trained
    assert "of the ensemble" in intervals.calibration
    inner = ev.inner_family_errors(data, data, layout, oof, CFG, methods=ev.ENSEMBLE_CANDIDATES,
                                   protocols=CASES)
    assert set(intervals.quantile_levels) == set(CASES)
    for case in CASES:
        parts = ev.choice_aware_parts(inner, case)
        errs = np.concatenate(parts)
        errs = errs[np.isfinite(errs)]
        q, _ = adjusted_level(ev.ensemble_folds(inner, case), 0.9, ev.conformal_halfwidth)
        assert intervals.quantile_levels[case][LEVELS.index(0.9)] == q >= 0.9
        assert intervals.halfwidth(case, 0.9) == pytest.approx(min(ev.conformal_halfwidth(errs, q), errs.max()))


def test_a_gpu_type_no_training_job_ran_on_keeps_p2s_ratio_to_the_others(trained):
    data, _, p1, p2, _, ensemble, _ = trained
    job = "Transformer (batch size 64)"
    fleet = (*GPUS, "h100")  # the prior has no per-type mean for h100
    half = Ensemble({**dict.fromkeys(CASES, 1.0), "isolated": 0.5}, ensemble.rows)
    alone = ThroughputPredictor(p1, _with(p2, None)).predict_table({job: data.jobs[job]}, fleet)
    mixed = ThroughputPredictor(p1, _with(p2, half)).predict_table({job: data.jobs[job]}, fleet)
    assert mixed.isolated(job, "a100") != pytest.approx(alone.isolated(job, "a100"))  # the covered types moved

    def h100_over_the_rest(t):
        return math.log(t.isolated(job, "h100")) - np.mean([math.log(t.isolated(job, g)) for g in GPUS])
    assert h100_over_the_rest(mixed) == pytest.approx(h100_over_the_rest(alone), abs=1e-9)


def test_a_job_that_did_not_run_anywhere_is_planned_with_the_nothing_measured_margin(trained):
    """An observation of 0.0 ("did not run there") is no throughput: neither the ensemble nor the
    lower bounds may treat the job as measured."""
    data, _, p1, p2, intervals, ensemble, _ = trained
    job = "LM (batch size 20)"
    with_both = _with(p2, ensemble)
    with_both.trained_on["intervals"] = intervals.to_dict()
    predictor = ThroughputPredictor(p1, with_both)
    none = predictor.predict_table({job: data.jobs[job]}, GPUS, risk=0.9)
    zero = predictor.predict_table({job: data.jobs[job]}, GPUS, observations_frame(
        [{"job_type": job, "gpu_type": "k80", "throughput": 0.0}]), risk=0.9)
    assert zero.isolated(job, "k80") == 0.0
    for g in ("v100", "a100"):
        assert zero.isolated(job, g) == pytest.approx(none.isolated(job, g), rel=1e-12)


@pytest.mark.parametrize("breakage, says", [
    (lambda d: d.update(weights=[0.5, 0.5]), "calibrate"),
    (lambda d: d.pop("rows"), "lacks 'rows'"),
    (lambda d: d["rows"].update(type_mean=[math.nan] * len(d["rows"]["type_mean"])), "finite value"),
    (lambda d: d.clear(), "lacks 'weights'"),
    # a domain written for another version of P1's job summary (one feature fewer everywhere)
    (lambda d: d.update(domain={k: ([p[:-1] for p in v] if k == "points" else v[:-1])
                                for k, v in d["domain"].items()}), "one per feature of P1's job summary"),
    (lambda d: d["domain"].update(points=[]), "finite values"),
])
def test_a_damaged_stored_ensemble_stops_with_what_to_run(trained, breakage, says):
    import copy

    _, _, p1, p2, _, ensemble, _ = trained
    bad = _with(p2, None)
    stored = copy.deepcopy(ensemble.to_dict())
    breakage(stored)
    bad.trained_on["ensemble"] = stored
    with pytest.raises(ValueError, match=says) as info:
        ThroughputPredictor(p1, bad)
    assert "gogh predictors calibrate" in str(info.value)

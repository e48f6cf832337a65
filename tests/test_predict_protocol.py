"""The evaluation protocol of ``gogh predictors evaluate``: every measured entry scored, reveals in turn,
the baselines that need no training, and the data check that flags measurement artifacts."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import polars as pl
import pytest

from gogh_flows.predict import evaluate as ev
from gogh_flows.predict import intervals as iv
from gogh_flows.predict.baselines import PriorRow, shifted
from gogh_flows.predict.layout import Layout
from gogh_flows.truth.anomalies import find_anomalies, without_anomalies
from gogh_flows.truth.table import ThroughputTable

LAYOUT = Layout(("k80", "p100", "v100"), ("a", "b"))  # 3 isolated entries, then 2 partners x 3 types


def test_a_missing_prediction_on_a_measured_entry_counts_as_a_factor_ten():
    true = np.log(np.array([1.0, 2.0, np.nan, 4.0]))
    pred = np.log(np.array([1.0, np.nan, 5.0, 8.0]))  # entry 1: "does not fit"; entry 2 was never measured
    ale, ape, missed = ev._entry_errors(pred, true, np.ones(4, dtype=bool))
    assert ale.tolist() == pytest.approx([0.0, math.log(ev.MISS_FACTOR), math.log(2.0)])
    assert ape.tolist() == pytest.approx([0.0, 1.0, 1.0])
    assert missed.tolist() == [False, True, False]


def test_every_gpu_type_is_revealed_in_turn_and_the_scores_repeat_exactly():
    truth = np.log(np.array([[1.0, 3.0, 5.0, 0.5, 1.5, 2.5, 0.4, 1.2, 2.0],
                             [2.0, 5.0, 9.0, 1.0, 2.5, 4.5, 0.9, 2.0, 4.0]]))
    prior = PriorRow(np.log(np.full_like(truth, 2.0)))
    first = ev.score_all(prior.complete, truth, LAYOUT)
    again = ev.score_all(prior.complete, truth, LAYOUT)
    assert first.pooled == again.pooled and first.per_job == again.per_job
    assert set(first.by_revealed_type) == {"k80", "p100", "v100"}
    assert all(np.isfinite(v) for v in first.by_revealed_type.values())
    for stat in ev.STATS:
        assert ev.metric_name("colocated_1obs", stat) in first.pooled
    # a flat prior shifted to one observation: scored on the other two isolated entries of each job
    row = truth[0]
    expected = np.mean([abs((row[k] + np.log(2.0) - np.log(2.0)) - row[j]) for k in range(3) for j in range(3) if j != k])
    assert first.per_job[0]["isolated_male_1obs"] == pytest.approx(expected)


def test_the_ratio_baseline_is_the_observation_times_the_training_mean_ratio():
    known = np.log(np.array([[1.0, 2.0, 8.0, *[np.nan] * 6],
                             [4.0, 2.0, 8.0, *[np.nan] * 6]]))
    ratio = PriorRow.type_mean(known, n_jobs=1, n_gpus=3)
    obs = np.full(LAYOUT.size, np.nan)
    obs[0] = math.log(3.0)  # measured 3 steps/s on the k80
    got = np.exp(ratio.complete(0, obs)[:3])
    gm = lambda col: math.exp(np.mean(np.log(col)))  # noqa: E731
    assert got == pytest.approx([3.0, 3.0 * gm([2.0, 2.0]) / gm([1.0, 4.0]), 3.0 * gm([8.0, 8.0]) / gm([1.0, 4.0])])


def test_partner_mean_slows_the_isolated_estimate_by_the_training_slowdown():
    # training job: alone 10 on each type; next to partner a on k80 at 5 (x0.5), next to b nowhere measured
    known = np.log(np.array([[10.0, 10.0, 10.0, 5.0, np.nan, np.nan, np.nan, np.nan, np.nan]]))
    pm = PriorRow.partner_mean(known, n_jobs=1, n_gpus=3)
    got = np.exp(pm.rows[0])
    assert got[3] == pytest.approx(5.0)  # with a on the k80: the measured slowdown
    assert got[6] == pytest.approx(5.0)  # with b on the k80: the mean slowdown on that type
    observed = np.full(LAYOUT.size, np.nan)
    observed[0] = math.log(20.0)  # the new job runs 20 alone on the k80: twice the training job
    assert np.exp(shifted(pm.rows[0], observed))[3] == pytest.approx(10.0)


def _table(rows):
    return ThroughputTable.from_rows(rows, source="test")


def test_the_data_check_flags_an_inverted_job_and_an_impossible_pair():
    rows = []
    for j, (k80, v100) in {"A": (1.0, 4.0), "B": (2.0, 9.0), "C": (1.0, 5.0), "D": (3.0, 12.0),
                           "Odd": (2.0, 1.5)}.items():
        rows += [{"job_type": j, "gpu_type": "k80", "scale_factor": 1, "throughput": k80},
                 {"job_type": j, "gpu_type": "v100", "scale_factor": 1, "throughput": v100}]
    rows += [{"job_type": "A", "gpu_type": "v100", "scale_factor": 1, "partner": "B", "throughput": 0.04,
              "partner_throughput": 5.0},
             {"job_type": "C", "gpu_type": "k80", "scale_factor": 1, "partner": "D", "throughput": 0.6,
              "partner_throughput": 2.0}]
    table = _table(rows)
    found = find_anomalies(table)
    assert {(a.kind, a.job_type, a.gpu_type, a.partner) for a in found} == {
        ("cross-type ratio", "Odd", "v100", None), ("pair rate", "A", "v100", "B")}
    assert all(a.detail for a in found)
    clean = without_anomalies(table, found)
    assert not clean.has("Odd", "v100") and clean.has("Odd", "k80")
    assert clean.frame.filter(clean.frame["partner"] == "B").height == 0  # the flagged pair, both sides
    assert find_anomalies(clean) == []


def test_conformal_halfwidth_is_the_finite_sample_quantile_and_coverage_counts_misses():
    errs = np.arange(1, 10, dtype=float)  # 9 calibration errors: 1..9
    assert ev.conformal_halfwidth(errs, 0.8) == 8.0  # ceil(10 * 0.8) = 8th smallest
    assert ev.conformal_halfwidth(errs, 0.9) == 9.0
    assert ev.conformal_halfwidth(errs[:3], 0.9) == math.inf  # too few to promise 90%
    assert math.isnan(ev.conformal_halfwidth(np.empty(0), 0.9))
    assert ev.coverage(np.array([0.5, 1.5, np.inf, 0.9]), 1.0) == 0.5  # a miss is never inside


def test_intervals_are_calibrated_on_the_inner_split_only(monkeypatch):
    """The held-out family's own errors never set its interval: the calibration sees only the
    training families, each predicted by methods fitted without it."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)",
            "Transformer (batch size 64)")
    data = MeasuredSet.from_table(synthetic_table(("k80", "v100"))).subset(jobs)
    seen: list[tuple[str, ...]] = []
    real = ev.build_methods

    def spy(full, train, test, *args, **kw):
        seen.append(tuple(test))
        assert not set(test) & set(train.names)
        return real(full, train, test, *args, **kw)

    monkeypatch.setattr(ev, "build_methods", spy)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64), p2=P2Config(hidden=8, epochs=3))
    result = ev.evaluate_holdout(data, "ResNet-18", cfg)
    # each inner family first (the ensemble's weights and the intervals come from them), then the outer test
    assert seen[-1] == ("ResNet-18 (batch size 64)",)
    assert all("ResNet-18 (batch size 64)" not in names for names in seen[:-1]) and len(seen) == 4 + 1
    assert set(result.ensemble_weights) == set(ev.ENSEMBLE_CASES)
    assert set(result.ensemble_weights.values()) <= set(ev.ENSEMBLE_WEIGHTS)
    for level in ev.LEVELS:
        cover = result.metrics["type_mean"][ev.interval_name("isolated_1obs", "cover", level)]
        assert 0.0 <= cover <= 1.0
        n_in, n = result.covered["type_mean"][ev.interval_name("isolated_1obs", "cover", level)]
        assert n > 0 and n_in == round(cover * n)


def test_ensemble_blends_in_log_space_keeps_p2s_misses_and_is_chosen_per_family_mean():
    import numpy as np

    p2 = np.array([np.log(10.0), -np.inf, np.log(4.0), np.log(2.0)])  # 2 GPU types: 2 isolated, 2 pair entries
    roof = np.array([np.log(40.0), np.log(5.0), np.log(1.0), np.log(8.0)])
    out = ev.blend(p2, roof, 0.5, 1.0, 2)
    assert np.exp(out[0]) == pytest.approx(20.0)  # geometric mean of 10 and 40
    assert out[1] == -np.inf  # P2's "does not fit" stands
    assert np.exp(out[2:]) == pytest.approx([4.0, 2.0])  # co-located: P2 alone
    # one family with many entries must not outvote another: per-family means, then their mean
    errs = {f"ensemble@{w:g}": {"isolated_1obs": [np.full(100, 0.1 + 0.1 * w), np.full(2, 1.0 - w)],
                                "colocated_1obs": [np.full(3, 0.5)]} for w in ev.ENSEMBLE_WEIGHTS}
    # with nothing observed the candidates are P2 against the partner-mean row
    errs.update({f"prior@{w:g}": {"isolated": [np.full(4, 0.2 + abs(w - 0.25))], "colocated": [np.full(4, 0.3 + w)]}
                 for w in ev.ENSEMBLE_WEIGHTS})
    chosen, reaches, errors, baselines = ev.choose_ensemble(errs)  # settings without a candidate here are not candidates
    assert set(reaches.values()) == {math.inf}
    # no prior@ candidate with an observation here: the roofline ratio, as before there were two
    assert baselines == {"isolated": "partner_mean", "colocated": "partner_mean", "isolated_1obs": "roofline",
                         "colocated_1obs": "roofline"}
    assert chosen["isolated_1obs"] == 1.0  # per family: 0.2 + 0 at w=1 beats 0.1 + 1.0 at w=0 (pooled would pick 0)
    assert chosen["colocated_1obs"] == 1.0  # a tie goes to more P2
    assert chosen["isolated"] == 0.25 and chosen["colocated"] == 0.0  # chosen on the prior@ candidates
    assert errors["colocated"]["0.5"] == pytest.approx(0.8)


def _held_out_resnet18(monkeypatch, data, fake_oof):
    """ResNet-18 held out with every encoder and the mean as candidates, tiny networks, the
    out-of-family P1 vectors ``fake_oof``'s: (result, the vectors P2 was trained on, the config)."""
    from gogh_flows.predict.p1 import KINDS, P1Config
    from gogh_flows.predict.p2 import P2Config

    got_oof: list[np.ndarray] = []
    real_p2 = ev.train_p2

    def spy_p2(layout, oof, truth, config):
        got_oof.append(oof)
        return real_p2(layout, oof, truth, config)

    monkeypatch.setattr(ev, "out_of_family_p1", fake_oof)
    monkeypatch.setattr(ev, "train_p2", spy_p2)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64), p2=P2Config(hidden=8, epochs=3),
                        encoders=KINDS)
    return ev.evaluate_holdout(data, "ResNet-18", cfg, intervals=False), got_oof, cfg


def test_p1s_encoder_is_chosen_on_the_inner_split_and_p2_learns_from_the_chosen_one(monkeypatch):
    """A fixed default encoder was chosen by the reported figures; with candidates, each held-out
    family gets the encoder whose out-of-family P1 is best on the *training* families, and P2 is
    trained on that encoder's vectors (the errors of the P1 it will correct)."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)")
    data = MeasuredSet.from_table(synthetic_table(("k80", "v100"))).subset(jobs)
    offset = {"gru": 0.1, "ff": 0.3, "transformer": 0.5}
    trained: list[tuple[str, tuple[str, ...]]] = []
    real_train = ev.train_p1

    def fake_oof(train, layout, features, config, log=None, done=None):
        assert "ResNet-18 (batch size 64)" not in train.names  # only training families are predicted
        return layout.truth(train, train.names) + offset[config.encoder]

    def spy_train(train, config=P1Config(), **kw):
        trained.append((config.encoder, train.names))
        return real_train(train, config, **kw)

    monkeypatch.setattr(ev, "train_p1", spy_train)
    result, got_oof, _ = _held_out_resnet18(monkeypatch, data, fake_oof)
    # one encoder off by 0.1 everywhere beats the mean of the three (0.3), even scored nested
    assert result.encoder == "gru"
    assert result.encoder_errors == pytest.approx({**offset, "mean": 0.3, ev.CHOSEN_ONE: 0.1})
    # the held-out family's P1 uses the chosen encoder and never sees the family
    assert trained == [("gru", tuple(n for n in data.names if not n.startswith("ResNet-18")))]
    train = data.without(["ResNet-18"])
    layout = Layout(data.gpus, data.names)
    assert np.allclose(got_oof[0], layout.truth(train, train.names) + 0.1, equal_nan=True)
    # a single encoder is no choice: nothing to compare, the configured one is used
    single = ev.choose_encoder(train, layout, dict(data.jobs), ev.EvalConfig(p1=P1Config(encoder="ff")))
    assert single[0] == "ff" and math.isnan(single[2]["ff"])
    with pytest.raises(ValueError, match="among"):
        ev.EvalConfig(encoders=("lstm",))


def test_p1_is_the_mean_of_the_encoders_when_choosing_one_does_worse_on_the_inner_split(monkeypatch):
    """Each encoder is right on some training families and off on others, differently: the one
    the inner split would pick is a guess (its nested error says so), and the mean of the three
    is right everywhere. The mean wins, its vectors are the members' mean, and the held-out
    family's P1 is a mean P1 (a trained P1MeanNet)."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1MeanNet
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)")
    data = MeasuredSet.from_table(synthetic_table(("k80", "v100"))).subset(jobs)
    signed = {"gru": {"A3C": 0.3, "LM": -0.3, "ResNet-50": 0.0},
              "ff": {"A3C": -0.3, "LM": 0.0, "ResNet-50": 0.3},
              "transformer": {"A3C": 0.0, "LM": 0.3, "ResNet-50": -0.3}}

    def fake_oof(train, layout, features, config, log=None, done=None):
        shift = np.array([signed[config.encoder][train.family[n]] for n in train.names])[:, None]
        return layout.truth(train, train.names) + shift

    result, got_oof, cfg = _held_out_resnet18(monkeypatch, data, fake_oof)
    assert result.encoder == "mean"
    assert result.encoder_errors["mean"] == pytest.approx(0.0, abs=1e-12)
    assert result.encoder_errors[ev.CHOSEN_ONE] > result.encoder_errors["gru"] > 0.0
    train = data.without(["ResNet-18"])
    layout = Layout(data.gpus, data.names)
    assert np.allclose(got_oof[0], layout.truth(train, train.names), equal_nan=True)
    assert isinstance(result.p1.net, P1MeanNet)
    # without the mean among the candidates, one encoder is chosen as before
    alone = ev.choose_encoder(train, layout, dict(data.jobs), dataclasses.replace(cfg, encoders=("gru", "ff", "transformer")))
    assert alone[0] in ("gru", "ff", "transformer") and "mean" not in alone[2]


def test_the_inner_p1_error_weighs_families_equally_and_counts_misses():
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.truth.synthetic import synthetic_table

    data = MeasuredSet.from_table(synthetic_table(("k80", "v100"))).subset(
        ("A3C", "ResNet-18 (batch size 64)", "ResNet-18 (batch size 128)"))
    layout = Layout(data.gpus, data.names)
    truth = layout.truth(data, data.names)
    pred = truth.copy()
    row = {n: i for i, n in enumerate(data.names)}
    pred[row["A3C"]] += 0.6  # one family off by 0.6 everywhere, the other (two jobs) exact
    assert ev.p1_inner_error(pred, truth, layout, data) == pytest.approx(0.3)
    miss = truth.copy()
    miss[row["A3C"], 0] = -np.inf  # "does not fit" on a measured entry: a factor 10
    got = ev.p1_inner_error(miss, truth, layout, data)
    iso = np.isfinite(truth[row["A3C"], :2]).sum()
    assert got == pytest.approx(math.log(10) / iso / 2 / 2)


def test_the_siblings_decay_is_chosen_on_inner_families_that_have_siblings():
    errs = {f"siblings@{d:g}": {"siblings": [np.array([0.3 + 0.01 * d]), np.array([0.5 - 0.05 * d])]}
            for d in ev.SIBLING_DECAYS}
    errs["siblings@2"]["siblings"][1] = np.array([0.05])  # d=2: (0.32 + 0.05) / 2, the least
    decay, table = ev.choose_decay(errs)
    # the mean over families of each family's figure
    assert decay == 2.0 and table["2"] == pytest.approx(0.185) and table["4"] == pytest.approx(0.32)
    flat = {f"siblings@{d:g}": {"siblings": [np.array([0.2])]} for d in ev.SIBLING_DECAYS}
    assert ev.choose_decay(flat)[0] == ev.DECAY  # a tie keeps the product's decay
    assert ev.choose_decay({})[0] == ev.DECAY and all(math.isnan(v) for v in ev.choose_decay({})[1].values())


def test_a_held_out_family_with_siblings_gets_a_decay_from_the_training_families():
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-18 (batch size 128)",
            "ResNet-50 (batch size 32)", "ResNet-50 (batch size 64)")
    data = MeasuredSet.from_table(synthetic_table(("k80", "v100", "a100"))).subset(jobs)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64), p2=P2Config(hidden=8, epochs=3),
                        repeats=1)
    result = ev.evaluate_holdout(data, "ResNet-18", cfg, intervals=False)
    assert result.siblings_decay in ev.SIBLING_DECAYS
    # only ResNet-50 has siblings among the training families: every decay was scored there
    assert set(result.siblings_errors) == {f"{d:g}" for d in ev.SIBLING_DECAYS}
    assert all(math.isfinite(v) for v in result.siblings_errors.values())
    assert result.siblings_errors[f"{result.siblings_decay:g}"] == min(result.siblings_errors.values())
    assert math.isfinite(result.metrics["p2"]["isolated_mape_1obs_siblings"])


def test_p2s_epochs_are_chosen_on_the_inner_split(monkeypatch):
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-50 (batch size 32)")
    data = MeasuredSet.from_table(synthetic_table(("k80", "v100"))).subset(jobs)
    epochs_seen: list[tuple[int, tuple[int, ...]]] = []
    real = ev.train_p2

    def spy(layout, oof, truth, config):
        epochs_seen.append((config.epochs, len(oof)))
        return real(layout, oof, truth, config)

    monkeypatch.setattr(ev, "train_p2", spy)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64), p2=P2Config(hidden=8, epochs=2),
                        p2_epochs=(1, 2, 4))
    result = ev.evaluate_holdout(data, "ResNet-18", cfg, intervals=False)
    assert result.p2_epochs in (1, 2, 4) and set(result.p2_epoch_errors) == {"1", "2", "4"}
    assert result.p2_epoch_errors[str(result.p2_epochs)] == min(result.p2_epoch_errors.values())
    # every candidate trained once per inner family (3 training families, each on the other two),
    # then the reported P2 (on all three) at the chosen epochs; the inner pass for the ensemble
    # reuses the chosen epochs' inner P2s instead of training them again
    inner = [e for e, n in epochs_seen[:9]]
    assert sorted(inner) == [1, 1, 1, 2, 2, 2, 4, 4, 4] and all(n == 2 for _, n in epochs_seen[:9])
    assert epochs_seen[9] == (result.p2_epochs, 3)
    assert all(e == result.p2_epochs for e, _ in epochs_seen[9:])
    assert len(epochs_seen) == 10
    assert ev.choose_p2_epochs(data, data, None, None, ev.EvalConfig(p2=P2Config(epochs=7))) == (7, {}, {})
    with pytest.raises(ValueError, match=">= 1"):
        ev.EvalConfig(p2_epochs=(0,))


def test_the_inner_split_chooses_a_reach_with_the_weight_and_ties_go_to_the_wider_one():
    """A reach is chosen when it is better on the inner families; where reaches tie (no inner
    job lies between them), the wider one, the one that changes less, wins."""
    inf = math.inf
    errs = {}
    for w, r in ev.ENSEMBLE_SETTINGS:
        # nothing observed: P2 alone within reach 4 is best; reaches 4 and 5 gate the same jobs here
        iso = 0.2 if (w, r) in ((1.0, 4.0), (1.0, 5.0)) else 0.5
        # co-located: equal at every reach for w = 0.5, better than every other weight
        co = 0.3 if w == 0.5 else 0.6
        errs[f"prior@{ev.setting_name(w, r)}"] = {"isolated": [np.full(3, iso)], "colocated": [np.full(3, co)]}
        errs[f"ensemble@{ev.setting_name(w, r)}"] = {"isolated_1obs": [np.full(3, 0.4)],
                                                    "colocated_1obs": [np.full(3, 0.4)]}
    weights, reaches, errors, baselines = ev.choose_ensemble(errs)
    assert (weights["isolated"], reaches["isolated"]) == (1.0, 5.0)  # tie between 4 and 5: the wider
    assert (weights["colocated"], reaches["colocated"]) == (0.5, inf)  # equal at every reach: none
    assert (weights["isolated_1obs"], reaches["isolated_1obs"]) == (1.0, inf)  # all equal: P2, every job
    assert errors["isolated"]["1<4"] == pytest.approx(0.2) and errors["isolated"]["1"] == pytest.approx(0.5)
    assert len(errors["isolated"]) == len(ev.ENSEMBLE_SETTINGS)
    # with an observation the partner-mean row competes too: better for co-located entries, equal
    # (so the roofline ratio, the case's first) for isolated ones
    for w, r in ev.ENSEMBLE_SETTINGS:
        errs[f"prior@{ev.setting_name(w, r)}"].update({"isolated_1obs": [np.full(3, 0.4)],
                                                      "colocated_1obs": [np.full(3, 0.35 if w == 0.25 else 0.45)]})
    weights, reaches, errors, baselines = ev.choose_ensemble(errs)
    assert baselines["colocated_1obs"] == "partner_mean" and weights["colocated_1obs"] == 0.25
    assert baselines["isolated_1obs"] == "roofline" and weights["isolated_1obs"] == 1.0
    assert errors["colocated_1obs"]["partner_mean@0.25"] == pytest.approx(0.35)
    assert errors["colocated_1obs"]["roofline@0.25"] == pytest.approx(0.4)


def test_intervals_calibrate_on_the_choice_made_without_each_inner_family():
    """The setting that wins on every inner family is flattered by them; each family's calibration
    errors are those of the setting chosen on the others, as the held-out family's will be."""
    by_family = {"prior@1": {"isolated": [np.full(2, 0.1), np.full(2, 0.1), np.full(2, 1.0)]},
                 "prior@0.5": {"isolated": [np.full(2, 0.5), np.full(2, 0.5), np.full(2, 0.3)]}}
    (b, w, r), _ = ev._choose_case(by_family, "isolated")
    assert (b, w, r) == ("partner_mean", 1.0, math.inf)  # 0.4 against 0.433 on all three
    # without family 0 (or 1) weight 0.5 wins (0.4 against 0.55); without family 2, weight 1
    assert ev.choice_aware_errors(by_family, "isolated") == pytest.approx([0.5, 0.5, 0.5, 0.5, 1.0, 1.0])
    one = {k: {"isolated": v["isolated"][:1]} for k, v in by_family.items()}
    assert ev.choice_aware_errors(one, "isolated") == pytest.approx([0.1, 0.1])  # nothing to leave out of


def test_the_quantile_is_raised_until_each_calibration_family_is_covered_by_the_others():
    """Families alike: the level itself covers as promised and is kept. One family of many
    well-predicted entries and three small ones predicted badly: each small family, calibrated
    by the others, is missed at the 90% quantile; the quantile is raised until the families
    left out in turn are 90% covered, and to the largest error when no quantile up to 0.99 does."""
    rng = np.random.default_rng(0)
    alike = [rng.uniform(0, 1, 40) for _ in range(6)]
    q, cover = iv.adjusted_level(iv.leave_one_out_folds(alike), 0.8, ev.conformal_halfwidth)
    assert 0.8 <= q <= 0.82 and cover >= 0.8  # at most a step or two of sampling noise
    skewed = [np.linspace(0.1, 0.3, 40), *(np.linspace(1, 2, 10) + 0.05 * k for k in range(3))]
    folds = iv.leave_one_out_folds(skewed)
    assert iv.nested_coverage(folds, 0.8, ev.conformal_halfwidth) < 0.8
    q, cover = iv.adjusted_level(folds, 0.8, ev.conformal_halfwidth)
    assert 0.8 < q < 1.0 and cover >= 0.8
    assert iv.nested_coverage(folds, round(q - 0.01, 4), ev.conformal_halfwidth) < 0.8  # the smallest that does
    far = [np.full(10, 0.1), np.array([5.0]), np.array([6.0])]  # 6.0 lies beyond every other family's errors
    q, cover = iv.adjusted_level(iv.leave_one_out_folds(far), 0.95, ev.conformal_halfwidth)
    assert q == 1.0 and cover == pytest.approx(11 / 12)
    assert iv.adjusted_level([], 0.9, ev.conformal_halfwidth)[0] == 0.9  # nothing to judge by: the level


def test_the_ensembles_level_is_judged_on_families_kept_out_of_the_choice_that_calibrates_them():
    """In the fold that judges family k, every other family's errors are those of the setting
    chosen without it *and* without k: k takes no part in what calibrates it."""
    by_family = {"prior@1": {"isolated": [np.full(2, 0.1), np.full(2, 0.1), np.full(2, 1.0)]},
                 "prior@0.5": {"isolated": [np.full(2, 0.5), np.full(2, 0.5), np.full(2, 0.3)]}}
    folds = ev.ensemble_folds(by_family, "isolated")
    assert [own.tolist() for _, own in folds] == [[0.5, 0.5], [0.5, 0.5], [1.0, 1.0]]
    # judging family 2: families 0 and 1 are each what the choice on the other alone makes (weight 1: 0.1)
    others, _ = folds[2]
    assert [o.tolist() for o in others] == [[0.1, 0.1], [0.1, 0.1], []]
    # judging family 0: family 1 under the choice on family 2 alone (0.5), family 2 under family 1's (1.0)
    assert [o.tolist() for o in folds[0][0]] == [[], [0.5, 0.5], [1.0, 1.0]]


def test_stored_intervals_keep_their_quantile_levels():
    """Twenty good entries and two small families far off: calibrated by the others, the small
    families are missed at the 90% quantile and at every one up to 0.99, so the 90% half-width
    is the largest error. The miss (inf) counts as an error, as in the nested coverage and the
    evaluation (it lifts the 90% quantile from 1.2 to 1.4 here), and a width that lands on it is
    the largest finite error: what is stored is what is evaluated."""
    parts = {c: [np.linspace(0.1, 0.3, 20), np.array([1.0, math.inf]), np.array([1.2, 1.4])] for c in iv.CASES}
    finite = np.r_[np.linspace(0.1, 0.3, 20), 1.0, 1.2, 1.4]
    assert ev.conformal_halfwidth(finite, 0.9) == 1.2  # what dropping the miss would store
    plain = iv.from_errors(parts, "test", ev.conformal_halfwidth)
    assert plain.quantile_levels == {}
    assert plain.halfwidth("isolated", 0.9) == 1.4
    pooled = np.concatenate(parts["isolated"])  # as evaluate_holdout pools the calibration errors
    assert plain.halfwidths["isolated"] == tuple(iv.capped_halfwidth(pooled, lv, ev.conformal_halfwidth)
                                                 for lv in iv.LEVELS)
    folds = {c: iv.leave_one_out_folds(v) for c, v in parts.items()}
    stored = iv.from_errors(parts, "test", ev.conformal_halfwidth, folds)
    assert stored.quantile_levels["isolated"][iv.LEVELS.index(0.9)] == 1.0
    assert all(q >= lv for q, lv in zip(stored.quantile_levels["isolated"], iv.LEVELS))
    assert stored.halfwidth("isolated", 0.9) == 1.4
    assert stored.halfwidths["isolated"] == tuple(iv.capped_halfwidth(pooled, q, ev.conformal_halfwidth)
                                                  for q in stored.quantile_levels["isolated"])
    with pytest.raises(ValueError, match="no calibration errors"):
        iv.from_errors({c: [np.array([math.inf, math.nan])] for c in iv.CASES}, "test", ev.conformal_halfwidth)
    assert iv.Intervals.from_dict(stored.to_dict()) == stored
    assert iv.Intervals.from_dict({k: v for k, v in stored.to_dict().items() if k != "quantile_levels"}
                                  ).quantile_levels == {}
    with pytest.raises(ValueError, match="quantile levels"):
        iv.Intervals(stored.levels, stored.halfwidths, "", {"isolated": (0.9,)})


def test_a_miss_counts_log_ten_when_the_ensemble_weight_is_chosen():
    """One "does not fit" of P2 on an inner family is kept at every weight; left infinite it made
    every candidate infinite and the tie chose P2 alone whatever the other entries said."""
    miss = math.inf
    errs = {f"ensemble@{w:g}": {"isolated_1obs": [np.array([0.2 + abs(w - 0.5), miss]), np.array([0.3 + abs(w - 0.5)])],
                                "colocated_1obs": [np.array([0.4, miss])]} for w in ev.ENSEMBLE_WEIGHTS}
    errs.update({f"prior@{w:g}": {"isolated": [np.array([miss])], "colocated": [np.array([])]}
                 for w in ev.ENSEMBLE_WEIGHTS})
    chosen, _, _, _ = ev.choose_ensemble(errs)
    assert chosen["isolated_1obs"] == 0.5  # the finite entries decide; the miss weighs the same at every weight
    assert chosen["colocated_1obs"] == 1.0  # equal everywhere: the tie goes to P2
    assert chosen["isolated"] == chosen["colocated"] == 1.0  # nothing to tell them apart: P2


def test_the_held_out_familys_measurements_never_move_a_choice():
    """Every choice (encoder, P2 epochs, ensemble weights, decay, intervals) stays the same when the
    held-out family's measurements are replaced by others: they are made on the training families."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.p1 import P1Config
    from gogh_flows.predict.p2 import P2Config
    from gogh_flows.truth.synthetic import synthetic_table

    jobs = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "ResNet-18 (batch size 128)",
            "ResNet-50 (batch size 32)", "ResNet-50 (batch size 64)")
    table = synthetic_table(("k80", "v100"))
    data = MeasuredSet.from_table(table).subset(jobs)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64), p2=P2Config(hidden=8, epochs=2),
                        repeats=1, encoders=("ff", "transformer"), p2_epochs=(1, 2))
    rng = np.random.default_rng(0)
    held = [n for n in data.names if n.startswith("ResNet-18")]
    iso = data.iso.with_columns(
        pl.when(pl.col("job").is_in(held)).then(pl.col("throughput") * float(rng.uniform(0.1, 10)))
        .otherwise(pl.col("throughput")).alias("throughput"))
    pairs = data.pairs.with_columns(
        pl.when(pl.col("job").is_in(held) | pl.col("partner").is_in(held)).then(pl.col("throughput") * 0.3)
        .otherwise(pl.col("throughput")).alias("throughput"))
    moved = dataclasses.replace(data, iso=iso, pairs=pairs)
    a = ev.evaluate_holdout(data, "ResNet-18", cfg)
    b = ev.evaluate_holdout(moved, "ResNet-18", cfg)
    assert (a.encoder, a.p2_epochs, a.ensemble_weights, a.ensemble_baselines, a.siblings_decay) == \
        (b.encoder, b.p2_epochs, b.ensemble_weights, b.ensemble_baselines, b.siblings_decay)
    assert a.encoder_errors == b.encoder_errors and a.p2_epoch_errors == b.p2_epoch_errors
    half = [k for k in a.metrics["p2"] if "halfwidth" in k]
    assert half and all(a.metrics[m][k] == b.metrics[m][k] for m in ("p2", "ensemble") for k in half)
    assert a.interval_quantiles == b.interval_quantiles
    assert set(a.interval_quantiles["ensemble"]) == set(ev.INTERVAL_PROTOCOLS)
    assert a.metrics["p2"]["isolated_male"] != b.metrics["p2"]["isolated_male"]  # the scores did move

"""P1, P2, baselines and the leave-one-family-out protocol on a tiny synthetic fleet."""

from __future__ import annotations

import numpy as np
import pytest

from gogh_flows.predict import evaluate as ev
from gogh_flows.predict.baselines import MatrixCompletion, NearestJob
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.encoding import fits
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, P1Model, train_p1
from gogh_flows.predict.p2 import P2Config, _sample_masks, train_p2
from gogh_flows.catalog import get_gpu_type
from gogh_flows.truth.synthetic import synthetic_table

GPUS = ("k80", "v100", "a100")
JOBS = (
    "A3C", "LM (batch size 20)", "Recommendation (batch size 1024)", "ResNet-18 (batch size 64)",
    "ResNet-50 (batch size 128)", "ResNet-50 (batch size 32)", "Transformer (batch size 64)",
)
TINY_P1 = P1Config(hidden=8, epochs=25, pair_rows_per_epoch=256)
TINY_P2 = P2Config(hidden=8, epochs=25)


@pytest.fixture(scope="module")
def data() -> MeasuredSet:
    return MeasuredSet.from_table(synthetic_table(GPUS)).subset(JOBS)


@pytest.fixture(scope="module")
def p1(data) -> P1Model:
    return train_p1(data, TINY_P1)


def test_p1_predicts_every_job_type_and_partner_with_zero_where_memory_does_not_fit(data, p1):
    pred = p1.predict(data.jobs, GPUS, partners=data.jobs)
    assert pred.isolated.shape == (len(JOBS), len(GPUS))
    assert pred.pair.shape == (len(JOBS), len(JOBS), len(GPUS))
    expect_fit = np.array([[fits(data.jobs[n], get_gpu_type(g)) for g in GPUS] for n in JOBS])
    assert not expect_fit.all(), "the fixture should hold a job too big for a K80"
    assert np.all((pred.isolated > 0) == expect_fit)
    assert np.all(pred.pair[~np.broadcast_to(expect_fit[:, None, :], pred.pair.shape)] == 0)
    ok = pred.pair > 0
    # a partner never speeds a job up (the pair head's ratio is <= 1 by construction)
    assert np.all(pred.pair[ok] <= np.broadcast_to(pred.isolated[:, None, :], pred.pair.shape)[ok] * (1 + 1e-6))


def test_p1_training_reduces_the_loss(p1):
    assert p1.trained_on["final_loss"] < p1.trained_on["first_loss"]
    assert p1.trained_on["jobs"] == len(JOBS)


def test_p1_fine_tuning_leaves_the_initial_model_unchanged(data, p1):
    before = {k: v.clone() for k, v in p1.net.state_dict().items()}
    tuned = train_p1(data, P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64, lr=0.05), init=p1)
    assert all(np.array_equal(before[k], v) for k, v in p1.net.state_dict().items())
    assert any(not np.array_equal(before[k], v) for k, v in tuned.net.state_dict().items())
    with pytest.raises(ValueError, match="architecture"):
        train_p1(data, P1Config(hidden=16, epochs=1), init=p1)


def test_p1_config_rejects_unknown_encoder():
    with pytest.raises(ValueError, match="encoder"):
        P1Config(encoder="lstm")


@pytest.mark.parametrize("encoder", ["gru", "ff"])  # the default (transformer) is trained above
def test_other_encoders_train_and_predict(data, encoder):
    model = train_p1(data, P1Config(encoder=encoder, hidden=8, epochs=5, pair_rows_per_epoch=64))
    pred = model.predict(data.jobs, GPUS)
    assert pred.isolated.shape == (len(JOBS), len(GPUS))
    assert np.isfinite(pred.isolated).all()


def test_without_removes_a_family_as_job_and_as_partner(data):
    train = data.without(["ResNet-50"])
    assert not any(n.startswith("ResNet-50") for n in train.names)
    assert not any(p.startswith("ResNet-50") for p in train.pairs["partner"].to_list())
    ev.guard_no_leak(train, "ResNet-50")
    with pytest.raises(AssertionError, match="leaked"):
        ev.guard_no_leak(data, "ResNet-50")
    with pytest.raises(ValueError, match="unknown model family 'VGG'"):
        data.without(["VGG"])
    assert data.without(["resnet-50 "]).names == train.names  # spelled as a user might: as job names are


def test_p2_keeps_observations_and_rejects_wrong_lengths(data, p1):
    layout = Layout(GPUS, data.names)
    p1_log = ev.p1_vectors(p1, layout, data.names, data.jobs)
    truth = layout.truth(data, data.names)
    p2 = train_p2(layout, p1_log, truth, TINY_P2)
    assert p2.trained_on["final_loss"] < p2.trained_on["first_loss"]
    obs = np.full(layout.size, np.nan)
    obs[layout.isolated_index("v100")] = truth[0, layout.isolated_index("v100")]
    out = p2.refine(p1_log[0], obs)
    assert out.shape == (1, layout.size)
    assert out[0, layout.isolated_index("v100")] == pytest.approx(obs[layout.isolated_index("v100")])
    with pytest.raises(ValueError, match="vectors of length"):
        p2.refine(p1_log[0, :-1], obs[:-1])


def test_p2_trust_scale_corrects_a_job_in_proportion_to_how_wrong_p1_was_on_it(data, p1):
    """A job measured where P1 was right keeps P1's shape; one P1 misjudged by the scale or more
    gets the full correction; in between, the share of it that its observed error warrants."""
    from dataclasses import replace

    layout = Layout(GPUS, data.names)
    p1_log = ev.p1_vectors(p1, layout, data.names, data.jobs)
    p2 = train_p2(layout, p1_log, layout.truth(data, data.names), TINY_P2)
    k = layout.isolated_index("v100")
    hidden = np.isfinite(p1_log[0]) & (np.arange(layout.size) != k)
    for residual, share in ((0.0, 0.0), (0.1, 0.5), (0.2, 1.0), (0.6, 1.0)):
        obs = np.full(layout.size, np.nan)
        obs[k] = p1_log[0, k] + residual
        full = p2.refine(p1_log[0], obs)[0]
        scaled = replace(p2, trust_scale=0.2).refine(p1_log[0], obs)[0]
        want = p1_log[0] + share * (full - p1_log[0])
        assert scaled[k] == obs[k]
        np.testing.assert_allclose(scaled[hidden], want[hidden], rtol=1e-6)  # float32 net
    assert np.abs(full[hidden] - p1_log[0][hidden]).max() > 0, "the check needs a refiner that corrects"
    with pytest.raises(ValueError, match="trust_scale"):
        replace(p2, trust_scale=0.0)
    with pytest.raises(ValueError, match="trust_scale"):  # too large for a float: refused, not an OverflowError
        replace(p2, trust_scale=10**400)


def test_choosing_the_trust_scale_keeps_p1_where_p1_is_already_right(data, p1):
    """Validation measurements that P1 predicts exactly: every scale leaves P1's shape alone for
    them, the tie goes to the scale nearest P1, and a refiner applied in full does no better."""
    import polars as pl

    from gogh_flows.predict.p2 import TRUST_SCALES
    from gogh_flows.predict.service import choose_trust_scale, fit_refiner

    pred = p1.predict(data.jobs, GPUS)
    rows = [{"job_type": j, "gpu_type": g, "partner": None, "throughput": float(pred.isolated[i, c])}
            for i, j in enumerate(data.names) for c, g in enumerate(GPUS) if pred.isolated[i, c] > 0]
    seen, val = pl.DataFrame(rows[::2]), pl.DataFrame(rows[1::2])
    p2 = fit_refiner(p1, data.jobs, seen, base=data, config=TINY_P2, gpu_types=GPUS)
    scale, errors = choose_trust_scale(p1, p2, data.jobs, seen, val)
    assert scale == TRUST_SCALES[-1]
    assert set(errors) == {"full" if s is None else f"{s:g}" for s in TRUST_SCALES}
    assert errors[f"{scale:g}"] == pytest.approx(0.0, abs=1e-6)
    assert errors["full"] >= errors[f"{scale:g}"]


def test_p2_training_masks_leave_something_to_predict():
    rng = np.random.default_rng(0)
    known = rng.random((200, 12)) < 0.7
    is_pair = np.arange(12) >= 3
    mask = _sample_masks(known, rng, 4, is_pair)
    assert not (mask & ~known).any()
    assert (mask.sum(1) <= 4).all()
    rows = known.sum(1) > 1
    assert ((known & ~mask).sum(1)[rows] >= 1).all()
    assert mask.any()


def test_matrix_completion_recovers_a_low_rank_matrix_from_one_entry():
    rng = np.random.default_rng(1)
    u, v = rng.normal(size=(30, 1)), rng.normal(size=(1, 6))
    x = 2.0 + u @ v + rng.normal(size=(30, 1))  # row bias + rank 1
    mc = MatrixCompletion(rank=1, ridge=1e-3).fit(x)
    row = 2.0 + 0.7 * v[0] + 0.3
    obs = np.full(6, np.nan)
    obs[[0, 1]] = row[[0, 1]]
    got = mc.complete(obs)[0]
    assert got[0] == row[0] and got[1] == row[1]
    assert np.abs(got[2:] - row[2:]).max() < 0.2


def test_nearest_job_scales_its_neighbour_by_the_observation():
    summaries = np.array([[0.0, 0.0], [10.0, 10.0]])
    known = np.log(np.array([[1.0, 2.0, 4.0], [10.0, 10.0, 10.0]]))
    nj = NearestJob(summaries, known, np.array([1.0, 5.0]))
    obs = np.array([np.log(2.0), np.nan, np.nan])
    got = np.exp(nj.complete(np.array([0.1, 0.0]), 1.0, obs))
    assert got == pytest.approx([2.0, 4.0, 8.0])


def test_holdout_evaluation_never_trains_on_the_held_out_family(data, monkeypatch):
    seen: list[tuple[str, ...]] = []
    real = ev.train_p1

    def spy(train, config=P1Config(), **kw):
        seen.append(train.names + tuple(train.pairs["partner"].unique().to_list()))
        return real(train, config, **kw)

    monkeypatch.setattr(ev, "train_p1", spy)
    cfg = ev.EvalConfig(p1=P1Config(hidden=8, epochs=3, pair_rows_per_epoch=64),
                        p2=P2Config(hidden=8, epochs=3), repeats=1)
    result = ev.evaluate_holdout(data, "ResNet-50", cfg)
    # one P1 for the evaluation + one out-of-family P1 per remaining family (for P2's inputs)
    assert len(seen) == 1 + len(data.without(["ResNet-50"]).families)
    assert all(not n.startswith("ResNet-50") for names in seen for n in names)
    assert set(result.metrics) == set(ev.METHODS)
    for m in ev.METHODS:
        assert set(result.metrics[m]) == set(ev.METRICS)
        assert np.isfinite(result.metrics[m]["isolated_mape"])


def test_leave_one_family_out_rejects_unknown_family(data):
    with pytest.raises(ValueError, match="unknown holdout family"):
        ev.leave_one_family_out(data, ["VGG"])


def test_p1_on_a_gpu_type_it_was_not_trained_on_takes_the_nearest_trained_boards_shortfall(gogh_models):
    """The shipped Gavel prior (K80, P100, V100) extrapolated its head off the trained range: a
    ResNet-50 on an H100 at 1/3,000 of its V100 rate. On an untrained type a job now keeps the
    shortfall, overhead and sharing slowdown of the nearest trained board, with the new board's
    kernel time; trained types are predicted as before."""
    import dataclasses
    import math
    from pathlib import Path

    import polars as pl

    from gogh_flows.predict.data import zoo_jobs
    from gogh_flows.predict.io import load_p1

    p1 = load_p1(gogh_models / "gavel" / "p1")
    raw = dataclasses.replace(p1, trained_on={k: v for k, v in p1.trained_on.items() if k != "gpus"})
    names = ["ResNet-50 (batch size 64)", "Transformer (batch size 64)", "LM (batch size 20)"]
    jobs = zoo_jobs(names)
    gpus = ["k80", "v100", "a100", "h100", "t4"]
    now, before = p1.predict(jobs, gpus, partners=jobs), raw.predict(jobs, gpus, partners=jobs)
    v100, h100, a100 = (gpus.index(g) for g in ("v100", "h100", "a100"))
    assert (before.isolated[:, h100] < before.isolated[:, v100] / 50).all()  # what it was
    # a newer, faster board is faster again, by no more than its datasheet allows
    assert (now.isolated[:, h100] > now.isolated[:, v100]).all()
    assert (now.isolated[:, a100] > now.isolated[:, v100]).all()
    assert (now.isolated[:, h100] < 20 * now.isolated[:, v100]).all()
    # trained types exactly as before; pairs below their isolated figure on every type
    for g in ("k80", "v100"):
        np.testing.assert_array_equal(now.isolated[:, gpus.index(g)], before.isolated[:, gpus.index(g)])
    assert (now.pair <= now.isolated[:, None, :] * (1 + 1e-6)).all() and (now.pair[:, :, h100] > 0).all()
    # measured: the zoo on a real H100 (../shared/data/h100), mean absolute log error
    real = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "h100" / "alone.csv"
    if not real.exists():
        pytest.skip(f"real H100 measurements not found at {real}")
    rows = [r for r in pl.read_csv(real).iter_rows(named=True) if "inference" not in r["job_type"]]
    feats = zoo_jobs([r["job_type"] for r in rows])
    err = {}
    for label, model in (("now", p1), ("before", raw)):
        pred = model.predict(feats, ["h100"]).isolated[:, 0]
        err[label] = np.mean([abs(math.log(p / r["throughput_steps_per_s"])) for p, r in zip(pred, rows)])
    assert err["before"] > 5 and err["now"] < 1.5, err


@pytest.mark.parametrize("encoder", ["mean", "transformer"])
def test_p1_of_any_encoder_predicts_an_untrained_type_from_the_nearest_trained_one(data, encoder):
    """Trained on the K80, V100 and A100 only: an H100 takes the A100's shortfall and overhead
    (its nearest) with its own kernel time, the mean of encoders member by member."""
    model = train_p1(data, P1Config(encoder=encoder, hidden=8, epochs=5, pair_rows_per_epoch=64))
    assert model.trained_on["gpus"] == sorted(GPUS)
    assert model.nearest_trained(["h100", "v100"]) == {0: "a100"}  # a trained type is its own
    pred = model.predict(data.jobs, ("a100", "h100"), partners=data.jobs)
    assert np.isfinite(pred.isolated).all() and np.isfinite(pred.pair).all()
    assert (pred.pair <= pred.isolated[:, None, :] * (1 + 1e-6)).all()
    ran = pred.isolated[:, 1] > 0
    assert ran.any() and (pred.isolated[ran, 1] >= pred.isolated[ran, 0] * 0.999).all()  # not slower than the A100

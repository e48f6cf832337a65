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

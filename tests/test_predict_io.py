"""Model directories: round trip, and refusal of anything that could run code or was swapped."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.evaluate import p1_vectors
from gogh_flows.predict.io import (
    ModelFormatError, UnsafeModelError, load_model, load_p1, load_p2, read_card, save_model,
)
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, P1Model, train_p1
from gogh_flows.predict.p2 import P2Config, P2Model, train_p2
from gogh_flows.truth.synthetic import synthetic_table

GPUS = ("k80", "v100", "a100")
JOBS = ("A3C", "LM (batch size 20)", "ResNet-18 (batch size 64)", "Transformer (batch size 64)")


@pytest.fixture(scope="module")
def models():
    data = MeasuredSet.from_table(synthetic_table(GPUS)).subset(JOBS)
    p1 = train_p1(data, P1Config(hidden=8, epochs=5, pair_rows_per_epoch=64))
    layout = Layout(GPUS, data.names)
    vec = p1_vectors(p1, layout, data.names, data.jobs)
    p2 = train_p2(layout, vec, layout.truth(data, data.names), P2Config(hidden=8, epochs=5))
    return data, layout, p1, p2


@pytest.fixture()
def saved(models, tmp_path):
    _, _, p1, p2 = models
    return save_model(p1, tmp_path / "p1", card="# P1\ntiny"), save_model(p2, tmp_path / "p2")


def test_round_trip_gives_the_same_predictions(models, saved):
    data, layout, p1, p2 = models
    d1, d2 = saved
    assert sorted(x.name for x in d1.iterdir()) == ["MODEL_CARD.md", "config.json", "weights.safetensors"]
    q1, q2 = load_p1(d1), load_p2(d2)
    assert isinstance(q1, P1Model) and isinstance(q2, P2Model)
    a = p1_vectors(p1, layout, data.names, data.jobs)
    b = p1_vectors(q1, layout, data.names, data.jobs)
    np.testing.assert_allclose(a, b, rtol=1e-5)  # float32, batch-order round-off
    obs = np.full(layout.size, np.nan)
    obs[1] = a[0, 1] + 0.3
    np.testing.assert_allclose(p2.refine(a[0], obs), q2.refine(b[0], obs), rtol=1e-5)
    assert q2.layout == layout
    assert read_card(d1).startswith("# P1")
    assert json.loads((d1 / "config.json").read_text())["kind"] == "p1"


def test_a_mean_p1_predicts_its_members_mean_and_round_trips(models, tmp_path):
    """A ``mean`` P1 is the encoders' P1s side by side: its log prediction is their mean, alone
    and in a pair, each member trained as that encoder's P1 alone would be; it saves and loads
    like any P1 (safetensors, one copy of each member's weights), and fine-tunes member by member."""
    from dataclasses import replace

    from gogh_flows.predict.p1 import ENCODERS, P1MeanNet

    data, layout, _, _ = models
    cfg = P1Config(hidden=8, epochs=5, pair_rows_per_epoch=64)
    mean = train_p1(data, replace(cfg, encoder="mean"))
    singles = [train_p1(data, replace(cfg, encoder=e)) for e in ENCODERS]
    want = np.mean([p1_vectors(s, layout, data.names, data.jobs) for s in singles], axis=0)
    got = p1_vectors(mean, layout, data.names, data.jobs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert set(mean.trained_on["members"]) == set(ENCODERS)
    back = load_p1(save_model(mean, tmp_path / "mean"))
    assert isinstance(back.net, P1MeanNet) and back.config.encoder == "mean"
    np.testing.assert_allclose(p1_vectors(back, layout, data.names, data.jobs), got, rtol=1e-5)
    tuned = train_p1(data, replace(cfg, encoder="mean", epochs=2), init=back)
    assert isinstance(tuned.net, P1MeanNet) and tuned.trained_on["init"]["members"]
    np.testing.assert_allclose(p1_vectors(back, layout, data.names, data.jobs), got, rtol=1e-5)  # init untouched
    with pytest.raises(ValueError, match="keeps the architecture"):
        train_p1(data, replace(cfg, encoder="gru"), init=back)


def test_a_refiners_trust_scale_is_saved_and_a_bad_one_refused(models, tmp_path):
    from dataclasses import replace

    _, _, _, p2 = models
    d = save_model(replace(p2, trust_scale=0.2), tmp_path / "p2")
    assert load_p2(d).trust_scale == 0.2
    assert load_p2(save_model(p2, tmp_path / "full")).trust_scale is None  # as the shipped priors
    cfg = json.loads((d / "config.json").read_text())
    for bad in (-1, True, "0.2"):
        (d / "config.json").write_text(json.dumps({**cfg, "trust_scale": bad}))
        with pytest.raises(ModelFormatError, match="trust_scale must be a positive number"):
            load_p2(d)


@pytest.mark.parametrize("name", ["model.pt", "extra.pkl", "sub/state.pickle"])
def test_a_pickle_next_to_the_weights_is_refused(saved, name):
    d1, _ = saved
    (d1 / name).parent.mkdir(parents=True, exist_ok=True)
    (d1 / name).write_bytes(pickle.dumps({"not": "loaded"}))
    with pytest.raises(UnsafeModelError, match="pickled") as err:
        load_model(d1)
    assert name.split("/")[-1] in str(err.value)


def test_missing_files_are_named(saved):
    d1, _ = saved
    (d1 / "weights.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="lacks") as err:
        load_model(d1)
    assert "weights.safetensors" in str(err.value)
    with pytest.raises(ModelFormatError, match="does not exist"):
        load_model(d1 / "nowhere")


def test_config_claiming_p1_over_p2_tensors_is_refused(saved):
    d1, d2 = saved
    shutil.copy(d2 / "weights.safetensors", d1 / "weights.safetensors")
    with pytest.raises(ModelFormatError, match="SHA-256"):
        load_model(d1)
    # even with the checksum updated to match, the tensors do not fit the P1 architecture
    cfg = json.loads((d1 / "config.json").read_text())
    cfg["weights_sha256"] = json.loads((d2 / "config.json").read_text())["weights_sha256"]
    (d1 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="does not hold the tensors of the p1 model"):
        load_model(d1)
    # and without a checksum at all, the tampered weights are not taken on trust (a review
    # scaled every tensor and removed the field, and the model loaded)
    del cfg["weights_sha256"]
    (d1 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="records no weights_sha256"):
        load_model(d1)


def test_wrong_kind_and_bad_config_are_refused(saved):
    d1, d2 = saved
    with pytest.raises(ModelFormatError, match="P2 refiner was expected"):
        load_p2(d1)
    with pytest.raises(ModelFormatError, match="P1 estimator was expected"):
        load_p1(d2)
    cfg = json.loads((d1 / "config.json").read_text())
    (d1 / "config.json").write_text(json.dumps({**cfg, "kind": "p3"}))
    with pytest.raises(ModelFormatError, match="kind 'p3'"):
        load_model(d1)
    (d1 / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_model(d1)


def test_save_refuses_unknown_objects_and_directories_with_pickles(tmp_path, models):
    with pytest.raises(TypeError, match="P1Model or a P2Model"):
        save_model(object(), tmp_path / "x")  # type: ignore[arg-type]
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "old.pkl").write_bytes(b"x")
    with pytest.raises(UnsafeModelError):
        save_model(models[2], tmp_path / "y")


def test_shipped_priors_load_and_say_what_they_never_saw():
    from pathlib import Path

    models = Path(__file__).resolve().parent.parent / "models"
    dirs = sorted(p for p in models.glob("*/p[12]") if p.is_dir())
    assert {d.parent.name for d in dirs} >= {"synthetic", "gavel"}, "models/ should ship both priors"
    for d in dirs:
        model = load_model(d)
        assert sorted(x.name for x in d.iterdir()) == ["MODEL_CARD.md", "config.json", "weights.safetensors"]
        assert "gogh predictors train" in read_card(d)
        if isinstance(model, P2Model) and d.parent.name == "synthetic":
            assert "CycleGAN" not in model.layout.partners  # the demo's unseen family
            assert "**CycleGAN**" in read_card(d)

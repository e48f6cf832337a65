"""Registered predictors are MLflow models: mlflow.pyfunc.load_model predicts, with no pickle anywhere."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from gogh_flows.flows.predictors import models_dir
from gogh_flows.tracking import ModelRegistry
from gogh_flows.tracking.errors import UnsafeArtifactError
from gogh_flows.tracking.safety import verify_weights_only

JOBS = pd.DataFrame({"job_type": ["ResNet-50 (batch size 64)", "LM (batch size 20)", "ResNet-50 (batch size 64)"],
                     "gpu_type": ["v100", "k80", "v100"],
                     "partner": [None, None, "LM (batch size 20)"]})


@pytest.fixture()
def registered(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = ModelRegistry(uri, artifact_location=tmp_path / "artifacts")
    prior = models_dir() / "synthetic"
    reg.ensure_registered("gogh-p1", prior / "p1")
    reg.ensure_registered("gogh-p2", prior / "p2", p1_uri="models:/gogh-p1@champion")
    # through the environment only: mlflow.set_tracking_uri would also export it for the rest
    # of the session, and gogh follows MLFLOW_TRACKING_URI (tests/conftest.py clears it)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield tmp_path


def test_the_champion_loads_with_mlflow_pyfunc_and_predicts(registered):
    p1 = mlflow.pyfunc.load_model("models:/gogh-p1@champion").predict(JOBS)
    p2 = mlflow.pyfunc.load_model("models:/gogh-p2@champion").predict(JOBS)
    for pred in (p1, p2):
        assert len(pred) == 3 and all(v > 0 for v in pred)
        assert pred[2] < pred[0]  # sharing the GPU with a partner is slower than alone
    # no file that could hold a pickle was logged, and the versions pass the weights-only check
    files = [p for p in (registered / "artifacts").rglob("*") if p.is_file()]
    assert any(p.name == "MLmodel" for p in files)
    assert not [p for p in files if p.suffix.lower() in {".pkl", ".pickle", ".pt", ".pth", ".bin", ".joblib"}]
    for mlmodel in (p for p in files if p.name == "MLmodel"):
        text = mlmodel.read_text()
        assert "gogh_flows.tracking.pyfunc_flavor" in text and "python_model" not in text and "pickle" not in text
    for mlmodel in (p for p in files if p.name == "MLmodel"):
        verify_weights_only(mlmodel.parent)


def test_bad_input_says_which_columns_are_needed(registered):
    model = mlflow.pyfunc.load_model("models:/gogh-p1@champion")
    with pytest.raises(Exception, match="lacks column"):
        model.predict(pd.DataFrame({"model": ["ResNet-50"]}))


def test_an_mlmodel_with_another_loader_is_refused(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(models_dir() / "synthetic" / "p1", d)
    (d / "MLmodel").write_text("flavors:\n  python_function:\n    loader_module: mlflow.pytorch\n"
                               "    python_model: python_model.pkl\n")
    with pytest.raises(UnsafeArtifactError, match="loader module 'mlflow.pytorch' is not gogh's"):
        verify_weights_only(Path(d))


def test_observed_rows_let_the_refiner_correct_the_rest_and_come_back_as_observed(registered):
    """With nothing observed P2 returns P1's prediction (a user comparing champion and
    challenger through pyfunc saw the same numbers); an `observed` column feeds it what was measured."""
    import numpy as np

    p1 = mlflow.pyfunc.load_model("models:/gogh-p1@champion")
    p2 = mlflow.pyfunc.load_model("models:/gogh-p2@champion")
    rows = pd.DataFrame({"job_type": ["ResNet-50 (batch size 64)"] * 3, "gpu_type": ["v100", "k80", "a100"],
                         "partner": [None, None, None]})
    assert np.allclose(p1.predict(rows), p2.predict(rows))  # nothing observed: P2 is P1
    measured = rows.assign(observed=[3.0 * p1.predict(rows)[0], None, None])  # it ran 3x faster on the v100
    out = p2.predict(measured)
    assert out[0] == pytest.approx(measured["observed"][0])  # an observed row comes back as observed
    assert out[1] > 1.5 * p1.predict(rows)[1] and out[2] > 1.5 * p1.predict(rows)[2]  # the rest corrected
    with pytest.raises(ValueError, match="observed throughput must be >= 0"):
        p2.predict(rows.assign(observed=[-1.0, None, None]))


def test_load_pyfunc_refuses_a_planted_pickle_that_mlflows_own_loader_would_run(registered):
    """docs/tracking.md told users to load the champion with mlflow.pyfunc.load_model, which
    follows the version's MLmodel: a version planted in the shared registry with a pickled
    python_model ran its code on load (a security review). gogh's load_pyfunc checks the files
    first; the pickle here only touches a marker file, and never runs."""
    import pickle

    from mlflow import MlflowClient

    from gogh_flows.tracking.pyfunc_flavor import load_pyfunc

    assert load_pyfunc("models:/gogh-p2@champion").predict(JOBS)[0] > 0  # gogh's own version loads
    marker = registered / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    planted = registered / "planted"
    planted.mkdir()
    (planted / "python_model.pkl").write_bytes(pickle.dumps(Payload()))
    (planted / "MLmodel").write_text("flavors:\n  python_function:\n    loader_module: mlflow.pyfunc.model\n"
                                     "    python_model: python_model.pkl\n")
    client = MlflowClient()
    version = client.create_model_version("gogh-p2", source=str(planted)).version
    client.set_registered_model_alias("gogh-p2", "champion", version)
    with pytest.raises(UnsafeArtifactError, match=f"version {version} .* is refused"):
        load_pyfunc("models:/gogh-p2@champion")
    assert not marker.exists()


def test_a_registry_apart_from_the_tracking_store_is_followed(tmp_path, monkeypatch, gogh_home):
    """MLflow's MLFLOW_REGISTRY_URI (or the block's registry_uri) names a registry apart from the
    tracking store; gogh looked for the models in the tracking store (an MLflow review)."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource
    from gogh_flows.tracking.pyfunc_flavor import load_pyfunc

    tracking, registry = f"sqlite:///{tmp_path / 'tracking.db'}", f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", registry)
    source = PredictorSource(PredictorRegistry(refresh_s=0))
    source.get()
    assert source.degraded is None and source.versions() == {"p1": 1, "p2": 1}
    # the prior went to the registry store, none to the tracking store's registry
    assert ModelRegistry(registry).version_for("gogh-p1", "champion") == 1
    assert ModelRegistry(tracking).version_for("gogh-p1", "champion") is None
    assert len(load_pyfunc("models:/gogh-p2@champion").predict(JOBS)) == 3
    # the block's field wins over the environment
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert PredictorRegistry(registry_uri=other).resolved_registry_uri() == other


def test_a_file_store_mlflow_refuses_is_said_before_anything_runs(monkeypatch):
    from gogh_flows.flows.blocks import PredictorRegistry

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    block = PredictorRegistry(tracking_uri="file:///tmp/gogh-mlruns")
    with pytest.raises(ValueError, match="MLFLOW_ALLOW_FILE_STORE=true"):
        block.resolved_tracking_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert block.resolved_tracking_uri() == "file:///tmp/gogh-mlruns"

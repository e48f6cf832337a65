"""An MLflow ``python_function`` flavor for gogh predictors that never unpickles anything.

Why: a registered predictor version should be usable with MLflow's own tools
(``mlflow.pyfunc.load_model``, ``mlflow models serve``), yet the registry is shared, writable
storage and a pickle planted there would run on every machine that loads it. gogh's own
versions hold none; but MLflow's loaders follow whatever a version's ``MLmodel`` says, so a
version is loaded from the registry through :func:`load_pyfunc`, which checks its files first.
MLflow's ``loader_module`` form needs no pickle: the ``MLmodel`` file names this module, and
loading calls :func:`_load_pyfunc` on the version's own files (safetensors + JSON), which
:func:`gogh_flows.predict.io.load_model` rebuilds.

``predict`` takes a table (pandas or anything ``pandas.DataFrame`` accepts) with columns

* ``job_type``: a zoo job type named as Gavel does (``"ResNet-50 (batch size 64)"``; an
  inference run ends in ``" [inference]"``),
* ``gpu_type``: a catalog GPU type (``"v100"``),
* ``partner`` (optional): the job type sharing the GPU, empty for a job alone,

and returns the predicted steps per second, one per row. A P1 version predicts alone; a P2
version refines the P1 champion of the same registry (``models:/<p1 name>@champion``, names
recorded in the ``MLmodel`` file), with no observations: the prior shift it learned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: what the MLmodel's python_function flavor names; the safety check accepts only this
LOADER_MODULE = "gogh_flows.tracking.pyfunc_flavor"
INPUT_COLUMNS = ("job_type", "gpu_type", "partner")
#: the optional input column of measured steps/s (what the refiner corrects the rest from)
OBSERVED = "observed"


class GoghPyfunc:
    """What ``mlflow.pyfunc.load_model`` wraps: predict throughputs for rows of (job, GPU, partner)."""

    def __init__(self, predictor: Any) -> None:
        self.predictor = predictor

    def predict(self, model_input: Any, params: dict | None = None) -> Any:
        import numpy as np
        import pandas as pd

        from gogh_flows.predict.data import zoo_jobs

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        missing = [c for c in INPUT_COLUMNS[:2] if c not in frame.columns]
        if missing:
            raise ValueError(f"gogh predictor input lacks column(s) {missing}; give job_type (a zoo job type such "
                             "as 'ResNet-50 (batch size 64)'), gpu_type (such as 'v100') and optionally partner")
        partners = (frame["partner"] if "partner" in frame.columns else pd.Series([None] * len(frame)))
        partners = [p if isinstance(p, str) and p else None for p in partners]
        names = sorted(set(frame["job_type"]) | {p for p in partners if p})
        # an optional `observed` column: the steps/s measured for a row. A refiner corrects a job's
        # other entries from them, as placements do with the logged measurements; with none, P2
        # returns P1's prediction, so champion and challenger could not be told apart here
        seen = []
        if OBSERVED in frame.columns:
            from gogh_flows.predict.service import observations_frame

            for j, g, p, v in zip(frame["job_type"], frame["gpu_type"], partners, frame[OBSERVED], strict=True):
                if not pd.isna(v):
                    if not float(v) >= 0:
                        raise ValueError(f"observed throughput must be >= 0 steps/s, got {v!r} for {j!r} on {g!r}")
                    seen.append({"job_type": j, "gpu_type": g, "partner": p, "throughput": float(v)})
        observations = observations_frame(seen) if seen else None
        table = self.predictor.predict_table(zoo_jobs(names), sorted(set(frame["gpu_type"])), observations)
        out = [table.isolated(j, g) if p is None else table.pair(j, p, g)[0]
               for j, g, p in zip(frame["job_type"], frame["gpu_type"], partners, strict=True)]
        return np.asarray(out, dtype=float)


def _load_pyfunc(data_path: str) -> GoghPyfunc:
    """MLflow's entry point: rebuild the predictor from the version's safetensors and JSON."""
    import json

    from gogh_flows.predict.io import load_model
    from gogh_flows.predict.p1 import P1Model
    from gogh_flows.predict.service import ThroughputPredictor

    root = Path(data_path)
    model = load_model(root)
    if isinstance(model, P1Model):
        return GoghPyfunc(ThroughputPredictor(model))
    meta = json.loads((root / "gogh_pyfunc.json").read_text()) if (root / "gogh_pyfunc.json").is_file() else {}
    p1_uri = meta.get("p1_uri")
    if not p1_uri:
        raise ValueError(f"{root} holds a P2 refiner, which needs its P1 estimator, and names none "
                         "(gogh_pyfunc.json with p1_uri); register it with gogh's PredictorRegistry")
    return GoghPyfunc(ThroughputPredictor(_p1_from(p1_uri), model))


def _p1_from(uri: str) -> Any:
    """The P1 estimator behind ``models:/<name>@<alias>`` or ``models:/<name>/<version>``, downloaded
    from the version's own source (not MLflow's models:/ view, which adds a metadata file) and
    checked weights-only."""
    import tempfile

    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from gogh_flows.predict.io import load_p1
    from gogh_flows.tracking.safety import verify_weights_only

    if not uri.startswith("models:/"):
        raise ValueError(f"p1_uri must be models:/<name>@<alias> or models:/<name>/<version>, got {uri!r}")
    ref = uri[len("models:/"):]
    client = MlflowClient()
    if "@" in ref:
        name, alias = ref.split("@", 1)
        version = client.get_model_version_by_alias(name, alias)
    else:
        name, number = ref.rsplit("/", 1)
        version = client.get_model_version(name, number)
    # loaded into memory, then the download goes (each load left a folder in the temp dir)
    with tempfile.TemporaryDirectory(prefix="gogh-p1-") as tmp:
        local = Path(download_artifacts(artifact_uri=version.source, dst_path=tmp))
        verify_weights_only(local)
        return load_p1(local)


def load_pyfunc(model_uri: str) -> Any:
    """``mlflow.pyfunc.load_model(model_uri)`` for a gogh predictor in the registry MLflow is set
    to (``mlflow.get_registry_uri()``: ``MLFLOW_REGISTRY_URI``, else the tracking URI), its files
    checked weights-only (:func:`~gogh_flows.tracking.safety.verify_weights_only`) before MLflow
    reads them.

    Why not MLflow's own call: ``mlflow.pyfunc.load_model("models:/...")`` follows whatever
    ``MLmodel`` the version holds, and a version planted in the shared registry with MLflow's
    pickled ``python_model`` runs its code on load (a security review reproduced it); the
    registry's files are untrusted input. Here the version is downloaded and refused
    (``UnsafeArtifactError``) unless it is gogh's safetensors-and-JSON format."""
    import tempfile

    import mlflow
    from mlflow.pyfunc import load_model

    from gogh_flows.tracking.registry import ModelRegistry

    with tempfile.TemporaryDirectory(prefix="gogh-pyfunc-") as tmp:
        registry = ModelRegistry(mlflow.get_tracking_uri(), mlflow.get_registry_uri())
        local, _ = registry.download(model_uri, dest=Path(tmp) / "model")
        return load_model(str(local))  # read into memory: the folder can go


def write_mlmodel(directory: Path, *, p1_uri: str | None = None) -> None:
    """Add the ``MLmodel`` file (and, for a P2, the P1 it refines) to a model directory."""
    import json

    from mlflow.models import Model
    from mlflow.pyfunc import add_to_model

    model = Model()
    add_to_model(model, loader_module=LOADER_MODULE)
    model.save(str(Path(directory) / "MLmodel"))
    if p1_uri is not None:
        (Path(directory) / "gogh_pyfunc.json").write_text(json.dumps({"p1_uri": p1_uri}) + "\n")


__all__ = ["GoghPyfunc", "INPUT_COLUMNS", "LOADER_MODULE", "load_pyfunc", "write_mlmodel"]

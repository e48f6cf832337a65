"""Tracking adapter on a local SQLite MLflow store: registry round trips, weights-only
refusals, aliases, and the measurement log (parquet first, MLflow mirror, spool, concurrency)."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import pickle
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow import MlflowClient
from safetensors.numpy import save_file

from gogh_flows.tracking import (
    Measurement,
    MeasurementLog,
    ModelNotFoundError,
    ModelRegistry,
    TrackingUnavailableError,
    UnsafeArtifactError,
    parse_model_ref,
    verify_weights_only,
)
from gogh_flows.tracking.measurements import COMPLETE_TAG, KEY_TAG
from together import run_threads_beside

# imported here, not in a test: importing Prefect configures logging, which would drop
# the handler caplog installed for that test
from gogh_flows.flows.mirror import SpoolFlusher  # noqa: E402


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def make_model_dir(path: Path, seed: int = 0, card: bool = True) -> Path:
    """A weights-only model directory written without torch (safetensors' numpy backend)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"layer.weight": rng.standard_normal((4, 3)).astype(np.float32)}, str(path / "weights.safetensors"))
    (path / "config.json").write_text(json.dumps({"kind": "p2", "hidden": 4, "seed": seed}))
    if card:
        (path / "MODEL_CARD.md").write_text(f"# test model {seed}\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measurement(i: int = 0, **over) -> Measurement:
    base = dict(
        run_id=f"flow-run-{i}",
        flow_name="train",
        job_type="resnet18",
        family="resnet",
        batch_size=64,
        gpu_id="gpu-0",
        gpu_type="V100",
        device="cuda:0",
        partners=("lm",),
        required_throughput=10.0,
        predicted_throughput=12.5,
        steps=500.0,
        duration_s=20.0,
        throughput=25.0,
        mean_power_w=210.0,
        energy_j=4200.0,
        status="completed",
        telemetry="emulated",
        started_at=1_700_000_000.0 + i,
        flow_run_url=f"http://prefect.local/runs/flow-run/{i}",
        extra={"note": "x"},
    )
    base.update(over)
    return Measurement(**base)


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory) -> Path:
    """An MLflow SQLite database with its schema created once (migrations take seconds)."""
    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture()
def uri(tmp_path: Path, migrated_db: Path) -> str:
    db = tmp_path / "mlflow.db"
    shutil.copyfile(migrated_db, db)
    return f"sqlite:///{db}"


@pytest.fixture()
def registry(uri: str, tmp_path: Path) -> ModelRegistry:
    return ModelRegistry(uri, artifact_location=tmp_path / "artifacts")


@pytest.fixture()
def mlog(uri: str, tmp_path: Path) -> MeasurementLog:
    return MeasurementLog(uri, tmp_path / "measurements", artifact_location=tmp_path / "artifacts-m")


def mlflow_runs(uri: str, experiment: str = "gogh-measurements"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=10_000) if exp else []


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------
ADDED = {"MLmodel", "gogh_pyfunc.json", "registered_model_meta"}  # what register() adds to a model


def test_register_download_round_trip(registry: ModelRegistry, tmp_path: Path):
    src = make_model_dir(tmp_path / "m1")
    version = registry.register("p2", src, alias="champion", metrics={"mape": 0.12}, tags={"trained_on": "gavel"},
                                description="first")
    assert version == 1
    for ref in ("p2", "models:/p2@champion", "models:/p2/1"):
        local, got = registry.download(ref)
        assert got == 1
        # the registry adds the pyfunc MLmodel (and a P2's gogh_pyfunc.json) beside the model's files
        assert {k: v for k, v in files_of(local).items() if k not in ADDED} == files_of(src), ref
        assert "MLmodel" in files_of(local)
    dest = tmp_path / "cache" / "p2-v1"
    local, _ = registry.download("p2", dest=dest)
    assert local == dest and {k: v for k, v in files_of(dest).items() if k not in ADDED} == files_of(src)
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".gogh-")], "staging folder left behind"
    with pytest.raises(FileExistsError, match="not empty"):
        registry.download("p2", dest=dest)
    # artifacts went where we asked, not into ./mlruns of the working directory
    assert any((tmp_path / "artifacts").rglob("weights.safetensors"))
    frame = registry.versions("p2")
    assert frame.columns[:5] == ["version", "aliases", "run_id", "metrics", "created"]
    row = frame.row(0, named=True)
    assert row["version"] == 1 and row["aliases"] == ["champion"] and row["metrics"] == {"mape": 0.12}
    assert row["description"] == "first"
    assert MlflowClient(registry.tracking_uri).get_run(row["run_id"]).data.tags["trained_on"] == "gavel"


def test_aliases_champion_challenger_and_promotion(registry: ModelRegistry, tmp_path: Path):
    v1 = registry.register("p2", make_model_dir(tmp_path / "a", seed=1), alias="champion", metrics={"mape": 0.2})
    v2 = registry.register("p2", make_model_dir(tmp_path / "b", seed=2), alias="challenger", metrics={"mape": 0.1})
    assert (v1, v2) == (1, 2)
    assert registry.version_for("p2", "champion") == 1
    assert registry.version_for("p2", "challenger") == 2
    assert registry.version_for("p2", "nope") is None
    assert registry.version_for("unknown-model", "champion") is None
    champion_dir, version = registry.download("models:/p2@champion")
    assert version == 1 and json.loads((champion_dir / "config.json").read_text())["seed"] == 1

    registry.set_alias("p2", "champion", v2)  # promotion moves the alias
    assert registry.version_for("p2", "champion") == 2
    champion_dir, version = registry.download("p2")
    assert version == 2 and json.loads((champion_dir / "config.json").read_text())["seed"] == 2
    frame = registry.versions("p2")
    assert frame["aliases"].to_list() == [[], ["challenger", "champion"]]
    assert frame["metrics"].struct.field("mape").to_list() == [0.2, 0.1]


def test_tampered_artifacts_are_refused(registry: ModelRegistry, tmp_path: Path):
    version = registry.register("p2", make_model_dir(tmp_path / "m"), alias="champion")
    run_id = registry.versions("p2")["run_id"][0]
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"boom": 1}))
    MlflowClient(registry.tracking_uri).log_artifact(run_id, str(evil), "model")  # someone writes to the store
    dest = tmp_path / "out"
    with pytest.raises(UnsafeArtifactError) as err:
        registry.download("models:/p2@champion", dest=dest)
    message = str(err.value)
    assert "evil.pkl" in message and "pickle" in message and f"version {version}" in message
    assert not dest.exists(), "a refused model must not appear at the destination"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gogh-")]


def test_mlflow_model_layout_is_refused(registry: ModelRegistry, tmp_path: Path):
    registry.register("p1", make_model_dir(tmp_path / "m"), alias="champion")
    run_id = registry.versions("p1")["run_id"][0]
    mlmodel = tmp_path / "MLmodel"
    mlmodel.write_text("flavors:\n  pytorch:\n    pickle_module_name: mlflow.pytorch.pickle_module\n")
    MlflowClient(registry.tracking_uri).log_artifact(run_id, str(mlmodel), "model")
    with pytest.raises(UnsafeArtifactError, match="MLmodel.*unpickling"):
        registry.download("p1")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda d: (d / "model.pt").write_bytes(b"\x80\x04junk"), r"model\.pt: refused.*pickle"),
        (lambda d: (d / "weights.safetensors").write_bytes(pickle.dumps([1, 2])),
         r"is not weights-only; refusing it:\n  - weights\.safetensors: refused.*pickle"),
        (lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
        (lambda d: (d / "config.json").write_text("{not json"),
         r"is damaged or incomplete; refusing it:\n  - config\.json: refused, not valid UTF-8 JSON.*\nCopy it again"),
        (lambda d: (d / "sub").mkdir(), r"sub/: sub-directories are refused"),
        (lambda d: (d / "hook.py").write_text("import os"), r"hook\.py: refused, executable code"),
        (lambda d: (d / "link.json").symlink_to(d / "config.json"), r"link\.json: symbolic links"),
    ],
    ids=["pt-file", "pickle-renamed", "no-config", "bad-json", "subdir", "python", "symlink"],
)
def test_verify_weights_only_names_the_file_and_reason(tmp_path: Path, setup, expected):
    d = make_model_dir(tmp_path / "m")
    verify_weights_only(d)  # the clean directory passes
    setup(d)
    with pytest.raises(UnsafeArtifactError, match=expected):
        verify_weights_only(d)


def test_register_refuses_unsafe_directory(registry: ModelRegistry, tmp_path: Path):
    d = make_model_dir(tmp_path / "m")
    (d / "optimizer.pkl").write_bytes(pickle.dumps(1))
    with pytest.raises(UnsafeArtifactError, match="optimizer.pkl"):
        registry.register("p2", d)
    assert registry.version_for("p2", "champion") is None  # nothing entered the registry


def test_ensure_registered_is_idempotent(registry: ModelRegistry, tmp_path: Path):
    prior = make_model_dir(tmp_path / "prior")
    assert registry.ensure_registered("p1", prior) == 1
    assert registry.ensure_registered("p1", prior) == 1
    assert registry.versions("p1").height == 1
    # after retraining promotes v2, the shipped prior never takes the alias back
    v2 = registry.register("p1", make_model_dir(tmp_path / "new", seed=5))
    registry.set_alias("p1", "champion", v2)
    assert registry.ensure_registered("p1", prior) == 2
    assert registry.versions("p1").height == 2


def test_a_prior_claimed_by_a_process_that_died_is_registered_after_the_wait(registry: ModelRegistry, tmp_path: Path,
                                                                               caplog):
    """The registry decides which process registers the shipped prior (the one that created the
    model, tagged meanwhile; tests/test_tracking_server.py starts three hosts together): one that
    died holding the tag delays a first start by the wait, not for ever; a model left without the
    alias and untagged (an alias deleted by hand) is registered into at once."""
    from gogh_flows.tracking.registry import PRIOR_TAG

    prior = make_model_dir(tmp_path / "prior")
    registry._ready().create_registered_model("p1", tags={PRIOR_TAG: "gone-host:1"})
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="gogh_flows.tracking.registry"):
        assert registry.ensure_registered("p1", prior, wait_s=1.0) == 1
    assert 1.0 <= time.monotonic() - start and "gone-host:1" in caplog.text and "registering it here" in caplog.text
    assert PRIOR_TAG not in registry._ready().get_registered_model("p1").tags  # the next start does not wait
    registry._ready().delete_registered_model_alias("p1", "champion")
    start = time.monotonic()
    assert registry.ensure_registered("p1", prior, wait_s=60.0) == 2
    assert time.monotonic() - start < 30


def test_a_misspelt_model_name_that_would_start_a_registry_of_its_own_is_warned(
        registry: ModelRegistry, tmp_path: Path, caplog):
    prior = make_model_dir(tmp_path / "prior")
    with caplog.at_level("WARNING", logger="gogh_flows.tracking.registry"):
        registry.ensure_registered("gogh-p1", prior)
        registry.ensure_registered("gogh-p2", prior)  # a P1 and its P2: not a misspelling
        assert not caplog.text
        registry.ensure_registered("gogh-p2x", prior)
    assert "new model 'gogh-p2x'" in caplog.text and "'gogh-p2'" in caplog.text and "misspelling" in caplog.text


def test_unknown_names_aliases_versions_say_what_exists(registry: ModelRegistry, tmp_path: Path):
    registry.register("p2", make_model_dir(tmp_path / "m"), alias="champion")
    with pytest.raises(ModelNotFoundError, match=r"no registered model 'p3'.*registered models: p2"):
        registry.download("p3")
    with pytest.raises(ModelNotFoundError, match=r"no alias 'gold'.*aliases: champion -> v1"):
        registry.download("models:/p2@gold")
    with pytest.raises(ModelNotFoundError, match=r"no version 7.*versions: 1"):
        registry.download("models:/p2/7")
    with pytest.raises(ModelNotFoundError, match=r"no version 9.*versions: 1"):
        registry.set_alias("p2", "challenger", 9)
    with pytest.raises(ModelNotFoundError, match="registered models: p2"):
        registry.versions("nope")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("models:/p2", "neither an alias nor a version"), ("models:/p2/Production", "positive integer"),
     ("models:/p2@", "empty alias"), ("a/b", "invalid model name"), ("", "invalid model name")],
)
def test_bad_model_references(text: str, expected: str):
    with pytest.raises(ValueError, match=expected):
        parse_model_ref(text)


def test_parse_model_ref_forms():
    assert parse_model_ref("models:/p2@challenger").alias == "challenger"
    assert parse_model_ref("models:/p2/3").version == 3
    assert parse_model_ref("p2", alias="champion") == parse_model_ref("models:/p2@champion")


def test_unreachable_server_error_names_uri_and_fix():
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingUnavailableError) as err:
        ModelRegistry(uri).download("p2")
    assert uri in str(err.value) and "mlflow server" in str(err.value)


# ---------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------
def test_log_writes_parquet_and_mlflow_run(mlog: MeasurementLog, uri: str):
    m = measurement(1)
    run_id = mlog.log(m)
    assert run_id
    table = mlog.read()
    assert table.height == 1
    assert Measurement.from_row(table.row(0, named=True)) == m
    assert mlog.measurements() == [m]
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["job_type"] == "resnet18" and run.data.params["gpu_type"] == "V100"
    assert run.data.params["partners"] == "lm" and run.data.params["batch_size"] == "64"
    assert float(run.data.params["predicted_throughput"]) == 12.5
    assert float(run.data.params["required_throughput"]) == 10.0
    assert run.data.metrics["throughput"] == 25.0 and run.data.metrics["energy_j"] == 4200.0
    assert run.data.metrics["prediction_rel_error"] == pytest.approx(-0.5)
    assert run.data.tags["prefect.flow_run_id"] == "flow-run-1"
    assert run.data.tags["prefect.flow_run_url"].endswith("/1") and run.data.tags["gogh.status"] == "completed"
    assert run.info.start_time == int(m.started_at * 1000)
    assert run.data.tags["gogh.emulated_time"] == "true"  # the default sample is an emulated run


def test_emulated_runs_say_their_times_are_emulated(mlog: MeasurementLog, uri: str):
    run = MlflowClient(uri).get_run(mlog.log(measurement(7, telemetry="emulated")))
    assert run.data.tags["gogh.emulated_time"] == "true"
    assert "emulated GPU's time" in run.data.tags["mlflow.note.content"]  # the run's Description in the UI
    reported = MlflowClient(uri).get_run(mlog.log(measurement(9, telemetry="emulated", window="steady")))
    assert "gogh.emulated_time" not in reported.data.tags  # the body reported its steps: wall time
    assert "wall time on the machine that ran it" in reported.data.tags["mlflow.note.content"]
    # its rate is the machine's, which the refiner does not learn: no prediction error for it either
    assert "prediction_rel_error" in run.data.metrics and "prediction_rel_error" not in reported.data.metrics
    board = MlflowClient(uri).get_run(mlog.log(measurement(8, telemetry="nvml")))
    assert "gogh.emulated_time" not in board.data.tags and "mlflow.note.content" not in board.data.tags
    # a body that raised before its first step reported nothing: its description does not say it did
    none = MlflowClient(uri).get_run(mlog.log(measurement(10, telemetry="emulated", window="whole_run", steps=0.0,
                                                          throughput=0.0, status="failed")))
    assert "did no step" in none.data.tags["mlflow.note.content"]
    assert "reported its own steps" not in none.data.tags["mlflow.note.content"]


def test_failed_run_and_missing_optionals(mlog: MeasurementLog, uri: str):
    m = measurement(2, status="failed", predicted_throughput=None, mean_power_w=None, energy_j=None,
                    family=None, batch_size=None, partners=(), flow_run_url=None, extra={})
    run = MlflowClient(uri).get_run(mlog.log(m))
    assert run.info.status == "FAILED" and run.data.tags["gogh.status"] == "failed"
    assert "energy_j" not in run.data.metrics and "prediction_rel_error" not in run.data.metrics
    assert mlog.measurements() == [m]


def test_a_retried_attempt_is_tagged_with_its_flow_runs_id_and_pulled_back_as_logged(
        mlog: MeasurementLog, uri: str, tmp_path: Path):
    """A flow run's second attempt is measured as `<flow run id>#2`; MLflow's `prefect.flow_run_id`
    held that too, so filtering by the flow run's id found its first attempt only (a new-user
    review). The tag is the flow run's id; `gogh.run_id` keeps the measurement's, which a machine
    pulling the run reads back."""
    m = measurement(1, run_id="flow-run-1#2", extra={"attempt": "2"})
    mlog.log(m)
    (run,) = mlflow_runs(uri)
    assert run.data.tags["prefect.flow_run_id"] == "flow-run-1" and run.data.tags["gogh.run_id"] == "flow-run-1#2"
    other = MeasurementLog(uri, tmp_path / "another-machine")
    assert other.pull() == 1
    assert other.read()["run_id"].to_list() == ["flow-run-1#2"] and other.read()["key"].to_list() == [m.key]


def test_logging_twice_is_idempotent(mlog: MeasurementLog, uri: str):
    m = measurement(3)
    first = mlog.log(m)
    assert mlog.log(m) == first
    assert mlog.read().height == 1 and len(mlflow_runs(uri)) == 1


def test_read_since_and_order(mlog: MeasurementLog):
    for i in (5, 1, 3):
        mlog.log(measurement(i))
    assert mlog.read()["run_id"].to_list() == ["flow-run-1", "flow-run-3", "flow-run-5"]
    assert mlog.read(since=1_700_000_003.0)["run_id"].to_list() == ["flow-run-3", "flow-run-5"]
    assert MeasurementLog(mlog.tracking_uri, mlog.root.parent / "empty").read().height == 0


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("status", "done", "status"), ("telemetry", "guess", "telemetry"), ("throughput", float("nan"), "finite"),
     ("duration_s", -1.0, ">= 0"), ("gpu_id", "", "non-empty"), ("partners", "lm", "sequence"),
     ("batch_size", 0, "positive int"), ("extra", {"k": "v" * 6000}, "MLflow param rules"),
     ("extra", {"bad@key": "v"}, "MLflow param rules")],
)
def test_measurement_validation(field: str, value, expected: str):
    with pytest.raises(ValueError, match=expected):
        measurement(0, **{field: value})


def test_background_mirror_says_an_outage_once_and_backs_off(tmp_path: Path, caplog):
    down = MeasurementLog(f"http://127.0.0.1:{free_port()}", tmp_path / "measurements")
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        flusher = SpoolFlusher(down, interval_s=0.05)
        try:
            for i in range(4):  # four runs logged during the outage, each kicking the mirror
                down.log(measurement(i), defer=True)
                flusher.kick()
                time.sleep(0.3)
        finally:
            flusher.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("MLflow is unavailable" in x for x in said) == 1, said
    assert not any("still unreachable" in x for x in said), said
    assert len(down.spooled()) == 4  # nothing lost: delivered when it is back


def test_collecting_lost_runs_warns_only_when_the_ledger_stays_unreachable(tmp_path: Path, caplog):
    """One slow answer from a busy scheduler is not an outage: said on the third failure in a
    row, once, and again only after a success ended the outage."""
    answers = iter([TimeoutError("timed out after 5 s"), None, TimeoutError("timed out after 5 s")]
                   + [TimeoutError("timed out after 5 s")] * 5)
    asked = threading.Event()
    calls = []

    def collect() -> None:
        calls.append(1)
        answer = next(answers, None)
        if len(calls) >= 8:
            asked.set()
        if answer is not None:
            raise answer

    mlog = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "measurements")
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        flusher = SpoolFlusher(mlog, interval_s=0.01, collect=collect, collect_every_s=0.01)
        try:
            assert asked.wait(30)
        finally:
            flusher.stop()
    said = [r.getMessage() for r in caplog.records if "could not collect" in r.getMessage()]
    # failures: 1 (alone), then 6 in a row from the third call: said once, at the third of those
    assert len(said) == 1 and "3 tries in a row" in said[0] and "timed out after 5 s" in said[0], said


def test_unreachable_mlflow_spools_then_flush_writes(tmp_path: Path, uri: str, caplog):
    root = tmp_path / "measurements"
    down = MeasurementLog(f"http://127.0.0.1:{free_port()}", root)
    m = measurement(7)
    with caplog.at_level(logging.WARNING, logger="gogh_flows.tracking.measurements"):
        assert down.log(m) is None
    assert "spooled" in caplog.text and "flush_spool" in caplog.text
    assert down.read().height == 1, "the parquet row is written even when MLflow is down"
    assert len(down.spooled()) == 1
    assert down.flush_spool() == 0 and len(down.spooled()) == 1  # still down: nothing lost

    back = MeasurementLog(uri, root, artifact_location=tmp_path / "art")  # the server is back
    assert back.flush_spool() == 1
    assert back.spooled() == []
    runs = mlflow_runs(uri)
    assert [r.data.tags[KEY_TAG] for r in runs] == [m.key]
    assert back.read().height == 1


def test_a_spool_file_that_is_json_but_not_a_record_is_set_aside_not_a_stop(tmp_path: Path, uri: str, caplog):
    """A spooled file holding a JSON list stopped every flush at it (an AttributeError no one
    caught), so the measurements spooled after it never reached MLflow."""
    root = tmp_path / "measurements"
    down = MeasurementLog(f"http://127.0.0.1:{free_port()}", root)
    assert down.log(measurement(7)) is None and len(down.spooled()) == 1
    odd = down.spool_dir / "0000-odd.json"
    odd.write_text("[1, 2]")
    back = MeasurementLog(uri, root, artifact_location=tmp_path / "art")
    with caplog.at_level(logging.ERROR, logger="gogh_flows"):
        assert back.flush_spool() == 1
    assert back.spooled() == [] and odd.with_suffix(".json.bad").exists()
    assert "a JSON list, not an object" in caplog.text


def test_mlflow_failure_half_way_is_repaired_by_flush(mlog: MeasurementLog, uri: str, monkeypatch):
    m = measurement(8)
    client = mlog._client
    original = client.log_batch

    def broken(*args, **kwargs):
        raise RuntimeError("simulated MLflow outage after the run was created")

    monkeypatch.setattr(client, "log_batch", broken)
    assert mlog.log(m) is None
    assert mlog.read().height == 1 and len(mlog.spooled()) == 1
    monkeypatch.setattr(client, "log_batch", original)
    assert mlog.flush_spool() == 1
    runs = [r for r in mlflow_runs(uri) if r.info.lifecycle_stage == "active"]
    assert len(runs) == 1 and runs[0].data.tags[COMPLETE_TAG] == "true"  # the partial run was removed
    assert runs[0].data.metrics["throughput"] == m.throughput


def test_next_successful_log_flushes_the_spool(mlog: MeasurementLog, uri: str, monkeypatch):
    monkeypatch.setattr(mlog._client, "create_run", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    assert mlog.log(measurement(10)) is None
    monkeypatch.undo()
    assert mlog.log(measurement(11))
    assert mlog.spooled() == []
    assert sorted(r.data.tags[KEY_TAG] for r in mlflow_runs(uri)) == sorted(mlog.read()["key"].to_list())


def test_unreadable_spool_file_is_kept_aside(mlog: MeasurementLog):
    (mlog.spool_dir / "0-broken.json").write_text("{truncated")
    assert mlog.flush_spool() == 0
    assert (mlog.spool_dir / "0-broken.json.bad").exists()


def _log_from_process(uri: str, root: str, start: int, count: int) -> None:
    log = MeasurementLog(uri, Path(root))
    for i in range(start, start + count):
        log.log(measurement(i, gpu_id=f"proc-gpu-{i}"))


def test_concurrent_threads_and_processes_lose_no_row(mlog: MeasurementLog, uri: str):
    mlog.log(measurement(0))  # creates the MLflow schema before anyone races on it
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_log_from_process, args=(uri, str(mlog.root), 1000 + 100 * p, 5)) for p in range(2)]
    for p in procs:
        p.start()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            mlog.log(measurement(i, gpu_id=f"gpu-{i % 4}"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(1, 41)]
    run_threads_beside(threads, procs)
    assert not errors
    table = mlog.read()
    assert table.height == 1 + 40 + 10
    assert table["key"].n_unique() == table.height
    # whatever MLflow refused under contention (SQLite locks) was spooled; flushing reconciles
    mlog.flush_spool()
    assert mlog.spooled() == []
    logged = sorted(r.data.tags[KEY_TAG] for r in mlflow_runs(uri) if r.data.tags.get(COMPLETE_TAG) == "true")
    assert logged == sorted(table["key"].to_list())


def _flush_the_same_keys(uri: str, root: str, count: int, barrier: Any) -> None:
    log = MeasurementLog(uri, Path(root))
    for i in range(count):
        log.log(measurement(i), defer=True)  # a lost run handed out again, to this host too
        barrier.wait(30)
        log.flush_spool()
        barrier.wait(30)
    assert log.spooled() == []


def test_two_hosts_flushing_the_same_measurements_at_once_leave_one_mlflow_run_each(mlog: MeasurementLog, uri: str,
                                                                                    tmp_path: Path):
    """A run the pool's ledger hands out again can reach two hosts' spools; flushed together, each
    host's search for the key found nothing and both wrote it: every measurement twice in MLflow
    (a concurrency review: 10 of 10 keys). Each write now ends by keeping one run of its key."""
    mlog.log(measurement(99))  # the schema and experiment exist before the race
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    count = 6
    procs = [ctx.Process(target=_flush_the_same_keys, args=(uri, str(tmp_path / host), count, barrier))
             for host in ("host-a", "host-b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    logged = [r.data.tags[KEY_TAG] for r in mlflow_runs(uri) if r.data.tags.get(COMPLETE_TAG) == "true"]
    assert sorted(logged) == sorted({measurement(i).key for i in (*range(count), 99)})


def test_a_write_whose_run_another_host_deleted_mid_write_finds_that_hosts_run(mlog: MeasurementLog, uri: str,
                                                                               tmp_path: Path, monkeypatch):
    """The race the two-host test ran into once in a fresh clone's suite: host A created its run; host
    B's search before its own write took A's run for a half-written leftover and deleted it, and A's
    next call failed ("must be in the 'active' state"), leaving A's record spooled. A's write now
    looks again and finds B's run, which holds the measurement."""
    mlog.log(measurement(99))  # the experiment exists
    other = MeasurementLog(uri, tmp_path / "host-b")
    m = measurement(5)
    real = mlog._client.log_batch

    def raced(run_id, **kwargs):
        other._write_mlflow(m, check_existing=True)  # B: finds A's run half-written, deletes it, writes its own
        return real(run_id, **kwargs)  # A's run is deleted now: MLflow refuses this

    monkeypatch.setattr(mlog._client, "log_batch", raced)
    kept = mlog._write_mlflow(m, check_existing=True)
    complete = [r for r in mlflow_runs(uri) if r.data.tags.get(KEY_TAG) == m.key
                and r.data.tags.get(COMPLETE_TAG) == "true" and r.info.lifecycle_stage == "active"]
    assert [r.info.run_id for r in complete] == [kept]


def test_measurement_rows_round_trip_through_spool_json(tmp_path: Path):
    m = measurement(4, partners=("a", "b"), extra={"k": "v"})
    record = json.loads(json.dumps({**m.to_row(), "spooled_at": time.time()}))
    assert Measurement.from_row(record) == m
    assert dataclasses.replace(m, run_id="other").key == "other:gpu-0"


def test_a_table_that_cannot_be_written_loses_no_measurement(mlog: MeasurementLog, uri: str, monkeypatch, caplog):
    """A full or read-only disk under the table: the row waits in the spool, whose flush adds it
    to the table and MLflow (it was logged as an error and dropped, the flow run Completed)."""
    from gogh_flows.tracking.measurements import MeasurementLost

    real_append = mlog.table.append

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mlog.table, "append", refuse)
    assert mlog.log(measurement(1), defer=True) is None
    assert mlog.log(measurement(5), defer=True) is None
    assert mlog.read().height == 0 and len(mlog.spooled()) == 2
    with caplog.at_level(logging.DEBUG, logger="gogh_flows"):
        for _ in range(3):  # the table still refuses: they stay spooled, MLflow waits with them
            assert mlog.flush_spool() == 0
    said = [r for r in caplog.records if "still cannot take" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]  # not a line per row
    assert "2 spooled measurement(s)" in said[0].getMessage()
    assert len(mlog.spooled()) == 2 and not mlflow_runs(uri)
    monkeypatch.setattr(mlog.table, "append", real_append)
    assert mlog.flush_spool() == 2
    assert sorted(mlog.read()["key"].to_list()) == sorted([measurement(1).key, measurement(5).key])
    assert len(mlflow_runs(uri)) == 2 and not mlog.spooled()

    # the spool refuses too: MLflow takes it now
    monkeypatch.setattr(mlog.table, "append", refuse)
    real_spool = mlog._spool
    monkeypatch.setattr(mlog, "_spool", lambda *a, **k: refuse())
    assert mlog.log(measurement(2), defer=True)  # the MLflow run id
    assert len(mlflow_runs(uri)) == 3
    # and MLflow too: nothing could keep it, so the error holds the row
    monkeypatch.setattr(mlog, "_write_mlflow", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down")))
    with pytest.raises(MeasurementLost, match=r"table .*spool .*MLflow \(ConnectionError: down\).*\"run_id\": \"flow-run-3\""):
        mlog.log(measurement(3), defer=True)

    # a table that takes the row but a spool that does not: MLflow is written now, not skipped
    monkeypatch.setattr(mlog.table, "append", real_append)
    monkeypatch.setattr(mlog, "_write_mlflow", MeasurementLog._write_mlflow.__get__(mlog))
    assert mlog.log(measurement(4), defer=True)
    assert len(mlflow_runs(uri)) == 4 and measurement(4).key in mlog.read()["key"].to_list()
    monkeypatch.setattr(mlog, "_spool", real_spool)


def test_a_machine_pulls_the_measurements_another_logged_to_the_shared_store_once_each(
        mlog: MeasurementLog, uri: str, tmp_path: Path):
    """Each placing machine has its own $GOGH_HOME table and the team one MLflow store: what
    another machine logged reaches this table by pull(), every field as logged, and a second
    pull (or a row the table has) adds nothing."""
    other = MeasurementLog(uri, tmp_path / "other-machine", artifact_location=tmp_path / "artifacts-m")
    logged = [measurement(i, started_at=1_700_000_000.125 + i, partners=("a, b (batch size 2)", "lm"),
                          extra={"wall_s": "21.5", "note": "x"}) for i in range(3)]
    logged.append(measurement(9, status="failed", predicted_throughput=None, mean_power_w=None, energy_j=None,
                              family=None, batch_size=None, partners=(), window="whole_run", startup_s=1.5))
    for m in logged:
        other.log(m)
    mlog.log(logged[0])  # this machine has one of them already (its own run, say)
    assert mlog.pull() == 3 and mlog.pull() == 0
    rows = {m.key: m for m in mlog.measurements()}
    assert sorted(rows) == sorted(m.key for m in logged)
    for m in logged:
        assert dataclasses.replace(rows[m.key], started_at=m.started_at) == m  # MLflow keeps milliseconds
        assert rows[m.key].started_at == pytest.approx(m.started_at, abs=1e-3)
    later = measurement(20, started_at=1_800_000_000.0)
    other.log(later)
    assert mlog.pull(since=1_799_999_999.0) == 1 and mlog.pull() == 0


def test_a_shared_pools_placing_process_takes_in_other_machines_runs_as_they_are_logged(
        mlog: MeasurementLog, uri: str, tmp_path: Path):
    """The placements of one machine learn from another's runs: its mirror pulls the store."""
    from gogh_flows.flows.mirror import SpoolFlusher

    other = MeasurementLog(uri, tmp_path / "other-machine", artifact_location=tmp_path / "artifacts-m")
    other.log(measurement(1))
    mirror = SpoolFlusher(mlog, interval_s=0.05, pull_every_s=0.2)
    try:
        other.log(measurement(2, started_at=time.time()))
        deadline = time.monotonic() + 30
        while len(mlog.read()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(mlog.read()["key"]) == ["flow-run-1:gpu-0", "flow-run-2:gpu-0"]
    finally:
        mirror.stop()


def test_a_sqlite_store_whose_folder_cannot_be_made_is_said_so():
    from gogh_flows.tracking.backend import mlflow_client
    from gogh_flows.tracking.errors import TrackingUnavailableError

    with pytest.raises(TrackingUnavailableError, match="cannot create the folder /proc/gogh-nope"):
        mlflow_client("sqlite:////proc/gogh-nope/mlflow.db")


def test_a_timeout_raised_into_the_thread_creating_a_sqlite_store_leaves_a_whole_store(tmp_path: Path, monkeypatch):
    """Prefect's timeout_seconds on a sync flow raises into the flow's thread; on a first run
    that was often inside MLflow's schema migrations, and the half-migrated store failed every
    later run ("duplicate column name"). The migration now finishes on its own thread."""
    import ctypes
    import threading

    import mlflow.store.db.utils as mlflow_db

    from gogh_flows.tracking.backend import initialise_sqlite

    # the timeout is raised once MLflow's migrations have begun (they take seconds on a fresh store;
    # a fixed sleep before it missed them on a fast machine and landed before them on a slow one)
    migrating = threading.Event()
    upgrade = mlflow_db._upgrade_db

    def upgrade_db(engine):
        migrating.set()
        return upgrade(engine)

    monkeypatch.setattr(mlflow_db, "_upgrade_db", upgrade_db)

    db = tmp_path / "fresh" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    caught: list[BaseException] = []

    def first_run() -> None:
        try:
            initialise_sqlite(uri, db)
        except TimeoutError as exc:
            caught.append(exc)

    caller = threading.Thread(target=first_run)
    caller.start()
    assert migrating.wait(60), "MLflow never began its migrations"
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(caller.ident), ctypes.py_object(TimeoutError))
    caller.join(60)
    assert caught, "the injected timeout reached the caller"
    deadline = time.monotonic() + 60
    while not (db.parent / "mlflow.db").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    later = MeasurementLog(uri, tmp_path / "m", artifact_location=tmp_path / "a")  # the next run
    assert later.log(measurement(0)) is not None and len(mlflow_runs(uri)) == 1


def test_a_tracking_uri_that_is_not_mlflow_or_not_up_is_said_as_such():
    """A registry pointed at the Prefect server (a 404) was called "unreachable" and told to start
    MLflow on port 5000 whatever the URI named (a new-user review)."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from gogh_flows.tracking.backend import check_reachable
    from gogh_flows.tracking.errors import TrackingUnavailableError

    class NotMlflow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(TrackingUnavailableError, match=f"the server at {uri} answered MLflow's /health with "
                                                           "HTTP 404 .*not an MLflow tracking server.*tracking_uri"):
            check_reachable(uri)
    finally:
        server.shutdown()
        server.server_close()
    port = free_port()
    with pytest.raises(TrackingUnavailableError, match=f"unreachable .*`mlflow server --host 127.0.0.1 --port {port} "):
        check_reachable(f"http://127.0.0.1:{port}")

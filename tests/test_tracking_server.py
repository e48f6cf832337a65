"""Integration: the tracking adapter against a real `mlflow server` on loopback.

The server (SQLite backend, proxied artifacts under a temp dir) is started once for the
module and killed afterwards; start-up takes roughly 10-25 s on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gogh_flows.tracking import Measurement, MeasurementLog, ModelRegistry, UnsafeArtifactError
from gogh_flows.tracking.measurements import KEY_TAG
from test_tracking import free_port, make_model_dir, measurement

START_TIMEOUT_S = 120

# Server start-up alone is 20-45 s on a shared 2-core machine; the tests still run by default.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    log_path = root / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
            start_new_session=True,  # its own process group: uvicorn and job runner die with it
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def test_registry_through_server(server: str, tmp_path: Path):
    registry = ModelRegistry(server)
    src = make_model_dir(tmp_path / "prior", seed=1)
    assert registry.ensure_registered("p2-server", src) == 1
    v2 = registry.register("p2-server", make_model_dir(tmp_path / "new", seed=2), alias="challenger",
                           metrics={"mape": 0.08})
    registry.set_alias("p2-server", "champion", v2)
    local, version = registry.download("models:/p2-server@champion", dest=tmp_path / "dl")
    assert version == v2 and local == tmp_path / "dl"
    assert json.loads((local / "config.json").read_text())["seed"] == 2
    assert (local / "weights.safetensors").read_bytes() == (tmp_path / "new" / "weights.safetensors").read_bytes()
    frame = registry.versions("p2-server")
    assert frame["version"].to_list() == [1, 2]
    assert frame["source"][1].startswith("mlflow-artifacts:")  # proxied by the server, not a local path

    # tampering with the stored artifacts through the server is caught on download
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(object))
    MlflowClient(server).log_artifact(frame["run_id"][0], str(evil), "model")
    with pytest.raises(UnsafeArtifactError, match=r"evil\.pt"):
        registry.download("models:/p2-server/1")


def test_measurements_through_server(server: str, tmp_path: Path):
    root = tmp_path / "measurements"
    mlog = MeasurementLog(server, root)
    m = measurement(1)
    run_id = mlog.log(m)
    assert run_id
    run = MlflowClient(server).get_run(run_id)
    assert run.data.metrics["throughput"] == m.throughput and run.data.tags[KEY_TAG] == m.key
    assert mlog.measurements() == [m]

    # MLflow down: spooled; back up: flushed into the server, parquet unchanged
    down = MeasurementLog(f"http://127.0.0.1:{free_port()}", root)
    second: Measurement = measurement(2)
    assert down.log(second) is None and len(down.spooled()) == 1
    assert mlog.flush_spool() == 1
    client = MlflowClient(server)
    exp = client.get_experiment_by_name("gogh-measurements")
    keys = sorted(r.data.tags[KEY_TAG] for r in client.search_runs([exp.experiment_id]))
    assert keys == sorted(mlog.read()["key"].to_list()) == [m.key, second.key]


def test_hosts_starting_together_on_an_empty_registry_register_the_shipped_prior_once(server: str, tmp_path: Path):
    """Two machines' first runs against one empty registry each registered the shipped prior: two
    versions of each model and a champion P1 from one host beside a champion P2 from the other (a
    review rehearsing a team's first day). A lock file spans the threads and processes of one
    GOGH_HOME only; the registry itself decides which host registers."""
    repo = Path(__file__).resolve().parent.parent
    go = tmp_path / "go"
    script = ("import sys, time, pathlib\n"
              "from gogh_flows.flows.blocks import PredictorRegistry\n"
              "from gogh_flows.flows.predictors import PredictorSource\n"
              "source = PredictorSource(PredictorRegistry(tracking_uri=sys.argv[1]))\n"
              "pathlib.Path(sys.argv[3]).touch()\n"
              "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)\n"
              "source.ensure_prior()\n"
              "print(source.registry.version_for('gogh-p1', 'champion'), "
              "source.registry.version_for('gogh-p2', 'champion'))\n")
    hosts = []
    for name in ("host-a", "host-b", "host-c"):
        home = tmp_path / name
        home.mkdir()
        env = {**os.environ, "GOGH_HOME": str(home), "GOGH_MODELS_DIR": str(repo / "models"),
               "PYTHONPATH": str(repo), "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
        hosts.append(subprocess.Popen([sys.executable, "-c", script, server, str(go), str(home / "ready")],
                                      env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all((tmp_path / h / "ready").exists() for h in ("host-a", "host-b", "host-c")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in hosts), "a host did not get ready"
        time.sleep(0.1)
    go.touch()  # every host imported and waiting: they start together
    answers = []
    for proc in hosts:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        answers.append(out.split())
    client = MlflowClient(server)
    for name in ("gogh-p1", "gogh-p2"):
        versions = client.search_model_versions(f"name='{name}'")
        assert len(versions) == 1, [(v.version, v.tags.get("gogh.origin")) for v in versions]
    assert answers == [["1", "1"]] * 3

"""Screenshots of the Prefect and MLflow UIs after real placed runs (docs/img/ui-*.png).

What it does, all on loopback and under a temp dir: starts a Prefect server
(`prefect server start`) and an MLflow server (`mlflow server`, SQLite store), runs a few
`@gogh_placed` flows against both on the embedded emulated fleet (a subprocess with
PREFECT_API_URL and MLFLOW_TRACKING_URI set, as a user's script would have), then has
headless Chromium (Debian's `chromium` package: `apt-get install chromium`) load each page
and save a screenshot:

- ui-prefect-runs.png: Prefect's flow-runs page, each run tagged with where it ran;
- ui-prefect-flow-run.png: one flow run, its tags and its two placement artifacts;
- ui-prefect-explanation.png, ui-prefect-options.png: those artifacts (markdown, table);
- ui-mlflow-runs.png: MLflow's run list of the `gogh-measurements` experiment;
- ui-mlflow-registry.png: the model registry's `gogh-p2` (champion alias).

    .venv/bin/python docs/screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

The pages are single-page apps, so Chromium is given a virtual-time budget to render them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

RUNS = """
from gogh_flows import current_placement, gogh_placed


@gogh_placed(model="ResNet-50", batch_size=64, min_throughput=2.0, work_steps=400)
def train_resnet(epochs: int = 1) -> str:
    return current_placement().gpu_id


@gogh_placed(model="LM", batch_size=20, min_throughput=1.0, work_steps=300)
def train_lm(corpus: str = "wikitext-2") -> str:
    return current_placement().gpu_id


@gogh_placed(model="Transformer", batch_size=64, min_throughput=1.0, work_steps=300)
def translate(pairs: str = "wmt16") -> str:
    return current_placement().gpu_id


if __name__ == "__main__":
    import json

    from prefect.context import get_run_context

    ids = {}
    for flow in (train_resnet, train_lm, translate, train_resnet):
        state = flow(return_state=True)
        ids[flow.name] = str(state.state_details.flow_run_id)
    print(json.dumps(ids))
"""

#: Chromium's flags for a closed network (DESIGN: no outside connections), as root, headless
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1600,1000", "--virtual-time-budget=15000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:g} s")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())


def latest_artifact_id(prefect_url: str, key: str) -> str:
    body = json.dumps({"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1}).encode()
    request = urllib.request.Request(f"{prefect_url}/api/artifacts/filter", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:  # noqa: S310 - loopback only
        found = json.loads(r.read())
    if not found:
        raise RuntimeError(f"no Prefect artifact {key!r}: did the placed runs publish their explanation?")
    return found[0]["id"]


def shoot(chromium: str, url: str, out: Path, profile: Path) -> None:
    out.unlink(missing_ok=True)
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}", url],
                   check=True, timeout=120, capture_output=True)
    if not out.exists() or out.stat().st_size < 10_000:
        raise RuntimeError(f"Chromium saved no usable screenshot of {url} ({out})")
    print(f"saved {out} ({url})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    if not Path(args.chromium).exists():
        sys.exit(f"no Chromium at {args.chromium}: install Debian's package (apt-get install chromium) "
                 "or pass --chromium PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gogh-screenshots-"))
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "GOGH_HOME": str(tmp / "gogh"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
           "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}
    procs: list[subprocess.Popen] = []
    try:
        pport, mport = free_port(), free_port()
        prefect_url, mlflow_url = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{mport}"
        procs.append(subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                       str(pport)], env={**env, "PREFECT_UI_API_URL": f"{prefect_url}/api"}, stdout=open(tmp / "prefect.log", "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        procs.append(subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                                       str(mport), "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
                                       "--artifacts-destination", str(tmp / "mlartifacts"), "--workers", "1"],
                                      env=env, stdout=open(tmp / "mlflow.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        wait_ok(f"{prefect_url}/api/health", 180, "the Prefect server")
        wait_ok(f"{mlflow_url}/health", 180, "the MLflow server")
        script = tmp / "placed_runs.py"
        script.write_text(RUNS)
        run_env = {**env, "PREFECT_API_URL": f"{prefect_url}/api", "MLFLOW_TRACKING_URI": mlflow_url}
        done = subprocess.run([sys.executable, str(script)], env=run_env, cwd=tmp, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the placed runs failed:\n{done.stderr[-3000:]}")
        run_ids = json.loads(done.stdout.strip().splitlines()[-1])
        experiment = get_json(f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name"
                              "?experiment_name=gogh-measurements")["experiment"]["experiment_id"]
        profile = tmp / "chromium"
        shoot(args.chromium, f"{prefect_url}/runs", out / "ui-prefect-runs.png", profile)
        shoot(args.chromium, f"{prefect_url}/runs/flow-run/{run_ids['train-lm']}", out / "ui-prefect-flow-run.png",
              profile)
        for key, name in (("gogh-placement-train-lm", "explanation"), ("gogh-placement-train-lm-options", "options")):
            shoot(args.chromium, f"{prefect_url}/artifacts/artifact/{latest_artifact_id(prefect_url, key)}",
                  out / f"ui-prefect-{name}.png", profile)
        shoot(args.chromium, f"{mlflow_url}/#/experiments/{experiment}/runs", out / "ui-mlflow-runs.png", profile)
        shoot(args.chromium, f"{mlflow_url}/#/models/gogh-p2", out / "ui-mlflow-registry.png", profile)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

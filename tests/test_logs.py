"""Quiet by default, verbose on request (gogh_flows/logs.py)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gogh_flows
from pathlib import Path
from gogh_flows.tracking.measurements import MeasurementLog
d = Path({tmp!r})
MeasurementLog("sqlite:///" + str(d / "mlflow.db"), d / "m").read()
"""


def _run(tmp_path, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_LOGGING_LEVEL", "GOGH_VERBOSE",
                                                              "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")}
    return subprocess.run([sys.executable, "-c", SCRIPT.format(tmp=str(tmp_path))], capture_output=True,
                          text=True, timeout=120, env={**clean, **env})


def test_mlflow_database_lines_are_quiet_by_default_and_back_with_gogh_verbose(tmp_path):
    quiet = _run(tmp_path / "a")
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO mlflow" not in quiet.stderr + quiet.stdout
    loud = _run(tmp_path / "b", GOGH_VERBOSE="1")
    assert loud.returncode == 0, loud.stderr
    assert "INFO mlflow" in loud.stderr + loud.stdout


def test_what_the_user_set_wins(tmp_path):
    mine = _run(tmp_path / "c", MLFLOW_LOGGING_LEVEL="INFO")
    assert "INFO mlflow" in mine.stderr + mine.stdout


DASK_SCRIPT = """
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
import gogh_flows
from distributed import Client, LocalCluster
with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
    with Client(cluster) as client:
        assert client.submit(sum, [1, 2]).result() == 3
"""


def _run_dask(**env):
    clean = {k: v for k, v in os.environ.items() if k not in ("GOGH_VERBOSE", "DASK_LOGGING__DISTRIBUTED")}
    return subprocess.run([sys.executable, "-c", DASK_SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


def test_dask_info_lines_are_quiet_by_default_and_back_with_gogh_verbose():
    quiet = _run_dask()
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO:distributed" not in quiet.stderr
    loud = _run_dask(GOGH_VERBOSE="1")
    assert loud.returncode == 0, loud.stderr
    assert "INFO:distributed" in loud.stderr


def test_a_dask_scheduler_started_with_the_ledger_preloaded_keeps_its_own_log_lines(tmp_path):
    """Importing gogh_flows quieted Dask's INFO lines in every process, also in a `dask scheduler`
    an operator started with `--preload gogh_flows.runtime.ledger`: it printed nothing, not even
    the address it listens on (a review)."""
    import time
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    clean = {k: v for k, v in os.environ.items() if k not in ("GOGH_VERBOSE", "DASK_LOGGING__DISTRIBUTED")}
    log = tmp_path / "scheduler.log"
    sched_file = tmp_path / "scheduler.json"
    with log.open("w") as out:
        proc = subprocess.Popen([str(bin_dir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                 "--no-dashboard", "--scheduler-file", str(sched_file),
                                 "--preload", "gogh_flows.runtime.ledger"],
                                env={**clean, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not sched_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        assert sched_file.exists(), log.read_text()[-2000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert "Scheduler at:" in text and "tcp://127.0.0.1" in text, text[-2000:]


def test_a_dask_cli_is_told_apart_by_its_console_script_or_its_module(monkeypatch):
    from gogh_flows.logs import dask_cli

    for argv, expected in ((["/venv/bin/dask", "scheduler"], True), (["/venv/bin/dask-worker", "tcp://x"], True),
                           (["/venv/lib/python3.11/site-packages/distributed/cli/dask_scheduler.py"], True),
                           (["/venv/bin/gogh", "demo"], False), (["flow.py"], False), ([""], False), ([], False)):
        monkeypatch.setattr(sys, "argv", argv)
        assert dask_cli() is expected, argv

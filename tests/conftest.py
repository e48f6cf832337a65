"""Shared fixtures; every test runs offline with state under temp dirs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from gogh_flows.localenv import OFFLINE, THROWAWAY_SERVER, set_defaults, sqlite_server  # imports no Prefect

set_defaults({
    **OFFLINE,
    **THROWAWAY_SERVER,  # a test server is thrown away too: no SQLite lock-outs of a minute
    # the pool for a server on a file; the session's server keeps its records in memory (below),
    # where Prefect opens one connection and requests queue for it: up to the pool timeout while
    # twenty flow runs write at once (the 40-run test)
    **sqlite_server(40),
    "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_TIMEOUT": "120",
    # ... and clients wait out a busy server: the default 5 retries back off for about 30 s in
    # all, which a loaded 2-core CI machine can exceed while 20 flow runs write at once (503s)
    "PREFECT_CLIENT_MAX_RETRIES": "9",
})
# all state under temp dirs: a developer's own MLflow server is never written to by the tests
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("MLFLOW_REGISTRY_URI", None)
_SESSION_DIRS: list[str] = []


def _session_dir(variable: str, prefix: str) -> None:
    """A temp dir for ``variable`` unless the caller set one; removed when the suite ends
    (each run left two behind before, dozens on a developer's machine)."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        _SESSION_DIRS.append(os.environ[variable])


def pytest_unconfigure(config) -> None:
    import shutil

    for folder in _SESSION_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


_session_dir("HYPOTHESIS_STORAGE_DIRECTORY", "gogh-hypothesis-")
# the zoo's features, extracted once for the session and read by every process it starts
# (Dask workers, host processes): each would otherwise trace the zoo again (~8 s of CPU)
_session_dir("GOGH_CACHE_DIR", "gogh-cache-")

REPO = Path(__file__).resolve().parent.parent
GAVEL_DIR = Path(os.environ.get("GOGH_GAVEL_DIR", REPO.parent / "shared" / "data" / "gavel"))


@pytest.fixture(scope="session")
def gavel_dir() -> Path:
    if not (GAVEL_DIR / "simulation_throughputs.json").exists():
        pytest.skip(f"Gavel data not found in {GAVEL_DIR} (set GOGH_GAVEL_DIR to its folder)")
    return GAVEL_DIR


@pytest.fixture(scope="session")
def gavel_table(gavel_dir: Path):
    from gogh_flows.truth.gavel import read_gavel_json

    return read_gavel_json(gavel_dir / "simulation_throughputs.json")


@pytest.fixture(autouse=True)
def _tracking_uri_stays_in_its_test():
    """A test (or a doc example) that calls ``mlflow.set_tracking_uri`` also exports
    ``MLFLOW_TRACKING_URI``, which gogh follows: undo it, or every later test writes there."""
    yield
    import sys

    if "mlflow" in sys.modules:
        from mlflow.tracking._tracking_service import utils as _mlflow_uri

        if _mlflow_uri._tracking_uri is not None:
            _mlflow_uri.set_tracking_uri(None)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("MLFLOW_REGISTRY_URI", None)


# Hypothesis keeps no example database in the working tree (tests leave no state behind).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("gogh", database=None)
_hyp_settings.load_profile("gogh")


# -- the Prefect layer --------------------------------------------------------------------
# One Prefect test server for the whole session (about 12 s to start, DESIGN §8), started
# only by tests that ask for it. Its records are thrown away, so they are kept in memory, as
# the demo's are (localenv.MEMORY_DATABASE): Prefect's own harness puts them in a SQLite file,
# where concurrent writers wait on the file's lock and a flow run stalled for Prefect's 60 s busy
# timeout in about half of the full suites (docs/performance.md).
@pytest.fixture(scope="session")
def prefect_server():
    import prefect.context
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    from gogh_flows.localenv import MEMORY_DATABASE

    memory = MEMORY_DATABASE["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: memory}):
        server = SubprocessASGIServer(port=_free_port())
        # ... registered as the default, so that Prefect code asking for a temporary server during
        # a flow run finds this one instead of starting another (what Prefect's harness does too)
        before = SubprocessASGIServer._instances.get(None)
        SubprocessASGIServer._instances[None] = server
        server.start(timeout=120)
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}), \
                    prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
                yield server.api_url
                _drain_prefect_workers()
        finally:
            server.stop()
            if before is None:
                SubprocessASGIServer._instances.pop(None, None)
            else:
                SubprocessASGIServer._instances[None] = before


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drain_prefect_workers() -> None:
    """Logs and events still queued in this process reach the server before it stops (they
    raised connection errors at shutdown otherwise)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
            pass


@pytest.fixture(scope="session")
def gogh_models(tmp_path_factory) -> Path:
    """The shipped priors (models/), or a tiny one trained here when they are absent."""
    shipped = REPO / "models"
    if (shipped / "synthetic" / "p1" / "config.json").exists():
        return shipped
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.predict.evaluate import p1_vectors
    from gogh_flows.predict.io import save_model
    from gogh_flows.predict.layout import Layout
    from gogh_flows.predict.p1 import P1Config, train_p1
    from gogh_flows.predict.p2 import P2Config, train_p2
    from gogh_flows.truth.synthetic import synthetic_table

    out = tmp_path_factory.mktemp("models")
    data = MeasuredSet.from_table(synthetic_table(["k80", "v100", "t4", "a100"]))
    p1 = train_p1(data, P1Config(epochs=20, hidden=16))
    layout = Layout(data.gpus, data.names)
    p2 = train_p2(layout, p1_vectors(p1, layout, data.names, data.jobs), layout.truth(data, data.names),
                  P2Config(epochs=20, hidden=16))
    save_model(p1, out / "synthetic" / "p1")
    save_model(p2, out / "synthetic" / "p2")
    return out


@pytest.fixture
def gogh_home(tmp_path, monkeypatch, gogh_models) -> Path:
    """A fresh $GOGH_HOME (MLflow SQLite, ledger, measurements) per test; pools closed after."""
    from gogh_flows.flows.session import close_all

    home = tmp_path / "gogh"
    monkeypatch.setenv("GOGH_HOME", str(home))
    monkeypatch.setenv("GOGH_MODELS_DIR", str(gogh_models))
    yield home
    close_all()

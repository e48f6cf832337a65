"""Shared fixtures; every test runs offline with state under temp dirs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="gogh-hypothesis-"))

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


# Hypothesis keeps no example database in the working tree (tests leave no state behind).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("gogh", database=None)
_hyp_settings.load_profile("gogh")

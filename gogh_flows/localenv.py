"""Environment defaults for running offline against a SQLite-backed Prefect server.

Why one place: the demo's temporary server and the test suite's server face the same
things -- no telemetry may leave the machine, and dozens of concurrent flow runs write to
one SQLite file, so the server needs a connection pool that size and must wait for the
file's lock (60 s) rather than fail requests into client back-off. Only ``setdefault`` is
used: whatever the user set wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: nothing is reported to Prefect, MLflow or anyone else
OFFLINE: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
}


def sqlite_server(connections: int) -> dict[str, str]:
    """Prefect server settings for ``connections`` concurrent writers on its SQLite file."""
    return {
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": str(connections),
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": str(connections),
        "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    }


def set_defaults(values: Mapping[str, str]) -> None:
    """``os.environ.setdefault`` for each of ``values``."""
    for key, value in values.items():
        os.environ.setdefault(key, value)


__all__ = ["OFFLINE", "set_defaults", "sqlite_server"]

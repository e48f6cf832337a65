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


# A Prefect server thrown away after use (the demo's, the tests') need not store the event
# stream, record task-run states from events or run automations, and each of those services is
# one more writer on its SQLite file. With them, the task-run recorder and the API's task-run
# inserts locked each other out until the 60 s database timeout (a known Prefect issue with
# SQLite, PrefectHQ/prefect#18934): a demo wave took 77 s instead of 12, and the tests' 40-run
# test stalled a whole minute at once, 52-250 s from run to run.
THROWAWAY_SERVER = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
}


# A server whose records are not kept after use can hold them in memory. Prefect gives an
# in-memory SQLite database one connection (its pool for ':memory:' URLs), so concurrent requests
# queue in that pool instead of waiting on SQLite's file lock. On a file, `gogh demo`'s flow runs
# stalled a minute in about half of its runs (2026-11-27: 7 of 13; later that day 2 of 14): every write
# waiting on the lock ran into Prefect's hard-coded 60 s busy timeout while the server's event
# loop stood still (docs/performance.md has the traces). With one connection nothing waits on
# the lock: 0 "database is locked" answers in a demo, against 11-63 on a file.
MEMORY_DATABASE = {"PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:"}


def set_defaults(values: Mapping[str, str]) -> None:
    """``os.environ.setdefault`` for each of ``values``."""
    for key, value in values.items():
        os.environ.setdefault(key, value)


__all__ = ["MEMORY_DATABASE", "OFFLINE", "THROWAWAY_SERVER", "set_defaults", "sqlite_server"]

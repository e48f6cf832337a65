"""Quiet by default: MLflow's and Dask's INFO lines and per-run URLs are not what a gogh user asked to see.

Why here: MLflow reads ``MLFLOW_LOGGING_LEVEL`` and ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``,
and Dask ``DASK_LOGGING__DISTRIBUTED``, when they are imported, so the defaults must be in the environment before that, and importing
``gogh_flows`` is the first thing a user's flow does. Only defaults: anything the user set
wins, and ``GOGH_VERBOSE=1`` keeps every library's own level (docs/user-guide.md).
"""

from __future__ import annotations

import logging
import os
import sys

from gogh_flows.localenv import set_defaults

#: the switch: set to 1 (or true, yes, on) to see MLflow's and Dask's own INFO lines again
VERBOSE_ENV = "GOGH_VERBOSE"
QUIET: dict[str, str] = {
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables...", "Updating database tables"
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # "View run ... at: ..." after every run
    # Dask's config from the environment (this process and the dask CLIs it starts): about 40
    # "distributed.core/scheduler/worker" INFO lines per process, 200 for one short run
    "DASK_LOGGING__DISTRIBUTED": "warning",
}


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def dask_cli() -> bool:
    """Whether this process is a ``dask scheduler`` / ``dask worker`` someone started, which imports
    gogh_flows only through ``--preload``: its own log lines (the address it listens on, the
    workers it sees) are what its operator reads, and quieting them left a scheduler started with
    the ledger preloaded saying nothing at all (a review)."""
    path = sys.argv[0] if sys.argv and sys.argv[0] else ""
    parts = path.replace("\\", "/").split("/")
    # the console scripts, and `python -m distributed.cli.dask_scheduler` (argv[0] is then that file)
    return parts[-1] in ("dask", "dask-scheduler", "dask-worker") or parts[-3:-1] == ["distributed", "cli"]


def quiet_by_default() -> None:
    """Apply the quiet defaults unless ``GOGH_VERBOSE`` is set; a no-op for what the user set."""
    if verbose():
        return
    if dask_cli():  # Dask's lines are the point of a Dask CLI; MLflow's still are not
        set_defaults({k: v for k, v in QUIET.items() if not k.startswith("DASK_")})
        return
    set_defaults(QUIET)
    if "mlflow" in sys.modules and os.environ.get("MLFLOW_LOGGING_LEVEL", "").upper() == "WARNING":
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # imported before us: its level is set already
    if "distributed" in sys.modules and os.environ.get("DASK_LOGGING__DISTRIBUTED", "").lower() == "warning":
        logging.getLogger("distributed").setLevel(logging.WARNING)  # likewise: its config was read on import


__all__ = ["QUIET", "VERBOSE_ENV", "dask_cli", "quiet_by_default", "verbose"]

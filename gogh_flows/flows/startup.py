"""Start-up progress lines: what a process is starting, and when it is ready.

A first run takes seconds to tens of seconds (a Dask cluster, the MLflow store, the
predictors) and silence looks like a hang. Its own module because both the session and
the predictors' loader say what they start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gogh_flows.flows.run_logs import has_other_handlers

__all__ = ["starting", "startup_log"]

#: start-up progress: shown on the console by default (see :func:`starting`)
startup_log = logging.getLogger("gogh_flows.startup")


def _show_startup_lines() -> None:
    """Make the start-up lines visible unless the user configured gogh's logging themselves.

    A first run takes seconds to tens of seconds (a Dask cluster, the MLflow store, the
    emulated fleet's truth table) and silence looks like a hang; later runs start nothing
    and print nothing. Prefect's console handler on the root logger shows WARNING and up by
    default, so only this child logger is raised to INFO, and only when neither it nor
    ``gogh_flows`` has a level set; with no handler anywhere it gets one of its own.
    """
    if startup_log.level == logging.NOTSET and logging.getLogger("gogh_flows").level == logging.NOTSET \
            and startup_log.getEffectiveLevel() > logging.INFO:
        startup_log.setLevel(logging.INFO)
    if not has_other_handlers(startup_log):  # gogh's bridge to the run log is not one that shows them
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        startup_log.addHandler(handler)


@contextmanager
def starting(component: str, detail: str = "") -> Iterator[None]:
    """One INFO line when ``component`` starts and one when it is ready, with the time it took."""
    _show_startup_lines()
    startup_log.info("gogh: starting %s%s ...", component, f" ({detail})" if detail else "")
    began = time.monotonic()
    try:
        yield
    except BaseException:
        startup_log.info("gogh: %s failed after %.1f s", component, time.monotonic() - began)
        raise
    startup_log.info("gogh: %s ready in %.1f s", component, time.monotonic() - began)

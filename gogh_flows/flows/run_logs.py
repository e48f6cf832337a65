"""What a placed run says reaches its Prefect flow-run log, wherever its body runs.

Why: a Prefect user reads a run's log in the UI. Two things never got there (a Prefect
review): ``print`` in a body run by a worker of another process (Prefect routes prints to
the log only in the engine's own process, for ``log_prints=True``), and gogh's own warnings
(``logging.getLogger("gogh_flows")``), which went to the stderr of whichever process said
them: "these runs do not see each other", "cancelled in Prefect without its process being
told", "the pool's scheduler has not answered".
"""

from __future__ import annotations

import builtins
import logging
import threading

#: a record logged with ``extra={RUN_LOG: False}`` stays out of the run's log (said there already)
RUN_LOG = "gogh_run_log"

_installed = threading.Lock()


def route_prints() -> None:
    """Prints of a body go to its run's log when its flow logs prints (``log_prints=True``).

    Prefect's ``print_as_log`` is ``print`` itself outside a run, or in a run that does not log
    prints, so it is installed once for the process and left: patching around each body, as
    Prefect's engine does, would undo a concurrent body's patch as the first one ends."""
    from prefect.logging.loggers import print_as_log

    if builtins.print is not print_as_log:
        builtins.print = print_as_log


class RunLogBridge(logging.Handler):
    """gogh_flows records said inside a flow or task run go to that run's log too.

    Outside a run (a lease keeper's thread, a CLI) a record goes where it always went (Python's
    last-resort stderr included, where no other handler takes it). Left out
    when Prefect already sends the library's records (``PREFECT_LOGGING_EXTRA_LOGGERS`` names
    ``gogh_flows``), and for records marked ``extra={RUN_LOG: False}``."""

    def emit(self, record: logging.LogRecord) -> None:
        if not has_other_handlers(logging.getLogger(record.name)) and record.levelno >= logging.lastResort.level:
            # Python prints a record no handler takes (its lastResort) only where there is no handler
            # at all, and this one counts: without it the record went nowhere (a review)
            logging.lastResort.handle(record)
        if getattr(record, RUN_LOG, True) is False:
            return
        try:
            from prefect.context import FlowRunContext, TaskRunContext
            from prefect.logging import get_run_logger
            from prefect.settings import PREFECT_LOGGING_EXTRA_LOGGERS

            if not (FlowRunContext.get() or TaskRunContext.get()):
                return
            extra = PREFECT_LOGGING_EXTRA_LOGGERS.value() or []
            if "gogh_flows" in ([extra] if isinstance(extra, str) else extra):
                return
            # to the run's API handlers only: through the run logger it also reached the console,
            # where the library's own record already shows it (each line printed twice)
            from prefect.logging.handlers import APILogHandler

            run = get_run_logger()
            msg, kwargs = run.process(record.getMessage(), {})
            forwarded = run.logger.makeRecord(run.logger.name, record.levelno, record.pathname, record.lineno, msg,
                                              (), None, record.funcName, kwargs.get("extra"))
            for handler in run.logger.handlers:
                if isinstance(handler, APILogHandler) and record.levelno >= handler.level:
                    handler.handle(forwarded)
        except Exception:  # noqa: BLE001 - a log line must never fail what it describes
            return


def has_other_handlers(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` reaches a handler other than :class:`RunLogBridge`
    (``Logger.hasHandlers`` counts the bridge)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, RunLogBridge) for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def send_warnings_to_run_logs() -> None:
    """Install :class:`RunLogBridge` on the ``gogh_flows`` logger, once per process."""
    with _installed:
        lib = logging.getLogger("gogh_flows")
        if not any(isinstance(h, RunLogBridge) for h in lib.handlers):
            lib.addHandler(RunLogBridge())


__all__ = ["RUN_LOG", "RunLogBridge", "has_other_handlers", "route_prints", "send_warnings_to_run_logs"]

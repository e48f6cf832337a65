"""Runs whose placing process was lost, ended by another process that logs to the same store.

A SIGKILLed placing process cannot log what its runs did nor end their Prefect flow runs,
which would say Running for ever. The pool's ledger keeps those runs (with the measurement
their worker made, if a body ran) and hands them to a live process of the same tracking
store, whose MLflow mirror calls :func:`deliver_lost_runs` every few seconds.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gogh_flows.tracking.errors import short_error
from gogh_flows.tracking.measurements import Measurement, MeasurementLog

log = logging.getLogger("gogh_flows")

#: runs this process is still ending itself (a delivery of their worker's record must not
#: mark their flow runs Crashed: the process ends them, with the reason)
_HANDLED: set[str] = set()
_HANDLED_LOCK = threading.Lock()


@contextmanager
def handling(run_id: str) -> Iterator[None]:
    """While the block runs, this process ends ``run_id`` itself."""
    with _HANDLED_LOCK:
        _HANDLED.add(run_id)
    try:
        yield
    finally:
        with _HANDLED_LOCK:
            _HANDLED.discard(run_id)


def _handled(run_id: str) -> bool:
    with _HANDLED_LOCK:
        return run_id in _HANDLED


def deliver_lost_runs(ledger: Any, measurements: MeasurementLog) -> int:
    """Log the measurements the pool's ledger holds for this store and mark their flow runs Crashed.

    Each measurement is logged by its idempotency key (a second delivery is a no-op); a run is
    said delivered only once both are done, so one that cannot be logged or marked now stays
    with the ledger and is handed out again after a lease timeout. Returns how many
    measurements were logged.
    """
    done, logged = [], 0
    for lost in ledger.collect(measurements.store):
        if lost.row is not None:
            try:
                m = Measurement.from_row(lost.row)
                measurements.log(m, defer=True)
            except Exception as exc:  # noqa: BLE001 - kept by the ledger, retried after a lease timeout
                log.warning("gogh: could not log the measurement of run %s (its placing process was lost): %s",
                            lost.run_id, exc)
                continue
            logged += 1
            whose = ("whose placing process was lost" if lost.placer_gone
                     else "which its placing process gave up or did not say it had logged")
            log.info("gogh: logged the measurement of run %s on %s, %s (%s, %.0f steps), from its worker's record",
                     lost.run_id, m.gpu_id, whose, m.status, m.steps)
            ended = "finished" if m.status == "completed" else "was stopped"
            what = (f"its body {ended} on {m.gpu_id} after {m.steps:.0f} steps and its measurement was logged "
                    f"by {socket.gethostname()}")
        else:
            what = f"it held a slot of {lost.gpu_id} but its body never started; the slot was freed"
        if lost.placer_gone and not _handled(lost.run_id) and crash_flow_run(
                lost.run_id, f"gogh: the process that placed this run was lost (its Dask client left the "
                             f"pool); {what}") is None:
            continue  # Prefect did not answer: handed out again, and marked then
        done.append(lost.run_id)
    if done:
        ledger.delivered(done)
    return logged


def take_workers_record(ledger: Any, measurements: MeasurementLog, key: str, wait_s: float,
                        poll_s: float = 0.5) -> bool:
    """Deliver what the ledger holds for this store until the measurement ``key`` is logged,
    for at most ``wait_s``; True once it is.

    For a run whose future Dask cancelled while its worker lived on (this process's connection
    to the scheduler dropped, and Dask cancels a disconnected client's runs): the body is
    stopped there, and its worker hands in a record of what it did. Logged first, it is the
    one the table and MLflow keep (one record per key); this process's own knows of no step.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            deliver_lost_runs(ledger, measurements)
        except Exception as exc:  # noqa: BLE001 - this process's own record is logged instead
            log.debug("gogh: collecting the worker's record of %s failed: %s", key, short_error(exc))
        if measurements.table.has(key):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def crash_flow_run(run_id: str, message: str) -> bool | None:
    """Set the run's Prefect flow run to Crashed if it still runs that attempt.

    True: marked; False: nothing to mark (not a flow run, on another server, ended, or a
    later attempt runs); None: Prefect did not answer (said, never raised: the measurement
    is what must not be lost, the state is for the people watching). Only against a
    configured Prefect API: a process on a temporary server of its own would start one here,
    and the lost run was not on it anyway. Never forced: Prefect's own rules refuse Crashed
    over a state that ended meanwhile.
    """
    flow_run_id, _, attempt = run_id.partition("#")  # the ledger's id of a retried attempt is "<run>#<n>"
    try:
        uuid.UUID(flow_run_id)
    except ValueError:
        return False  # a run called outside a flow run has no Prefect state
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import get_current_settings
    from prefect.states import Crashed

    if not get_current_settings().api.url:
        return False
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
            if run.state is None or run.state.type not in (StateType.RUNNING, StateType.PENDING):
                return False  # ended by its runner or its process, or being cancelled
            if run.run_count > int(attempt or 1):
                return False  # a later attempt of the flow run is under way
            result = client.set_flow_run_state(flow_run_id, Crashed(message=message))
    except ObjectNotFound:
        return False  # a flow run of another Prefect server
    except Exception as exc:  # noqa: BLE001 - said; tried again when the ledger hands the run out again
        log.warning("gogh: could not mark flow run %s Crashed (its placing process was lost): %s",
                    flow_run_id, short_error(exc))
        return None
    if result.status != SetStateStatus.ACCEPT:
        return False
    log.warning("gogh: marked flow run %s Crashed: %s", flow_run_id, message)
    return True


__all__ = ["crash_flow_run", "deliver_lost_runs"]

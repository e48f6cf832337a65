"""The post-run hook: what one placed run really did, logged whatever the run's outcome.

It runs inside the flow run, after every attempt (completed or failed), instead of as a
Prefect ``on_completion``/``on_failure`` state hook: those fire once per flow run, after
the final state, so the measurements of attempts that were retried would be lost.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from gogh_flows.flows.placer import RunPlacement
from gogh_flows.power_limits import SAME_LIMIT_W
from gogh_flows.tracking.measurements import LIMIT_TRIAL, PARTNERS_CHANGED, Measurement
from gogh_flows.workloads.job import JobSpec

if TYPE_CHECKING:  # the session opens the mirror that delivers what the ledger holds
    from gogh_flows.flows.session import Session

log = logging.getLogger("gogh_flows")


def _flow_run_url(flow_run: Any) -> str | None:
    try:
        from prefect.settings import PREFECT_UI_URL

        ui = PREFECT_UI_URL.value()
        return f"{ui}/runs/flow-run/{flow_run.id}" if ui and flow_run is not None else None
    except Exception:
        return None


def _company(partners: tuple[str, ...]) -> str:
    return "next to " + ", ".join(sorted(set(partners))) if partners else "alone"


def build_measurement(job: JobSpec, placement: RunPlacement, outcome: Any, error: BaseException | None,
                      *, started: float, wall_s: float, flow_run: Any, flow_name: str,
                      device: str, logged_by: str = "placer") -> Measurement:
    attempt = getattr(flow_run, "run_count", 1) if flow_run is not None else 1
    run_id = placement.run_id  # the one run key: ledger, pool and measurement
    tel = getattr(outcome, "telemetry", None)
    failed = error is not None or (outcome is not None and not outcome.ok)
    # an interrupt's str() is empty: its type says what happened ("KeyboardInterrupt")
    reason = ((f"{type(error).__name__}: {error}" if str(error) else type(error).__name__) if error is not None
              else (outcome.error if outcome is not None else None))
    # the run's own share of the board's energy: a board shared by two runs must not be
    # counted twice in the table (the board's figure is kept apart, in ``device_energy_j``)
    energy = tel.attributed_energy_j if tel is not None else None
    extra = {"attempt": str(attempt), "policy": placement.policy,
             "predicted_energy_j": f"{placement.predicted_energy_j:.6g}",
             "waited_s": f"{placement.waited_s:.3f}", "kind": job.kind,
             "p1_version": str(placement.predictor_versions.get("p1")),
             "p2_version": str(placement.predictor_versions.get("p2")),
             "device_energy_j": _fmt(tel.energy_j if tel is not None else None)}
    if tel is not None:
        extra.update({"window_steps": _fmt(tel.window_steps), "wall_s": _fmt(tel.wall_s),
                      "board_run_energy_j": _fmt(tel.board_run_energy_j), "energy_split": tel.energy_split or "",
                      "energy_method": tel.energy_method or "", "power_limit_w": _fmt(tel.power_limit_w),
                      "limit_slowdown": _fmt(tel.limit_slowdown)})
        if tel.limit_lifted_from_w is not None:  # the run measured short under its limit: the guard lifted it
            extra["limit_lifted_from_w"] = _fmt(tel.limit_lifted_from_w)
            extra["limit_lifted_rate"] = _fmt(tel.limit_lifted_rate)
    if placement.limit_trial and tel is not None and _in_force(placement.power_limit_w, tel):
        extra[LIMIT_TRIAL] = _fmt(placement.power_limit_w)
    if placement.partner_runs:
        # what the decision saw on this GPU, and what it predicted for each partner next to this run
        extra["placed_next_to"] = ",".join(placement.partner_runs)
        extra["partner_predicted"] = ",".join(f"{t:.6g}" for t in placement.partner_predicted)
        extra["partner_required"] = ",".join(f"{t:.6g}" for t in placement.partner_required)
    if outcome is not None and outcome.started_at is not None:
        extra["body_started_at"] = f"{outcome.started_at:.6f}"
        extra["body_ended_at"] = f"{outcome.ended_at:.6f}"
    if reason:
        extra["error"] = reason[:500]
    if logged_by != "placer":
        extra["logged_by"] = logged_by
    # planned at a bound: which, and what it was (getattr: a placement record of an older version,
    # handed over by a worker's ledger, has neither field)
    risk, point = getattr(placement, "risk_level", None), getattr(placement, "point_throughput", None)
    if risk is not None:
        extra["risk_level"] = _fmt(risk)
        extra["planned_throughput"] = _fmt(placement.predicted_throughput)
    partners = tuple(outcome.partners) if outcome is not None else placement.partners
    if set(partners) != set(placement.partners):
        # a partner came (or the placed-with one never showed) after the decision: the placement's
        # prediction was for other conditions, so its error says nothing about the predictor
        extra[PARTNERS_CHANGED] = f"placed {_company(placement.partners)}, ran {_company(partners)}"
    elif outcome is not None and outcome.company_changed:
        # the same company at both ends, not all along: a partner left (or came and went)
        extra[PARTNERS_CHANGED] = (f"placed {_company(placement.partners)}, ran {_company(partners)} part of "
                                   "the time: a partner came or went during the run")
    return Measurement(
        run_id=run_id, flow_name=flow_name, job_type=job.job_type, family=job.family,
        batch_size=job.batch_size, gpu_id=placement.gpu_id, gpu_type=placement.gpu_type, device=device,
        partners=partners, required_throughput=job.required_throughput,
        # at a risk level the decision's figure is a bound: the error is the point prediction's
        # (none known: no figure, rather than the bound passed off as one)
        predicted_throughput=placement.predicted_throughput if risk is None else point,
        steps=float(tel.steps) if tel is not None else 0.0,
        duration_s=float(tel.duration_s) if tel is not None else float(wall_s),
        throughput=float(tel.throughput) if tel is not None else 0.0,
        mean_power_w=tel.mean_power_w if tel is not None else None, energy_j=energy,
        status="failed" if failed else "completed",
        telemetry=tel.source if tel is not None else "none",
        started_at=started, flow_run_url=_flow_run_url(flow_run), extra=extra,
        window=tel.window if tel is not None else None,
        startup_s=tel.startup_s if tel is not None else None,
        startup_energy_j=tel.startup_energy_j if tel is not None else None,
        run_energy_j=tel.run_energy_j if tel is not None else None,
    )


def _in_force(limit_w: float | None, tel) -> bool:
    """Whether the board ran under ``limit_w``: recorded as its limit, or lifted from it by the guard.
    A limit a pool does not set on real boards (logged, not applied) was never tried."""
    return limit_w is not None and any(w is not None and abs(w - limit_w) <= SAME_LIMIT_W
                                       for w in (tel.power_limit_w, tel.limit_lifted_from_w))


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def record_run(session: Session, job: JobSpec, placement: RunPlacement, outcome: Any,
               error: BaseException | None, *, started: float, flow_run: Any, flow_name: str) -> bool:
    """Log the run's measurement; whether it is recorded (in the table, or spooled for it). A
    failure to log is reported, never raised over the run's result."""
    try:
        m = build_measurement(job, placement, outcome, error, started=started,
                              wall_s=time.time() - started, flow_run=flow_run, flow_name=flow_name,
                              device=session.pool.device(placement.gpu_id).where)
        session.measurements.log(m, defer=True)  # durable now; the session's mirror writes MLflow
    except Exception as exc:  # MeasurementLost holds the row; anything else failed before it was built
        log.error("gogh: could not record the measurement of run %s on %s: %s", placement.run_id,
                  placement.gpu_id, exc)
        return False
    session.mirror.kick()
    _say_if_work_differs(job, m)
    return True


#: a completed run whose body reported more than this factor more (or fewer) steps than its
#: declared ``work_steps`` is told so
WORK_MISMATCH = 2.0


def _say_if_work_differs(job: JobSpec, m: Measurement) -> None:
    """Placements estimate a run's time and energy (and a waiting run's chances) from its declared
    ``work_steps``; a body that reports far more or fewer steps makes those estimates off by the
    same factor for every run of the flow. Said in the flow run's log, not refused: the measurement
    is the body's own count either way (never the declared work added to it)."""
    if m.status != "completed" or not m.steps > 0:
        return
    ratio = m.steps / job.work_steps
    if 1 / WORK_MISMATCH <= ratio <= WORK_MISMATCH:
        return
    message = (f"gogh: run {m.run_id}'s body reported {m.steps:,.0f} steps and its @gogh_placed(work_steps="
               f"{job.work_steps}) declares {job.work_steps:,} ({ratio:.3g}x): the throughput measured is right, "
               f"but placements estimate a run's time and energy from work_steps. Set work_steps to the steps a "
               f"run of {m.flow_name!r} reports")
    _warn(message)


def _warn(message: str) -> None:
    """Into the flow run's log (the Prefect UI shows it beside the run), else the library's."""
    try:
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
    except Exception:  # noqa: BLE001 - outside a flow run's context
        log.warning(message)


def record_if_placer_lost(job: JobSpec, placement: RunPlacement, started: float, flow_run: Any, flow_name: str,
                          device: str, store: str, outcome: Any) -> tuple[str, dict[str, Any]]:
    """On the worker, as the body ends: its measurement, for the ledger to keep until the run is
    logged (used only if the placing process is lost, or gave the run up, before it logged it).

    The same measurement the placing process would have logged (same key, so a placer that
    was only cut off and logs it too is not counted twice), marked as logged by the worker.
    """
    m = build_measurement(job, placement, outcome, None, started=started, wall_s=time.time() - started,
                          flow_run=flow_run, flow_name=flow_name, device=device,
                          logged_by="worker (its placing process was lost)")
    return store, m.to_row()


__all__ = ["build_measurement", "record_if_placer_lost", "record_run"]

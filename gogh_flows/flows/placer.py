"""One placement decision for one flow run, against the live occupancy of the pool.

The decision is solved on the predicted throughputs of the new run *and* of every run
already on the fleet (read from the ledger, which all processes share), so a new run is
never put next to a job it would push below its requirement. Solving and reserving are
two steps; when another process took the slot in between, the reservation fails and the
decision is simply taken again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gogh_flows.energy import kwh
from gogh_flows.flows.spec import PlacedJob
from gogh_flows.placement import Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.result import Placement
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.truth.table import ThroughputTable
from gogh_flows.workloads.features import WorkloadFeatures


class PlacementTimeout(RuntimeError):
    """No GPU met the run's requirement within its wait timeout."""


@dataclass(frozen=True)
class RunPlacement:
    """Where a run goes and what was predicted for it there (also what ``current_placement`` shows)."""

    run_id: str
    job_type: str
    gpu_id: str
    gpu_type: str
    required_throughput: float
    predicted_throughput: float
    predicted_energy_j: float
    partners: tuple[str, ...]  # job types sharing the GPU at placement time
    policy: str
    solve_ms: float
    waited_s: float
    predictor_versions: dict
    explanation_md: str


def running_jobs(occupants: dict, now: float, headroom: float = 0.0) -> list[Job]:
    """Ledger reservations -> running jobs with their estimated remaining work."""
    jobs = []
    for gpu_id, reservations in occupants.items():
        for r in reservations:
            elapsed = max(0.0, now - r.started_at)
            remaining = max(1.0, r.work - r.required_throughput * elapsed)
            jobs.append(Job(r.run_id, r.job_type, r.required_throughput * (1 + headroom), remaining, 1,
                            (gpu_id,)))
    return jobs


def decide(
    job: PlacedJob, run_id: str, devices: Sequence[GpuDevice], running: list[Job],
    table: ThroughputTable, policy: str, time_limit_s: float, headroom: float = 0.0,
) -> tuple[Placement, PlacementProblem]:
    gpus = [Gpu(d.id, d.gpu_type, d.capacity) for d in devices]
    new = Job(run_id, job.job_type, job.min_throughput * (1 + headroom), float(job.work_steps))
    problem = PlacementProblem.build(gpus, [*running, new], table)
    options = {"time_limit_s": time_limit_s} if policy == "optimizer" else {}
    return get_policy(policy, **options).place(problem), problem


def place_with_retry(
    job: PlacedJob, run_id: str, *, devices: Sequence[GpuDevice],
    occupants: Callable[[], dict], reserve: Callable[[str, float], bool],
    predict: Callable[[dict[str, WorkloadFeatures]], ThroughputTable],
    features: Callable[[str], WorkloadFeatures], policy: str, time_limit_s: float,
    wait_timeout_s: float, poll_s: float, versions: dict, on_wait: Callable[[str], None] | None = None,
    sleep: Callable[[float], object] = time.sleep, headroom: float = 0.0,
) -> RunPlacement:
    """Solve, reserve, and retry until placed or the wait timeout passes.

    ``sleep(timeout)`` waits between tries; the decorator passes one that returns early
    when a run of this process releases its GPU.
    """
    start = time.monotonic()
    said_waiting = False
    while True:
        now = time.time()
        running = running_jobs(occupants(), now, headroom)
        types = {j.job_type for j in running} | {job.job_type}
        feats = {t: (job.features if t == job.job_type else features(t)) for t in types}
        table = predict(feats)
        placement, problem = decide(job, run_id, devices, running, table, policy, time_limit_s, headroom)
        short = next((w for w in placement.waiting if w.job_id == run_id), None)
        if short is not None and headroom > 0 and job.min_throughput <= short.best_throughput:
            # no GPU type clears the requirement with headroom, but some clear it exactly:
            # plan without headroom rather than wait for a GPU that cannot exist
            placement, problem = decide(job, run_id, devices, running, table, policy, time_limit_s, 0.0)
        if run_id in placement.placed_ids:
            a = placement.assignment(run_id)
            gpu_id = a.gpus[0]
            if reserve(gpu_id, a.throughput):
                partners = tuple(j.job_type for j in problem.occupants(gpu_id))
                waited = time.monotonic() - start
                return RunPlacement(
                    run_id=run_id, job_type=job.job_type, gpu_id=gpu_id, gpu_type=a.gpu_type,
                    required_throughput=job.min_throughput, predicted_throughput=a.throughput,
                    predicted_energy_j=a.energy_j, partners=partners, policy=placement.policy,
                    solve_ms=placement.solve_ms, waited_s=waited, predictor_versions=dict(versions),
                    explanation_md=explain_markdown(job, run_id, placement, problem, gpu_id, waited, versions),
                )
            continue  # another run took the slot between solve and reserve: decide again
        waiting = next((w for w in placement.waiting if w.job_id == run_id), None)
        reason = waiting.reason if waiting else "not placed"
        best = waiting.best_throughput if waiting else math.nan
        elapsed = time.monotonic() - start
        if elapsed >= wait_timeout_s:
            raise PlacementTimeout(
                f"no GPU could run {job.job_type!r} at its required {job.min_throughput:g} steps/s "
                f"within {wait_timeout_s:g} s ({reason}); the best predicted throughput on this fleet "
                f"is {best:.4g} steps/s. Lower min_throughput, add a faster GPU type, or raise "
                "wait_timeout_s if the fleet is only busy")
        if on_wait is not None and not said_waiting:
            on_wait(f"run {run_id} waits for a GPU: {reason} (best predicted {best:.4g} steps/s, "
                    f"required {job.min_throughput:g}); retrying every {poll_s:g} s for up to "
                    f"{wait_timeout_s:g} s")
            said_waiting = True
        sleep(min(poll_s, max(0.0, wait_timeout_s - elapsed)))


def explain_markdown(job: PlacedJob, run_id: str, placement: Placement, problem: PlacementProblem,
                     gpu_id: str, waited_s: float, versions: dict) -> str:
    """The Prefect artifact: chosen slot, its predicted figures, runner-ups, and rejections."""
    a = placement.assignment(run_id)
    ex = placement.explanations.get(run_id)
    partners = [f"`{j.job_type}` ({j.id})" for j in problem.occupants(gpu_id) if j.id != run_id]
    lines = [
        f"### Placement of `{job.job_type}`",
        "",
        f"**{gpu_id}** ({a.gpu_type})" + (f", sharing with {', '.join(partners)}" if partners else ", alone"),
        "",
        "| | value |", "| --- | ---: |",
        f"| required throughput | {job.min_throughput:.4g} steps/s |",
        f"| predicted throughput | {a.throughput:.4g} steps/s |",
        f"| predicted energy to completion | {kwh(a.energy_j):.4g} kWh |",
        f"| work | {job.work_steps:,} steps |",
        f"| policy | {placement.policy} ({placement.status}, {placement.solve_ms:.1f} ms) |",
        f"| waited for a GPU | {waited_s:.1f} s |",
        f"| predictors | P1 v{versions.get('p1')}, P2 v{versions.get('p2')} |",
        "",
    ]
    if ex is not None and ex.alternatives:
        lines += ["**Runner-ups** (feasible, not chosen)", "",
                  "| where | predicted steps/s | predicted kWh |", "| --- | ---: | ---: |"]
        lines += [f"| {c.where} | {c.throughput:.4g} | {kwh(c.energy_j):.4g} |" for c in ex.alternatives[:3]]
        lines.append("")
    if ex is not None and any(ex.rejected.values()):
        lines.append("**Rejected slots:** " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(ex.rejected.items()) if n))
    lines += ["", f"Fleet: {len(problem.gpus)} GPUs ({', '.join(problem.gpu_types)}), "
              f"{len(problem.running)} runs already placed."]
    return "\n".join(lines)


__all__ = ["PlacementTimeout", "RunPlacement", "decide", "explain_markdown",
           "place_with_retry", "running_jobs"]

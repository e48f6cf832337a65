"""One placement decision for one flow run, against the live occupancy of the pool.

The decision is solved on the predicted throughputs of the new run *and* of every run
already on the fleet (read from the pool's ledger, which every process placing onto the pool
shares), so a new run is never put next to a job it would push below its requirement.
Solving and claiming are two steps; the claim is compare-and-set on the version of the GPU
the decision saw, so when another run changed that GPU in between, the claim is refused and
the decision is taken again on the new state.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gogh_flows.energy import kwh
from gogh_flows.workloads.job import JobSpec
from gogh_flows.placement import Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.patience import Patience, hold_for_efficiency
from gogh_flows.placement.problem import LimitEvidence
from gogh_flows.placement.result import Assignment, Placement
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.leases import Claim, LedgerState
from gogh_flows.truth.table import ThroughputTable
from gogh_flows.workloads.features import WorkloadFeatures


class PlacementError(RuntimeError):
    """A run could not be placed."""


class PlacementTimeout(PlacementError):
    """No GPU met the run's requirement within its wait timeout (the fleet was busy)."""


class InfeasibleRequirement(PlacementError):
    """No GPU type of the fleet can meet the run's requirement, even empty: waiting would not help."""


class PlacementCancelled(PlacementError):
    """The run's caller was cancelled (an async flow's timeout or cancel) while it was being placed."""


class RunLost(RuntimeError):
    """A placed run lost its GPU while it ran or waited to start (its worker left the pool).

    ``worker_reports``: the worker lived on (Dask cancelled the run because this process's
    connection to the scheduler dropped) and hands in the measurement of what the body did.
    ``scheduler_silent``: given up because the pool's scheduler did not answer; the body may
    run on, so it is asked to stop and hand in its measurement once the scheduler answers.
    """

    def __init__(self, message: str, *, worker_reports: bool = False, scheduler_silent: bool = False) -> None:
        super().__init__(message)
        self.worker_reports = worker_reports
        self.scheduler_silent = scheduler_silent


class Ledger(Protocol):
    """What a placement needs of the pool's ledger (:class:`gogh_flows.runtime.PoolLedger`)."""

    def state(self, *, timeout_s: float | None = None) -> LedgerState: ...

    def claim(self, run_id: str, gpu_id: str, *, worker: str, capacity: int, job_type: str,
              required_throughput: float, work: float, expect_version: int,
              timeout_s: float | None = None, power_limit_w: float | None = None) -> Claim: ...


@dataclass(frozen=True)
class RunPlacement:
    """Where a run goes and what was predicted for it there (also what ``current_placement`` shows).

    ``partner_runs`` are the runs the decision saw on that GPU (ledger run ids), with the
    throughput predicted for each of them next to this run (``partner_predicted``) and what
    each requires: the record that lets anyone check a shared GPU was shared knowingly.
    """

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
    partner_runs: tuple[str, ...] = ()
    partner_predicted: tuple[float, ...] = ()
    partner_required: tuple[float, ...] = ()
    power_limit_w: float | None = None  # the board limit chosen with it (None: the maximum, nothing set)
    #: that limit is a trial: one level below the best its job type's runs measured (its predicted
    #: throughput is the rate measured above it, a hope rather than a prediction)
    limit_trial: bool = False
    limit_saving_j: float = 0.0  # predicted energy saved by that limit against the board's previous one
    #: the chosen option and the runner-ups as rows (the Prefect table artifact)
    options: tuple[dict, ...] = ()
    #: the policy's risk level: slots were compared at the lower end of the refiner's interval at
    #: it, so ``predicted_throughput`` is that bound; ``point_throughput`` is the point prediction
    #: of the same slot (None: no risk level, the two are one)
    risk_level: float | None = None
    point_throughput: float | None = None


def with_point_prediction(placement: RunPlacement, point: ThroughputTable, planned: ThroughputTable,
                          risk_level: float) -> RunPlacement:
    """``placement`` decided on ``planned`` (the lower ends at ``risk_level``), with the point
    prediction of its slot from ``point`` (the same predictions without the risk level).

    The bound is what the decision was held to; the point is what the predictors expect, the
    figure a measurement is scored against (else every error at a risk level is biased low by
    the margin). The ratio of the two tables' entries for the chosen slot carries over the power
    limit's slowdown, which scales both alike; a measured entry is its measurement in both. A
    trial's rate is a measurement (the rate its type measured one level up), so it stays as it is.
    """
    job, gpu = placement.job_type, placement.gpu_type
    try:
        if placement.limit_trial:
            ratio = 1.0
        elif len(placement.partners) == 1:
            ratio = point.pair(job, placement.partners[0], gpu)[0] / planned.pair(job, placement.partners[0], gpu)[0]
        else:
            ratio = point.isolated(job, gpu) / planned.isolated(job, gpu)
    except (KeyError, ValueError, ZeroDivisionError):  # no such entry: say so rather than guess
        ratio = math.nan
    expected = placement.predicted_throughput * ratio if math.isfinite(ratio) and ratio > 0 else None
    note = (f"\n\n**Risk level {risk_level:g}:** slots were compared at the lower end of the refiner's "
            f"{risk_level:.0%} interval (a measured entry at its measurement), so the predicted throughput above "
            "is that bound" + (f"; the point prediction for this slot is {expected:.4g} steps/s." if expected
                               else "."))
    return dataclasses.replace(placement, risk_level=risk_level, point_throughput=expected,
                               explanation_md=placement.explanation_md + note)


def running_jobs(state: LedgerState, gpu_ids: set[str], headroom: float = 0.0) -> list[Job]:
    """Ledger leases on ``gpu_ids`` -> running jobs with their estimated remaining work."""
    jobs = []
    for lease in state.leases:
        if lease.gpu_id not in gpu_ids:
            continue
        elapsed = max(0.0, state.now - (lease.started_at or lease.claimed_at))
        remaining = max(1.0, lease.work - lease.required_throughput * elapsed)
        jobs.append(Job(lease.run_id, lease.job_type, lease.required_throughput * (1 + headroom), remaining, 1,
                        (lease.gpu_id,), lease.power_limit_w))
    return jobs


def decide(
    job: JobSpec, run_id: str, devices: Sequence[GpuDevice], running: list[Job],
    table: ThroughputTable, policy: str, time_limit_s: float, headroom: float = 0.0,
    power_limit_levels: Sequence[float] = (),
    limit_evidence: LimitEvidence | None = None,
    limit_trials: bool = True,
    measuring: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[Placement, PlacementProblem]:
    """``headroom``: what the new run's requirement is raised by (the running jobs' come raised)."""
    gpus = [Gpu(d.id, d.gpu_type, d.capacity) for d in devices]
    new = Job(run_id, job.job_type, job.required_throughput * (1 + headroom), float(job.work_steps))
    problem = PlacementProblem.build(gpus, [*running, new], table, power_limit_levels=tuple(power_limit_levels),
                                     limit_evidence=limit_evidence, limit_trials=limit_trials,
                                     measuring=measuring)
    options = {"time_limit_s": time_limit_s} if policy == "optimizer" else {}
    return get_policy(policy, **options).place(problem), problem


def _infeasible_message(job: JobSpec, best: float, types: Sequence[str]) -> str:
    if not best > 0:
        return (f"{job.job_type!r} does not fit in the memory of any GPU type of this fleet "
                f"({', '.join(types)}) by the predictions; use a smaller batch_size, or add a GPU type "
                "with more memory")
    return (f"no GPU type of this fleet ({', '.join(types)}) can run {job.job_type!r} at its required "
            f"{job.required_throughput:g} steps/s, even alone: the best predicted throughput is {best:.4g} "
            "steps/s. Lower min_throughput, or add a faster GPU type")


def place_with_retry(
    job: JobSpec, run_id: str, *, devices: Callable[[LedgerState], Sequence[GpuDevice]], ledger: Ledger,
    predict: Callable[[dict[str, WorkloadFeatures]], ThroughputTable],
    features: Callable[[str], WorkloadFeatures], policy: str, time_limit_s: float,
    wait_timeout_s: float, poll_s: float, versions: dict, on_wait: Callable[[str], None] | None = None,
    sleep: Callable[[float], object] = time.sleep, headroom: float = 0.0, headroom_wait_s: float = math.inf,
    placement_timeout_s: float = math.inf, power_limit_levels: Sequence[float] = (),
    patience: Patience | None = None,
    limit_evidence: LimitEvidence | Callable[[], LimitEvidence] | None = None,
    limit_trials: bool = True,
    measuring: Callable[[], frozenset[tuple[str, str]]] = frozenset,
) -> RunPlacement:
    """Read the ledger, solve, claim by compare-and-set; decide again when the claim is refused.

    A claim names the version of the chosen GPU the decision saw: if another run claimed or
    freed a slot there in between, the claim is refused and the decision is taken again on
    the new state, so a run is never put next to a partner its decision did not see. A
    requirement no GPU type can meet fails at once; a busy fleet is waited for (``sleep``
    returns early when a run of this process frees its GPU) up to ``wait_timeout_s``. Each
    decision between two such waits (ledger calls, predictions, solves, and the claims
    refused and re-planned in a row) is bounded by ``placement_timeout_s``, each call to the
    pool's scheduler included. With ``patience``, a run whose best option now is clearly less
    efficient than a busy GPU type waits for it, up to ``patience.max_wait_s`` from its start
    (:func:`gogh_flows.placement.patience.hold_for_efficiency`). ``limit_evidence``: what runs
    at lowered limits measured (``PlacementProblem.limit_evidence``), or a function reading it, called
    for every decision so that a run that waited is placed on what the runs before it measured
    meanwhile; ``limit_trials``: whether a run may try the level below the best of them;
    ``measuring``: the (job type, GPU type) of this process's runs whose measurement is still to
    come (``PlacementProblem.measuring``). ``headroom`` raises every
    requirement the decision checks; a run waits for a GPU that clears its own so raised for up to
    ``headroom_wait_s`` (at most half of ``wait_timeout_s``), then is planned against its requirement itself,
    as it is at once when no GPU type of the fleet could clear it.
    """
    start = time.monotonic()
    said_waiting = False
    attempts, refused = 0, 0
    deciding_since = start  # reset after each wait for the fleet; refused claims add up

    def left_to_decide() -> float:
        deciding = time.monotonic() - deciding_since
        if deciding >= placement_timeout_s:
            raise PlacementTimeout(
                f"deciding where run {run_id} ({job.job_type}) goes took {deciding:.1f} s ({attempts} "
                f"decision(s) in all, {refused} claim(s) refused because another run changed the GPU first), more "
                f"than placement_timeout_s={placement_timeout_s:g} s; the pool's scheduler or this process "
                "is overloaded. Raise placement_timeout_s on the PlacementPolicy block, or check the "
                "scheduler's load")
        return placement_timeout_s - deciding

    def ask(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        budget = left_to_decide()
        try:
            return call(*args, timeout_s=budget, **kwargs)
        except TimeoutError as exc:  # asyncio's too, since Python 3.11
            raise PlacementTimeout(
                f"the pool's scheduler did not answer {getattr(call, '__name__', 'a call')}() for run {run_id} "
                f"within {budget:.1f} s (what was left of placement_timeout_s={placement_timeout_s:g} s); "
                "check that the scheduler is alive and not overloaded") from exc

    held_note: str | None = None  # why the run was first held for an efficient GPU, if it was
    said_unheld = said_headroom = False
    # at most half the wait holds out for the headroom: the rest may take any GPU meeting the requirement
    headroom_for_s = min(headroom_wait_s, wait_timeout_s / 2)
    while True:
        state = ask(ledger.state)
        attempts += 1
        held: dict[str, str] = {}  # this decision's hold for an efficient GPU, if any
        live = list(devices(state))
        elapsed = time.monotonic() - start
        if not live:
            reason, best = "no GPU of the pool has a live worker", math.nan
        else:
            running = running_jobs(state, {d.id for d in live}, headroom)
            types = {j.job_type for j in running} | {job.job_type}
            feats = {t: (job.features if t == job.job_type else features(t)) for t in types}
            table = predict(feats)
            # the headroom holds out for a GPU that clears the raised requirement only so long: a GPU
            # that meets the requirement itself is not left idle for the whole wait_timeout_s
            own = headroom if elapsed < headroom_for_s else 0.0
            # the pending marks first: a run's mark ends only after its record is in the table, so
            # evidence read after an empty mark has that record. Read the other way round, a record
            # landing between the two reads left old evidence and no mark, and the trial its run
            # had just measured was offered again
            pending = measuring()
            evidence = limit_evidence() if callable(limit_evidence) else limit_evidence
            placement, problem = decide(job, run_id, live, running, table, policy, time_limit_s, own,
                                        power_limit_levels, evidence, limit_trials, pending)
            short = next((w for w in placement.waiting if w.job_id == run_id), None)
            if (short is not None and own > 0
                    and job.required_throughput <= short.best_throughput < job.required_throughput * (1 + own)):
                # no type of the fleet clears it with headroom, but some clear it exactly: plan
                # without rather than wait for a GPU that cannot exist
                placement, problem = decide(job, run_id, live, running, table, policy, time_limit_s, 0.0,
                                            power_limit_levels, evidence, limit_trials, pending)
            elif own == 0 < headroom and said_waiting and not said_headroom and on_wait is not None:
                on_wait(f"run {run_id}: no GPU cleared its requirement with the policy's headroom ({headroom:.0%}) "
                        f"within {headroom_for_s:g} s; from now on it takes one predicted to "
                        "meet the requirement itself")
                said_headroom = True
            if patience is not None:
                placement, held = hold_for_efficiency(placement, problem, {run_id: elapsed}, patience)
                if run_id in held and held_note is None:
                    held_note = f"from {elapsed:.1f} s: {held[run_id]}"
            if run_id in placement.placed_ids:
                a = placement.assignment(run_id)
                gpu_id = a.gpus[0]
                device = next(d for d in live if d.id == gpu_id)
                claim = ask(ledger.claim, run_id, gpu_id, worker=device.worker, capacity=device.capacity,
                            job_type=job.job_type, required_throughput=job.required_throughput,
                            work=float(job.work_steps), expect_version=state.version(gpu_id),
                            power_limit_w=a.power_limit_w)
                if not claim.ok and claim.reason == "released":  # never again for this run id: not a busy GPU
                    raise PlacementCancelled(f"run {run_id}'s claim was refused: {claim.detail}")
                if not claim.ok:
                    refused += 1
                    continue  # the GPU changed (or filled) since the decision: decide again
                others = [j for j in problem.occupants(gpu_id) if j.id != run_id]
                waited = time.monotonic() - start
                if held_note is not None and on_wait is not None and not said_unheld:
                    on_wait(f"run {run_id}: its wait for an efficient GPU is over after {waited:.1f} s; placed "
                            f"on {gpu_id} ({a.gpu_type})")
                return RunPlacement(
                    run_id=run_id, job_type=job.job_type, gpu_id=gpu_id, gpu_type=a.gpu_type,
                    required_throughput=job.required_throughput, predicted_throughput=a.throughput,
                    predicted_energy_j=a.energy_j, partners=tuple(j.job_type for j in others),
                    policy=placement.policy, solve_ms=placement.solve_ms, waited_s=waited,
                    predictor_versions=dict(versions),
                    explanation_md=explain_markdown(job, run_id, placement, problem, gpu_id, waited, versions,
                                                    held_note),
                    options=explain_rows(job, run_id, placement, gpu_id),
                    partner_runs=tuple(j.id for j in others),
                    # at the board's new limit: what the partner gets once this run joins
                    partner_predicted=tuple(a.partner_throughput if j.id == a.partner and a.partner_throughput
                                            is not None else problem.throughputs.pair(j, problem.job(run_id),
                                                                                      a.gpu_type)[0]
                                            for j in others),
                    partner_required=tuple(j.required_throughput / (1 + headroom) for j in others),
                    power_limit_w=a.power_limit_w, limit_trial=limit_trial(problem, run_id, a),
                    limit_saving_j=ex.chosen.limit_saving_j if (ex := placement.explanations.get(run_id))
                    and ex.chosen else 0.0,
                )
            waiting = next((w for w in placement.waiting if w.job_id == run_id), None)
            reason = waiting.reason if waiting else "not placed"
            best = waiting.best_throughput if waiting else math.nan
            if not best >= job.required_throughput:
                raise InfeasibleRequirement(_infeasible_message(job, best, sorted({d.gpu_type for d in live})))
        if elapsed >= wait_timeout_s:
            if not live:  # nothing was predicted: a busy fleet it is not
                raise PlacementTimeout(
                    f"no GPU could run {job.job_type!r} within {wait_timeout_s:g} s: no worker of the pool was "
                    "alive to run it. Start its workers (one per GPU: `dask worker ADDRESS --name v100-0 --resources "
                    "slot=2`, docs/runtime.md), see which answer with `gogh pool status ADDRESS`, or raise "
                    "wait_timeout_s")
            raise PlacementTimeout(
                f"no GPU could run {job.job_type!r} at its required {job.required_throughput:g} steps/s "
                f"within {wait_timeout_s:g} s ({reason}); the fleet can run it (best predicted "
                f"{best:.4g} steps/s) but was busy. Raise wait_timeout_s, or add GPUs")
        if on_wait is not None and not said_waiting:
            if live:
                planned = _planned(problem, run_id)
                # the clock runs from the placement's start (loading the predictors counts): the time left
                left = max(0.0, headroom_for_s - (time.monotonic() - start))
                raised = (f", planned against {planned:.4g} with the policy's headroom for {left:.0f} s more "
                          f"({headroom_for_s:g} s from the placement's start)" if planned > job.required_throughput
                          else "")
                why = (f"{reason} (best predicted {best:.4g} steps/s, required "
                       f"{job.required_throughput:g}{raised})")
            else:
                why = f"{reason} (required {job.required_throughput:g} steps/s)"
            on_wait(f"run {run_id} waits for a GPU: {why}; retrying every {poll_s:g} s for up to "
                    f"{wait_timeout_s:g} s")
            said_waiting = True
        if held_note is not None and run_id not in held and on_wait is not None and not said_unheld:
            on_wait(f"run {run_id}: its wait for an efficient GPU is over after {elapsed:.1f} s; it takes the "
                    "first GPU that meets its requirement")
            said_unheld = True
        left_to_decide()
        # a run held for an efficient GPU looks again when its patience runs out, not a poll later
        until = min(wait_timeout_s, patience.max_wait_s) if run_id in held else wait_timeout_s
        sleep(min(poll_s, max(0.0, until - elapsed)))
        deciding_since = time.monotonic()


def explain_rows(job: JobSpec, run_id: str, placement: Placement, gpu_id: str) -> tuple[dict, ...]:
    """The chosen option and the runner-ups, one row each, in the units people read (steps/s, kWh, W)."""
    a = placement.assignment(run_id)
    ex = placement.explanations.get(run_id)

    def row(rank: str, where: str, gpu_type: str, throughput: float, energy_j: float, limit_w: float | None,
            why: str) -> dict:
        return {"rank": rank, "where": where, "gpu_type": gpu_type, "predicted_steps_per_s": round(throughput, 4),
                "required_steps_per_s": round(job.required_throughput, 4), "predicted_kwh": round(kwh(energy_j), 6),
                "power_limit_w": limit_w, "not_chosen_because": why}

    rows = [row("chosen", f"{gpu_id} ({a.gpu_type})" + (f" with {a.partner}" if a.partner else ", alone"),
                a.gpu_type, a.throughput, a.energy_j, a.power_limit_w, "")]
    def costlier(energy_j: float) -> str:
        """Why an option the decision did not take lost, by the figure it lost on."""
        if a.energy_j > 0 and energy_j > a.energy_j * (1 + 1e-6):
            return f"predicted to use {energy_j / a.energy_j - 1:.0%} more energy"
        if a.energy_j > 0 and energy_j < a.energy_j * (1 - 1e-6):  # reasons cover these; said if one did not
            return "predicted to use less energy, not taken in the decision for every arrival at once"
        return "predicted to use as much energy (a tie, broken by the solver)"

    rows += [row(f"runner-up {i + 1}", c.where, c.gpu_type, c.throughput, c.energy_j, c.power_limit_w,
                 placement.runner_up_reason(run_id, c) or costlier(c.energy_j))
             for i, c in enumerate(ex.alternatives[:3] if ex is not None else ())]
    return tuple(rows)


def limit_trial(problem: PlacementProblem, run_id: str, a: Assignment) -> bool:
    """Whether the run was placed alone at its type's trial limit (``PlacementProblem.probe_limit``)."""
    return (a.power_limit_w is not None and a.partner is None
            and not [j for j in problem.occupants(a.gpus[0]) if j.id != run_id]
            and a.power_limit_w == problem.probe_limit(problem.job(run_id), a.gpu_type))


def _evidence_text(problem: PlacementProblem, job_type: str, gpu_type: str) -> str:
    """What runs of ``job_type`` measured at lowered limits on ``gpu_type``, for the explanation."""
    points = problem.limit_evidence.get((job_type, gpu_type), ())
    return ", ".join(f"{p[0]:g} W: {p[1]:.4g} steps/s" + (f" at {p[2]:.0f} W drawn" if len(p) > 2 else "")
                     for p in sorted(points))


def _planned(problem: PlacementProblem, run_id: str) -> float:
    """The throughput the decision held the run to: its requirement plus any headroom."""
    return next(j.required_throughput for j in problem.jobs if j.id == run_id)


def _partner_limit(problem: PlacementProblem, run_id: str, gpu_id: str, a: Any) -> str:
    """A join that changes the board's limit changes its partner's: said, with the limit it had."""
    before = [j.power_limit_w for j in problem.occupants(gpu_id) if j.id != run_id]
    if not before or before[0] == a.power_limit_w:
        return ""
    was = "full power" if before[0] is None else f"{before[0]:g} W"
    return f"; a board has one limit, so its partner runs at it too (it ran at {was})"


def _rejected_types(problem: PlacementProblem, run_id: str) -> str:
    """The GPU types ruled out for the run on its own figures, with the prediction that ruled them out.

    A count alone ("1 too slow") left a user guessing which board, and by how much (a new-user
    review); the reasons that depend on partners stay counts.
    """
    job = next(j for j in problem.jobs if j.id == run_id)
    slow, no_memory = [], []
    for t in problem.gpu_types:
        iso = problem.throughputs.isolated(job, t)
        if iso <= 0:
            no_memory.append(t)
        elif iso < job.required_throughput:
            slow.append(f"{t} {iso:.3g} steps/s")
    said = ([f"too slow alone: {', '.join(slow)} predicted, under {job.required_throughput:.4g}"] if slow else []) + (
        [f"too little memory: {', '.join(no_memory)}"] if no_memory else [])
    return f" ({'; '.join(said)})" if said else ""


def explain_markdown(job: JobSpec, run_id: str, placement: Placement, problem: PlacementProblem,
                     gpu_id: str, waited_s: float, versions: dict, held_note: str | None = None) -> str:
    """The Prefect artifact: chosen slot, its predicted figures, runner-ups, and rejections;
    ``held_note``: why the run was held for an efficient GPU while it waited, if it was."""
    a = placement.assignment(run_id)
    ex = placement.explanations.get(run_id)
    partners = [f"`{j.job_type}` ({j.id})" for j in problem.occupants(gpu_id) if j.id != run_id]
    partner_limit = _partner_limit(problem, run_id, gpu_id, a)
    lines = [
        f"### Placement of `{job.job_type}`",
        "",
        f"**{gpu_id}** ({a.gpu_type})" + (f", sharing with {', '.join(partners)}" if partners else ", alone"),
        "",
        "| | value |", "| --- | ---: |",
        f"| required throughput | {job.required_throughput:.4g} steps/s |",
        *([f"| planned against | {planned:.4g} steps/s (the policy's headroom of "
           f"{planned / job.required_throughput - 1:.0%}: slots predicted below this count as too slow) |"]
          if (planned := _planned(problem, run_id)) > job.required_throughput * (1 + 1e-9) else []),
        f"| predicted throughput | {a.throughput:.4g} steps/s |",
        f"| predicted energy to completion | {kwh(a.energy_j):.4g} kWh |",
        *([f"| power limit | {a.power_limit_w:g} W (saves {kwh(ex.chosen.limit_saving_j):.4g} kWh "
           f"predicted, against the board's previous limit){partner_limit} |"]
          if a.power_limit_w is not None and ex is not None and ex.chosen is not None else
          [f"| power limit | full power{partner_limit} |"] if a.power_limit_w is None and partner_limit else []),
        *([f"| measured at lowered limits | {measured} (a level measured below "
           f"{_planned(problem, run_id):.4g} steps/s, what this run is planned against, is not offered; nor "
           "is any below it) |"] if (measured := _evidence_text(problem, job.job_type, a.gpu_type)) else []),
        *([f"| trying a lower limit | {a.power_limit_w:g} W is one level below the best limit runs of this type "
           "measured here, offered at the rate measured there; if this run falls below its requirement, the "
           "worker lifts the limit, and later runs take the level only if this run measured at least the "
           "throughput planned against |"] if limit_trial(problem, run_id, a) else []),
        f"| work | {job.work_steps:,} steps |",
        f"| policy | {placement.policy} ({placement.status}, {placement.solve_ms:.1f} ms) |",
        f"| waited for a GPU | {waited_s:.1f} s |",
        *([f"| held for an efficient GPU | {held_note} |"] if held_note else []),
        f"| predictors | P1 v{versions.get('p1')}, P2 v{versions.get('p2')} |",
        "",
    ]
    if ex is not None and ex.alternatives:
        lines += ["**Runner-ups** (feasible, not chosen)", "",
                  "| where | predicted steps/s | predicted kWh |", "| --- | ---: | ---: |"]
        lines += [f"| {c.where} | {c.throughput:.4g} | {kwh(c.energy_j):.4g} |" for c in ex.alternatives[:3]]
        lines.append("")
        why = placement.runner_up_reason(run_id)
        if why:
            lines += [f"The first runner-up is predicted cheaper for this run alone; not chosen because {why}.", ""]
    if ex is not None and any(ex.rejected.values()):
        lines.append("**Rejected slots:** " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(ex.rejected.items()) if n) + _rejected_types(problem, run_id))
    lines += ["", f"Fleet: {len(problem.gpus)} GPUs ({', '.join(problem.gpu_types)}), "
              f"{len(problem.running)} runs already placed."]
    return "\n".join(lines)


__all__ = ["InfeasibleRequirement", "Ledger", "PlacementError", "PlacementTimeout", "RunLost", "RunPlacement",
           "decide", "explain_markdown", "explain_rows", "place_with_retry", "running_jobs", "with_point_prediction"]

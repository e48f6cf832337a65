"""Waiting for an efficient GPU: a placement may hold a new job back rather than run it wastefully.

Why: a job placed the moment it arrives takes whatever is free. When the GPU type that would
run it for much less energy is busy, and the job can wait (its requirement is a rate while it
runs, not a deadline), starting it later on that type can save more than the wait costs.
Energy-aware schedulers defer work for the same reason (to cleaner hours, to free efficient
machines); here the trade is explicit and bounded: a job is held only while it has waited
less than ``max_wait_s`` and only when a GPU type that is busy now would, once free, run it
alone for at least ``min_saving`` less energy than alone where it was placed (both at their
best power limit, by the problem's own predictions). Past ``max_wait_s`` it takes what the
placement offers. The cost is completion time, reported beside the energy it saved.

A hold is a bet that the type frees a GPU in time. With ``within_reach`` it is only made where
the running jobs' predicted remaining times, and the jobs already held for that type ahead of
this one, say a GPU of it frees before the job's patience runs out; otherwise a job behind a
long line waits its whole ``max_wait_s``. It is off by default: on seeds no report uses it
saved completion time and cost energy (``benchmarks/hold_reach.py``; docs/optimizer.md), since a
job whose wait runs out is placed on what has freed meanwhile, often better than what was free
at its arrival.

A pure function over a placement that has been decided: any policy can be made patient, and
the per-arrival path stays as fast as it was (the check is a handful of energy evaluations
per held candidate).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from gogh_flows.energy import EnergyModel
from gogh_flows.placement.options import FleetState, least_alone
from gogh_flows.placement.problem import Job, PlacementProblem
from gogh_flows.placement.result import Placement, Waiting

#: the reason a held job is waiting (a prefix: the rest says for what)
HELD = "held for an efficient GPU"


@dataclass(frozen=True)
class Patience:
    """How long a new job may wait for a GPU type that runs it for clearly less energy."""

    max_wait_s: float
    min_saving: float = 0.1  # the best type must save at least this share of the energy now
    #: hold only for a type predicted to free a GPU for the job before its patience runs out
    within_reach: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            raise ValueError(f"max_wait_s must be a number of seconds >= 0 (0: never hold), got {self.max_wait_s!r}")
        if not 0 < self.min_saving < 1:
            raise ValueError(f"min_saving must be a share of energy in (0, 1), got {self.min_saving!r}")


@dataclass
class HeldAhead:
    """The jobs already held, in queue order: (GPU type, GPUs, predicted seconds there) each.

    A caller deciding its queue in parts (the simulator's chunks) passes one through every part
    of one pass, so a job behind a line of held jobs sees the line."""

    jobs: list[tuple[str, int, float]] = field(default_factory=list)


def _free_times(problem: PlacementProblem, state: FleetState, gpu_type: str) -> list[float]:
    """Seconds until each GPU of ``gpu_type`` is empty, by the problem's predictions at the
    board's limit (a pair runs at its shared rates until one ends, the other then alone)."""
    thr, energy = problem.throughputs, problem.energy
    out = []
    for g in problem.gpus:
        if g.gpu_type != gpu_type:
            continue
        occ = state.occupants[g.id]
        if not occ:
            out.append(0.0)
            continue
        if len(occ) == 1:
            (j,) = occ
            rates = (thr.isolated(j, gpu_type),)
            p0 = energy.power_alone(gpu_type, thr.activity(j, gpu_type))
        else:
            a, b = occ[:2]
            rates = thr.pair(a, b, gpu_type)
            iso = (thr.isolated(a, gpu_type), thr.isolated(b, gpu_type))
            p0 = energy.power_shared(gpu_type, tuple(
                (thr.activity(j, gpu_type), r / i if i > 0 else 1.0) for j, r, i in zip(occ, rates, iso)))
        slow = energy.at_limit(gpu_type, p0, state.limit(g.id))[0]
        if not all(r > 0 for r in rates):
            out.append(math.inf)
            continue
        ends = [j.work * slow / r for j, r in zip(occ, rates)]
        if len(ends) == 2:  # the survivor's steps left go at its own rate once alone
            first = min(range(2), key=ends.__getitem__)
            survivor, shared = occ[1 - first], rates[1 - first]
            alone = thr.isolated(survivor, gpu_type)
            left = survivor.work - ends[first] * shared / slow
            ends = [ends[first] + (left * slow / alone if alone > 0 else math.inf)]
        out.append(ends[0])
    return out


def _reserve(heap: list[float], n: int, seconds: float) -> float:
    """Take the ``n`` earliest-free GPUs of ``heap`` for a job of ``seconds`` (first come, first
    served; they are busy again until it ends); when it starts, ``inf`` if there are too few."""
    if len(heap) < n:
        return math.inf
    start = max(heapq.heappop(heap) for _ in range(n))
    for _ in range(n):
        heapq.heappush(heap, start + seconds)
    return start


def _line(free: list[float], ahead: list[tuple[int, float]]) -> list[float]:
    """When each GPU is free again once the jobs ``ahead`` ((GPUs, seconds) each) have had theirs."""
    heap = list(free)
    heapq.heapify(heap)
    for n, seconds in ahead:
        _reserve(heap, n, seconds)
    return heap


def hold_for_efficiency(placement: Placement, problem: PlacementProblem, waited_s: Mapping[str, float],
                        patience: Patience, *, energy: EnergyModel | None = None,
                        ahead: HeldAhead | None = None) -> tuple[Placement, dict[str, str]]:
    """``placement`` without the assignments of jobs worth holding, and why each was held.

    ``waited_s`` names the jobs that may be held (new jobs, not yet started) with how long
    each has waited; any other assignment is kept, and so is a job that shares a board (a
    join, or half of a new pair: its partner was placed counting on it). A job is held for a
    GPU type that has no free GPUs for it once the placement is applied (waiting for a type
    that is free would change nothing) and that could ever take it (a gang needs as many
    GPUs of one type and capacity), when running alone there would cost at most
    ``1 - min_saving`` of running alone where it was placed, both at their best power limit,
    and (``patience.within_reach``) when that type is predicted to free GPUs for it, behind the
    jobs held before it (``ahead``, extended with this call's holds), before its patience runs
    out. ``energy`` is what a decision changes (default the problem's; an always-on fleet pays its
    idle draw either way, so the simulator passes a model without it). A held job moves to
    the placement's ``waiting`` with a reason that names the type and the saving; the dict
    returned says the same without the ``HELD`` prefix and the time left (what a run reports
    once it has been placed).
    """
    if patience.max_wait_s <= 0 or not placement.assignments:
        return placement, {}
    energy = energy or problem.energy
    ahead = ahead if ahead is not None else HeldAhead()
    jobs = {j.id: j for j in problem.jobs}
    paired = {a.job_id for a in placement.assignments if a.partner is not None}
    paired |= {a.partner for a in placement.assignments if a.partner is not None}
    state = FleetState(problem)
    for a in placement.assignments:
        state.add(jobs[a.job_id], a.gpus, a.power_limit_w)
    free = state.free_by_class()
    size: dict[tuple[str, int], int] = Counter((g.gpu_type, g.capacity) for g in problem.gpus)
    lines: dict[str, list[float]] = {}  # per type: when each GPU frees, behind the line (within_reach)
    keep, held, left = [], {}, {}
    for a in placement.assignments:
        waited = waited_s.get(a.job_id)
        if waited is None or waited >= patience.max_wait_s or a.job_id in paired:
            keep.append(a)
            continue
        job = jobs[a.job_id]

        def expected_start(gpu_type: str) -> float:
            """Predicted seconds until GPUs of ``gpu_type`` free for the job, behind the line (0:
            not asked, ``within_reach`` off)."""
            if not patience.within_reach:
                return 0.0
            if gpu_type not in lines:
                lines[gpu_type] = _line(_free_times(problem, state, gpu_type),
                                        [(n, s) for t, n, s in ahead.jobs if t == gpu_type])
            heap = lines[gpu_type]
            return max(heapq.nsmallest(job.num_gpus, heap)[-1], 0.0) if len(heap) >= job.num_gpus else math.inf

        busy = {t for (t, _), n in size.items() if n >= job.num_gpus} - {
            t for (t, _), ids in free.items() if len(ids) >= job.num_gpus}
        here = _alone(problem, energy, job, a.gpu_type)[0]
        time_left = patience.max_wait_s - waited
        options = sorted(((*_alone(problem, energy, job, t), t) for t in busy - {a.gpu_type}),
                         key=lambda o: (o[0], o[2]))  # least energy first, ties by type name
        worth = ((e, s, t) for e, s, t in options if math.isfinite(here) and e <= (1 - patience.min_saving) * here)
        pick = next(((e, s, t, start) for e, s, t in worth if (start := expected_start(t)) <= time_left), None)
        if pick is not None:
            best, seconds, where, start = pick
            when = f", predicted to free a GPU for it in about {start:.0f} s" if patience.within_reach else ""
            held[a.job_id] = f"{where} would use {1 - best / here:.0%} less energy than {a.gpu_type} now{when}"
            left[a.job_id] = time_left
            ahead.jobs.append((where, job.num_gpus, seconds))
            if patience.within_reach:
                if where in lines:
                    _reserve(lines[where], job.num_gpus, seconds)
                # the GPU it was placed on is not taken after all: the jobs after it see it free
                for gid in a.gpus:
                    state.occupants[gid].remove(job)
                lines.pop(a.gpu_type, None)
        else:
            keep.append(a)
    if not held:
        return placement, {}
    best_tput = {j: max((problem.throughputs.isolated(jobs[j], t) for t in problem.gpu_types), default=0.0)
                 for j in held}
    waiting = (*placement.waiting, *(Waiting(j, f"{HELD}: {why}; waiting up to {left[j]:.0f} s more", best_tput[j])
                                     for j, why in held.items()))
    return dataclasses.replace(placement, assignments=tuple(keep), waiting=waiting), held


def _alone(problem: PlacementProblem, energy: EnergyModel, job: Job, gpu_type: str) -> tuple[float, float]:
    """(least energy for the job alone on an empty ``gpu_type`` meeting its requirement, seconds
    it runs there at that limit); ``(inf, inf)`` where the type cannot meet it."""
    e, _, rate = least_alone(problem, energy, job, gpu_type, job.work, problem.limit_levels(gpu_type))
    return e, (job.work / rate if rate > 0 else math.inf)


__all__ = ["HELD", "HeldAhead", "Patience", "hold_for_efficiency"]

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

A pure function over a placement that has been decided: any policy can be made patient, and
the per-arrival path stays as fast as it was (the check is a handful of energy evaluations
per held candidate).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from gogh_flows.energy import EnergyModel
from gogh_flows.placement.options import FleetState, least_alone_energy
from gogh_flows.placement.problem import PlacementProblem
from gogh_flows.placement.result import Placement, Waiting

#: the reason a held job is waiting (a prefix: the rest says for what)
HELD = "held for an efficient GPU"


@dataclass(frozen=True)
class Patience:
    """How long a new job may wait for a GPU type that runs it for clearly less energy."""

    max_wait_s: float
    min_saving: float = 0.1  # the best type must save at least this share of the energy now

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_wait_s) and self.max_wait_s >= 0):
            raise ValueError(f"max_wait_s must be a number of seconds >= 0 (0: never hold), got {self.max_wait_s!r}")
        if not 0 < self.min_saving < 1:
            raise ValueError(f"min_saving must be a share of energy in (0, 1), got {self.min_saving!r}")


def hold_for_efficiency(placement: Placement, problem: PlacementProblem, waited_s: Mapping[str, float],
                        patience: Patience, *, energy: EnergyModel | None = None) -> tuple[Placement, dict[str, str]]:
    """``placement`` without the assignments of jobs worth holding, and why each was held.

    ``waited_s`` names the jobs that may be held (new jobs, not yet started) with how long
    each has waited; any other assignment is kept, and so is a job that shares a board (a
    join, or half of a new pair: its partner was placed counting on it). A job is held for a
    GPU type that has no free GPUs for it once the placement is applied (waiting for a type
    that is free would change nothing) and that could ever take it (a gang needs as many
    GPUs of one type and capacity), when running alone there would cost at most
    ``1 - min_saving`` of running alone where it was placed, both at their best power limit.
    ``energy`` is what a decision changes (default the problem's; an always-on fleet pays its
    idle draw either way, so the simulator passes a model without it). A held job moves to
    the placement's ``waiting`` with a reason that names the type and the saving; the dict
    returned says the same without the ``HELD`` prefix and the time left (what a run reports
    once it has been placed).
    """
    if patience.max_wait_s <= 0 or not placement.assignments:
        return placement, {}
    energy = energy or problem.energy
    jobs = {j.id: j for j in problem.jobs}
    paired = {a.job_id for a in placement.assignments if a.partner is not None}
    paired |= {a.partner for a in placement.assignments if a.partner is not None}
    state = FleetState(problem)
    for a in placement.assignments:
        state.add(jobs[a.job_id], a.gpus, a.power_limit_w)
    free = state.free_by_class()
    size: dict[tuple[str, int], int] = Counter((g.gpu_type, g.capacity) for g in problem.gpus)
    keep, held, left = [], {}, {}
    for a in placement.assignments:
        waited = waited_s.get(a.job_id)
        if waited is None or waited >= patience.max_wait_s or a.job_id in paired:
            keep.append(a)
            continue
        job = jobs[a.job_id]

        def alone(gpu_type: str) -> float:
            return least_alone_energy(problem, energy, job, gpu_type, job.work, problem.limit_levels(gpu_type))[0]

        busy = {t for (t, _), n in size.items() if n >= job.num_gpus} - {
            t for (t, _), ids in free.items() if len(ids) >= job.num_gpus}
        here = alone(a.gpu_type)
        best, where = min(((alone(t), t) for t in sorted(busy - {a.gpu_type})), default=(math.inf, None))
        if where is not None and math.isfinite(here) and best <= (1 - patience.min_saving) * here:
            held[a.job_id] = f"{where} would use {1 - best / here:.0%} less energy than {a.gpu_type} now"
            left[a.job_id] = patience.max_wait_s - waited
        else:
            keep.append(a)
    if not held:
        return placement, {}
    best_tput = {j: max((problem.throughputs.isolated(jobs[j], t) for t in problem.gpu_types), default=0.0)
                 for j in held}
    waiting = (*placement.waiting, *(Waiting(j, f"{HELD}: {why}; waiting up to {left[j]:.0f} s more", best_tput[j])
                                     for j, why in held.items()))
    return dataclasses.replace(placement, assignments=tuple(keep), waiting=waiting), held


__all__ = ["HELD", "Patience", "hold_for_efficiency"]

"""Waiting for an efficient GPU: a placement may hold a new job back rather than run it wastefully.

Why: a job placed the moment it arrives takes whatever is free. When the GPU type that would
run it for much less energy is busy, and the job can wait (its requirement is a rate while it
runs, not a deadline), starting it later on that type can save more than the wait costs.
Energy-aware schedulers defer work for the same reason (to cleaner hours, to free efficient
machines); here the trade is explicit and bounded: a job is held only while it has waited
less than ``max_wait_s`` and only when a type of the fleet, were a GPU of it free, would run
it alone for at least ``min_saving`` less energy than the option chosen now (both at their
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

from gogh_flows.placement.options import least_alone_energy
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
                        patience: Patience) -> tuple[Placement, dict[str, str]]:
    """``placement`` without the assignments of jobs worth holding, and why each was held.

    ``waited_s`` names the jobs that may be held (new jobs, not yet started) with how long
    each has waited; any other assignment is kept. A held job moves to the placement's
    ``waiting`` with a reason that names the type it waits for and what it would save.
    """
    if patience.max_wait_s <= 0 or not placement.assignments:
        return placement, {}
    fleet = Counter(g.gpu_type for g in problem.gpus)
    jobs = {j.id: j for j in problem.jobs}
    keep, held = [], {}
    for a in placement.assignments:
        waited = waited_s.get(a.job_id)
        if waited is None or waited >= patience.max_wait_s or not a.energy_j > 0:
            keep.append(a)
            continue
        job = jobs[a.job_id]
        best, where = math.inf, None
        for t, n in fleet.items():
            if n >= job.num_gpus and t != a.gpu_type:
                e = least_alone_energy(problem, problem.energy, job, t, job.work, problem.limit_levels(t))[0]
                if e < best:
                    best, where = e, t
        if where is not None and best <= (1 - patience.min_saving) * a.energy_j:
            held[a.job_id] = (f"{HELD}: {where} would use {1 - best / a.energy_j:.0%} less energy than "
                              f"{a.gpu_type} now; waiting up to {patience.max_wait_s - waited:.0f} s more")
        else:
            keep.append(a)
    if not held:
        return placement, {}
    best_tput = {j: max((problem.throughputs.isolated(jobs[j], t) for t in fleet), default=0.0) for j in held}
    waiting = (*placement.waiting, *(Waiting(j, why, best_tput[j]) for j, why in held.items()))
    return dataclasses.replace(placement, assignments=tuple(keep), waiting=waiting), held


__all__ = ["HELD", "Patience", "hold_for_efficiency"]

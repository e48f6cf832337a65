"""Where could a job go, at what predicted cost: the options every policy ranks.

Policies differ only in how they choose among the same options, and every
option is costed with the same energy model, so comparisons between the
optimiser and the baselines are like for like.

Three kinds of option for an arriving job:

* *alone* on free GPUs of a type (a gang takes ``num_gpus`` of them);
* *join* a GPU where one single-GPU job already runs (capacity 2);
* *pair* with another arriving job on a free GPU (built by the optimiser).

The cost of an option is the change in energy to completion of the GPU(s) it
touches, so a join also pays for slowing its partner down.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from gogh_flows.energy import EnergyModel, Occupant
from gogh_flows.placement.problem import Gpu, Informed, Job, PlacementProblem
from gogh_flows.placement.result import (
    FULL,
    HURTS_PARTNER,
    NO_MEMORY,
    NO_SHARING,
    NOT_ENOUGH_GPUS,
    TOO_SLOW,
    Choice,
)


class FleetState:
    """Occupancy while a decision is being made (baselines place one job at a time)."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.problem = problem
        self.occupants: dict[str, list[Job]] = {
            g.id: list(problem.occupants(g.id)) for g in problem.gpus
        }
        self.limits: dict[str, float | None] = {}  # limits set by this decision so far

    def add(self, job: Job, gpus: tuple[str, ...], limit_w: float | None = None) -> None:
        for gid in gpus:
            occ = self.occupants[gid]
            cap = self.problem.gpu(gid).capacity
            if len(occ) >= cap:
                raise RuntimeError(f"GPU {gid} is full; cannot add {job.id}")
            occ.append(job)
            self.limits[gid] = limit_w

    def limit(self, gpu_id: str) -> float | None:
        """The limit the GPU runs at in this state (None: its maximum)."""
        if gpu_id in self.limits:
            return self.limits[gpu_id]
        return self.problem.gpu_limit(gpu_id)

    def free_by_class(self) -> dict[tuple[str, int], list[str]]:
        """Empty GPUs grouped by (type, capacity), in fleet order."""
        out: dict[tuple[str, int], list[str]] = defaultdict(list)
        for g in self.problem.gpus:
            if not self.occupants[g.id]:
                out[(g.gpu_type, g.capacity)].append(g.id)
        return out

    def singles(self) -> list[tuple[Gpu, Job]]:
        """GPUs of capacity 2 holding exactly one single-GPU job, in fleet order."""
        out = []
        for g in self.problem.gpus:
            occ = self.occupants[g.id]
            if g.capacity == 2 and len(occ) == 1 and occ[0].num_gpus == 1:
                out.append((g, occ[0]))
        return out


@dataclass
class JobOptions:
    job: Job
    choices: list[Choice]
    rejected: Counter
    best_throughput: float  # best isolated prediction on any type of the fleet


def _occupant(problem: PlacementProblem, job: Job, gpu_type: str, iso: float,
              shared: float | None = None) -> Occupant:
    return Occupant(job.work, iso, problem.throughputs.activity(job, gpu_type), shared)


def alone_energy(problem: PlacementProblem, job: Job, gpu_type: str, iso: float,
                 limit_w: float | None = None) -> float:
    return problem.energy.energy_alone(
        gpu_type, _occupant(problem, job, gpu_type, iso), num_gpus=job.num_gpus, limit_w=limit_w
    )


def best_alone_limit(energy: EnergyModel, gpu_type: str, occ: Occupant, num_gpus: int, required: float,
                     levels: tuple[float | None, ...],
                     bound: Callable[[float | None], float] | None = None,
                     informed: Informed | None = None) -> tuple[float, float, float | None, float]:
    """(energy, throughput, limit, energy at ``levels[0]``) of ``occ`` alone on ``gpu_type`` at
    the least-energy level of ``levels`` (highest first) at which it still meets ``required``.

    ``levels[0]`` must be feasible (the caller checked the job meets its requirement there);
    slowdowns grow as limits fall, so the scan stops at the first level too slow, by the
    model or by ``bound`` (the most the job's own runs measured at a limit: ``rate_bound``).
    ``informed`` (``PlacementProblem.informed``), where runs of the job's type measured limits,
    replaces both: measured levels count as measured (rate and energy), the probe below them is
    offered, and the scan goes on past a level too slow (a lower one may be measured fine)."""
    e_first = energy.energy_alone(gpu_type, occ, num_gpus=num_gpus, limit_w=levels[0])
    pick = (e_first, occ.isolated, levels[0])
    if len(levels) > 1:
        p0 = energy.power_alone(gpu_type, occ.activity)
        for limit in levels[1:]:
            if informed is not None and limit is not None:
                rate, e = energy.alone_at(gpu_type, occ, limit, num_gpus=num_gpus, informed=informed)
                if rate < required:
                    continue
            else:
                rate = occ.isolated / energy.at_limit(gpu_type, p0, limit)[0]
                if bound is not None:
                    rate = min(rate, bound(limit))
                if rate < required:
                    break
                e = energy.energy_alone(gpu_type, occ, num_gpus=num_gpus, limit_w=limit)
            if e < pick[0] * (1 - 1e-12):
                pick = (e, rate, limit)
    return (*pick, e_first)


def least_alone(problem: PlacementProblem, energy: EnergyModel, job: Job, gpu_type: str, work: float,
                levels: tuple[float | None, ...]) -> tuple[float, float | None, float]:
    """Least energy for ``work`` steps alone on (empty) ``gpu_type`` over ``levels`` (highest
    first) meeting the job's requirement, that limit, and the job's rate there: ``(inf, None,
    0)`` where the type cannot meet it."""
    thr = problem.throughputs
    iso = thr.isolated(job, gpu_type)
    if not iso > 0 or iso < job.required_throughput:
        return math.inf, None, 0.0
    occ = Occupant(work, iso, thr.activity(job, gpu_type))
    e, rate, limit, _ = best_alone_limit(energy, gpu_type, occ, job.num_gpus, job.required_throughput, levels,
                                         lambda w: problem.rate_bound(job, gpu_type, w),
                                         problem.informed(job, gpu_type))
    return e, limit, rate


def least_alone_energy(problem: PlacementProblem, energy: EnergyModel, job: Job, gpu_type: str, work: float,
                       levels: tuple[float | None, ...]) -> tuple[float, float | None]:
    """:func:`least_alone` without the rate."""
    return least_alone(problem, energy, job, gpu_type, work, levels)[:2]


def pair_figures(
    problem: PlacementProblem, job: Job, partner: Job, gpu_type: str, limit_w: float | None = None,
) -> tuple[str | None, float, float, float, float]:
    """(rejection reason or None, job tput, partner tput, pair energy, pair power) on one GPU
    at the board limit ``limit_w`` (None: its maximum)."""
    thr = problem.throughputs
    tj, tk = thr.pair(job, partner, gpu_type)
    if tj <= 0 or tk <= 0:
        return NO_MEMORY, tj, tk, 0.0, 0.0
    ij, ik = thr.isolated(job, gpu_type), thr.isolated(partner, gpu_type)
    # A shared rate above the isolated one (noise in measured data) is capped, so
    # the energy model never sees a job speed up by gaining a partner.
    ij, ik = max(ij, tj), max(ik, tk)
    a = _occupant(problem, job, gpu_type, ij, tj)
    b = _occupant(problem, partner, gpu_type, ik, tk)
    loads = ((a.activity, tj / ij), (b.activity, tk / ik))
    slow = 1.0
    if limit_w is not None:
        p0 = problem.energy.power_shared(gpu_type, loads)
        slow = problem.energy.at_limit(gpu_type, p0, limit_w)[0]
    # what each job's own runs measured at this limit bounds it (a partner only slows it more)
    tj = min(tj / slow, problem.rate_bound(job, gpu_type, limit_w))
    tk = min(tk / slow, problem.rate_bound(partner, gpu_type, limit_w))
    if tj < job.required_throughput:
        return TOO_SLOW, tj, tk, 0.0, 0.0
    if tk < partner.required_throughput:
        return HURTS_PARTNER, tj, tk, 0.0, 0.0
    energy = problem.energy.energy_pair(gpu_type, a, b, limit_w=limit_w)
    power = problem.energy.power_shared(gpu_type, loads, limit_w=limit_w)
    return None, tj, tk, energy, power


def best_pair(
    problem: PlacementProblem, job: Job, partner: Job, gpu_type: str, levels: tuple[float | None, ...],
) -> tuple[str | None, float, float, float, float, float | None, float]:
    """:func:`pair_figures` at the least-energy feasible level: (..., limit, energy at ``levels[0]``).

    ``levels[0]`` is the reference the saving is measured against (the maximum, or the limit
    the board has now). When no level is feasible the first level's reason is returned.
    """
    first = None
    best = None
    for limit in levels:
        fig = pair_figures(problem, job, partner, gpu_type, limit)
        if first is None:
            first = fig
        if fig[0] is None and (best is None or fig[3] < best[0][3] * (1 - 1e-12)):
            best = (fig, limit)
    assert first is not None
    if best is None:
        return (*first, levels[0], 0.0)
    ref = first[3] if first[0] is None else math.nan
    return (*best[0], best[1], ref)


def options_for(problem: PlacementProblem, state: FleetState, job: Job,
                free: dict[tuple[str, int], list[str]] | None = None,
                singles: list[tuple[Gpu, Job]] | None = None) -> JobOptions:
    """Every feasible option of ``job`` on the current state, and why the rest are not.

    With ``problem.power_limit_levels`` each option is costed at every level of its GPU's
    limit and keeps the least-energy one at which every job on the board meets its
    requirement; a join may change the limit its partner runs at.
    """
    thr, energy = problem.throughputs, problem.energy
    free = state.free_by_class() if free is None else free
    singles = state.singles() if singles is None else singles
    choices: list[Choice] = []
    rejected: Counter = Counter()
    rho = job.required_throughput
    iso_by_type = {t: thr.isolated(job, t) for t in problem.gpu_types}
    best = max(iso_by_type.values(), default=0.0)
    limited = bool(problem.power_limit_levels)

    for (gtype, _cap), ids in free.items():
        iso = iso_by_type[gtype]
        if iso <= 0:
            rejected[NO_MEMORY] += len(ids)
        elif iso < rho:
            rejected[TOO_SLOW] += len(ids)
        elif len(ids) < job.num_gpus:
            rejected[NOT_ENOUGH_GPUS] += len(ids)
        else:
            occ = _occupant(problem, job, gtype, iso)
            informed = problem.informed(job, gtype)
            e, t_lim, limit, e_max = best_alone_limit(energy, gtype, occ, job.num_gpus, rho,
                                                      problem.limit_levels(gtype) if limited else (None,),
                                                      lambda w, t=gtype: problem.rate_bound(job, t, w), informed)
            choices.append(Choice(
                gpu_type=gtype, gpus=tuple(ids[: job.num_gpus]), throughput=t_lim, energy_j=e,
                power_w=job.num_gpus * energy.board_alone_w(gtype, occ, limit, informed),
                power_limit_w=limit, limit_saving_j=e_max - e,
            ))

    if job.num_gpus > 1:
        rejected[NO_SHARING] += len(singles)
    else:
        for gpu, partner in singles:
            t = gpu.gpu_type
            if iso_by_type[t] <= 0:
                rejected[NO_MEMORY] += 1
                continue
            if iso_by_type[t] < rho:  # pairing never makes a job faster than alone
                rejected[TOO_SLOW] += 1
                continue
            now = state.limit(gpu.id)
            levels = (now, *(v for v in problem.limit_levels(t) if v != now)) if limited else (now,)
            reason, tj, tk, e_pair, p_pair, limit, e_ref = best_pair(problem, job, partner, t, levels)
            if reason is not None:
                rejected[reason] += 1
                continue
            k_iso = max(thr.isolated(partner, t), thr.pair(job, partner, t)[1])
            k_occ = _occupant(problem, partner, t, k_iso)
            # the partner alone at the board's limit now, costed as its own options are (what its
            # type's runs measured there, where they did), so the join's increment is the verifier's
            before = energy.alone_at(t, k_occ, now, informed=problem.informed(partner, t))[1]
            choices.append(Choice(
                gpu_type=t, gpus=(gpu.id,), throughput=tj,
                energy_j=e_pair - before,
                power_w=p_pair - energy.power_alone(t, k_occ.activity, now),
                partner=partner.id, partner_throughput=tk,
                power_limit_w=limit, limit_saving_j=(e_ref - e_pair) if math.isfinite(e_ref) else 0.0,
            ))
    # Every other GPU is occupied and cannot take one more job.
    full = len(problem.gpus) - sum(len(ids) for ids in free.values()) - len(singles)
    if full:
        rejected[FULL] += full
    return JobOptions(job, choices, rejected, best)


def waiting_reason(opts: JobOptions) -> str:
    """A sentence a user can act on, for a job no option could take."""
    job = opts.job
    if opts.best_throughput <= 0:
        return "fits no GPU type of the fleet (no memory)"
    if opts.best_throughput < job.required_throughput:
        return (
            f"no GPU type of the fleet reaches {job.required_throughput:.3g} steps/s; "
            f"the best is {opts.best_throughput:.3g} steps/s"
        )
    if opts.choices:
        return "its feasible slots went to other jobs"
    return "every GPU that could meet its requirement is busy"


__all__ = [
    "FleetState", "JobOptions", "alone_energy", "best_pair", "least_alone", "least_alone_energy", "options_for", "pair_figures",
    "waiting_reason",
]

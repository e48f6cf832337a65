"""Independent checks of a placement against its problem.

These re-derive everything from the final occupancy instead of trusting the
policy's own bookkeeping, so tests, benchmarks and the simulator can hold any
policy (the optimiser included) to the same rules and the same energy figure.
"""

from __future__ import annotations

from gogh_flows.energy import Occupant
from gogh_flows.placement.problem import Job, PlacementProblem
from gogh_flows.placement.result import Placement


def final_occupancy(problem: PlacementProblem, placement: Placement) -> dict[str, list[Job]]:
    occ = {g.id: list(problem.occupants(g.id)) for g in problem.gpus}
    for a in placement.assignments:
        job = problem.job(a.job_id)
        for gid in a.gpus:
            occ[gid].append(job)
    return occ


def final_limits(problem: PlacementProblem, placement: Placement) -> tuple[dict[str, float | None], list[str]]:
    """Each GPU's power limit after the placement (None: its maximum), and any GPU given two."""
    limits = {g.id: problem.gpu_limit(g.id) for g in problem.gpus}
    set_by: dict[str, tuple[str, float | None]] = {}
    clashes = []
    for a in placement.assignments:
        for gid in a.gpus:
            if gid in set_by and set_by[gid][1] != a.power_limit_w:
                clashes.append(f"{gid}: two power limits, {set_by[gid][1]} W by {set_by[gid][0]} and "
                               f"{a.power_limit_w} W by {a.job_id}")
            set_by[gid] = (a.job_id, a.power_limit_w)
            if gid in limits:
                limits[gid] = a.power_limit_w
    return limits, clashes


def _slowdown(problem: PlacementProblem, gpu_type: str, occ: list[Job], limit: float | None) -> float:
    """The common factor a board's limit slows its occupants by (1 at the maximum)."""
    if limit is None:
        return 1.0
    thr, energy = problem.throughputs, problem.energy
    if len(occ) == 1:
        return energy.at_limit(gpu_type, energy.power_alone(gpu_type, thr.activity(occ[0], gpu_type)), limit)[0]
    a, b = occ
    ta, tb = thr.pair(a, b, gpu_type)
    ia, ib = max(thr.isolated(a, gpu_type), ta), max(thr.isolated(b, gpu_type), tb)
    p0 = energy.power_shared(gpu_type, ((thr.activity(a, gpu_type), ta / ia), (thr.activity(b, gpu_type), tb / ib)))
    return energy.at_limit(gpu_type, p0, limit)[0]


def violations(problem: PlacementProblem, placement: Placement, rtol: float = 1e-9) -> list[str]:
    """Every broken rule, as sentences; empty when the placement is valid."""
    out: list[str] = []
    thr = problem.throughputs
    arriving = {j.id for j in problem.arriving}
    seen: set[str] = set()
    for a in placement.assignments:
        if a.job_id not in arriving:
            out.append(f"{a.job_id}: not an arriving job")
        if a.job_id in seen:
            out.append(f"{a.job_id}: placed twice")
        seen.add(a.job_id)
        job = problem.job(a.job_id)
        if len(a.gpus) != job.num_gpus:
            out.append(f"{a.job_id}: needs {job.num_gpus} GPUs, got {len(a.gpus)}")
        types = {problem.gpu(g).gpu_type for g in a.gpus}
        if len(types) != 1:
            out.append(f"{a.job_id}: gang spans GPU types {sorted(types)}")
        if a.power_limit_w is not None:
            rng = problem.energy.gpu(a.gpu_type).power_limit_range_w
            if rng is None or not rng[0] - 1e-9 <= a.power_limit_w <= rng[1] + 1e-9:
                out.append(f"{a.job_id}: power limit {a.power_limit_w} W outside {a.gpu_type}'s range {rng}")
    waiting = {w.job_id for w in placement.waiting}
    if seen | waiting != arriving or seen & waiting:
        out.append("every arriving job must be either placed or waiting, exactly once")

    limits, clashes = final_limits(problem, placement)
    out += clashes
    for gid, occ in final_occupancy(problem, placement).items():
        gpu = problem.gpu(gid)
        if len(occ) > gpu.capacity:
            out.append(f"{gid}: {len(occ)} jobs exceed capacity {gpu.capacity}")
            continue
        if len(occ) == 2:
            a, b = occ
            if a.num_gpus > 1 or b.num_gpus > 1:
                out.append(f"{gid}: a gang job shares a GPU ({a.id}, {b.id})")
                continue
            ta, tb = thr.pair(a, b, gpu.gpu_type)
            if ta <= 0 or tb <= 0:
                out.append(f"{gid}: pair ({a.id}, {b.id}) does not fit (pair throughput 0)")
                continue
            slow = _slowdown(problem, gpu.gpu_type, occ, limits[gid])
            bound = problem.rate_bound
            for job, t in ((a, min(ta / slow, bound(a, gpu.gpu_type, limits[gid]))),
                           (b, min(tb / slow, bound(b, gpu.gpu_type, limits[gid])))):
                if t < job.required_throughput * (1 - rtol):
                    out.append(
                        f"{gid}: {job.id} gets {t:.4g} < required {job.required_throughput:.4g} steps/s"
                        + (f" at {limits[gid]:g} W" if limits[gid] is not None else "")
                    )
        elif len(occ) == 1 and occ[0].id in seen:
            job = occ[0]
            t = _alone(problem, job, gpu.gpu_type, limits[gid])[0]
            if t < job.required_throughput * (1 - rtol):
                out.append(
                    f"{gid}: {job.id} gets {t:.4g} < required {job.required_throughput:.4g} steps/s"
                    + (f" at {limits[gid]:g} W" if limits[gid] is not None else "")
                )
    return out


def _alone(problem: PlacementProblem, job: Job, gpu_type: str, limit: float | None) -> tuple[float, float]:
    """(rate, joules to finish) of ``job`` alone at ``limit``: the model's (its rate bounded by what
    runs at limits measured), or as its type's runs measured there (``PlacementProblem.informed``)."""
    thr = problem.throughputs
    occ = Occupant(job.work, thr.isolated(job, gpu_type), thr.activity(job, gpu_type))
    informed = problem.informed(job, gpu_type)
    rate, joules = problem.energy.alone_at(gpu_type, occ, limit, informed=informed)
    return (rate if informed is not None else min(rate, problem.rate_bound(job, gpu_type, limit))), joules


def _gpu_energy(problem: PlacementProblem, gpu_type: str, occ: list[Job], limit: float | None) -> float:
    thr, energy = problem.throughputs, problem.energy
    if len(occ) == 1:
        return _alone(problem, occ[0], gpu_type, limit)[1]
    a, b = occ
    ta, tb = thr.pair(a, b, gpu_type)
    ia, ib = max(thr.isolated(a, gpu_type), ta), max(thr.isolated(b, gpu_type), tb)
    return energy.energy_pair(
        gpu_type,
        Occupant(a.work, ia, thr.activity(a, gpu_type), ta),
        Occupant(b.work, ib, thr.activity(b, gpu_type), tb),
        limit_w=limit,
    )


def placement_energy(problem: PlacementProblem, placement: Placement) -> float:
    """Incremental energy to completion (J) of a placement, from the final occupancy and limits.

    A gang's GPUs are counted once per gang (each GPU carries 1/n of it).
    """
    touched = {g for a in placement.assignments for g in a.gpus}
    final = final_occupancy(problem, placement)
    limits, _ = final_limits(problem, placement)
    total = 0.0
    for gid in touched:
        gtype = problem.gpu(gid).gpu_type
        before, after = list(problem.occupants(gid)), final[gid]
        if len(after) == 1 and after[0].num_gpus > 1:
            j = after[0]
            iso = problem.throughputs.isolated(j, gtype)
            occ = Occupant(j.work, iso, problem.throughputs.activity(j, gtype))
            total += problem.energy.energy_alone(gtype, occ, limit_w=limits[gid])  # one GPU's share of the gang
            continue
        total += _gpu_energy(problem, gtype, after, limits[gid]) - (
            _gpu_energy(problem, gtype, before, problem.gpu_limit(gid)) if before else 0.0
        )
    return total


__all__ = ["final_limits", "final_occupancy", "placement_energy", "violations"]

"""Seeded random placement problems on a mixed fleet, for benchmarks and tests.

Running jobs are put where they really meet their requirement (a requirement
is a fraction of what the job gets where it runs, shared or not), so a
generated state is one a correct scheduler could have produced. Arriving jobs
get ``rho = q * basis``, ``q ~ U(q_low, q_high)``, where the basis is the job's
isolated throughput on the median GPU type of the fleet (default: feasible on
about half the types, so a decision has real choices) or on its best type
(``basis="best"``, DESIGN §6: feasible somewhere, often only on the newest).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from gogh_flows.energy import EnergyModel
from gogh_flows.placement.problem import Gpu, Job, PlacementProblem, TableThroughputs
from gogh_flows.truth.table import ThroughputTable

DEFAULT_MIX = ("k80", "p100", "v100", "t4", "a10", "l4", "a100", "h100")


def mixed_fleet(num_gpus: int, types: Sequence[str] = DEFAULT_MIX, capacity: int = 2) -> list[Gpu]:
    """``num_gpus`` GPUs spread evenly over ``types`` (the first types get the remainder)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    return [
        Gpu(f"{types[i % len(types)]}-{i // len(types):04d}", types[i % len(types)], capacity)
        for i in range(num_gpus)
    ]


def random_problem(
    table: ThroughputTable,
    *,
    num_gpus: int,
    running: int,
    arrivals: int,
    seed: int = 0,
    types: Sequence[str] | None = None,
    gang_fraction: float = 0.05,
    q_range: tuple[float, float] = (0.2, 0.9),
    hours: tuple[float, float] = (0.5, 8.0),
    capacity: int = 2,
    basis: str = "median",
) -> PlacementProblem:
    """A seeded problem: ``running`` jobs already placed, ``arrivals`` to place."""
    if basis not in ("median", "best"):
        raise ValueError(f"basis must be 'median' or 'best', got {basis!r}")
    rng = random.Random(seed)
    types = tuple(types) if types is not None else tuple(t for t in DEFAULT_MIX if t in table.gpu_types)
    gpus = mixed_fleet(num_gpus, types, capacity)
    tp = TableThroughputs(table)
    job_types = [j for j in table.job_types
                 if any(table.has(j, t) and table.isolated(j, t) > 0 for t in types)]
    if not job_types:
        raise ValueError(
            f"no job type of the throughput table ({table.source}) runs on GPU types {list(types)}"
        )
    occ: dict[str, list[Job]] = {g.id: [] for g in gpus}
    jobs: list[Job] = []

    def gang_size() -> int:
        return rng.choice((2, 4, 8)) if rng.random() < gang_fraction else 1

    def work(rho: float) -> float:
        return rho * 3600 * rng.uniform(*hours)

    for i in range(running):
        n = gang_size()
        jt = rng.choice(job_types)
        if n > 1:
            placed = _place_running_gang(rng, tp, gpus, occ, f"r{i}", jt, n, work, q_range)
            if placed is not None:
                jobs.append(placed)
                continue
        job = _place_running_single(rng, tp, gpus, occ, f"r{i}", jt, work, q_range)
        if job is None:
            continue  # no GPU can take this job type next to what runs now
        jobs.append(job)

    for i in range(arrivals):
        n = gang_size()
        jt = rng.choice([j for j in job_types if any(table.has(j, t, n) for t in types)] or job_types)
        if not any(table.has(jt, t, n) for t in types):
            n = 1
        speeds = sorted(tp.isolated(Job("x", jt, 1.0, 1.0, n), t) for t in types)
        speeds = [v for v in speeds if v > 0]
        ref = speeds[-1] if basis == "best" else speeds[len(speeds) // 2]
        rho = rng.uniform(*q_range) * ref
        jobs.append(Job(f"a{i}", jt, rho, work(rho), n))
    return PlacementProblem(tuple(gpus), tuple(jobs), tp, EnergyModel())


def _place_running_single(rng, tp, gpus, occ, jid, jt, work, q_range) -> Job | None:
    candidates = [g for g in gpus if len(occ[g.id]) < g.capacity
                  and not any(o.num_gpus > 1 for o in occ[g.id])]
    rng.shuffle(candidates)
    for g in candidates:
        probe = Job(jid, jt, 1.0, 1.0)
        iso = tp.isolated(probe, g.gpu_type)
        if iso <= 0:
            continue
        if not occ[g.id]:
            rho = rng.uniform(*q_range) * iso
            job = Job(jid, jt, rho, work(rho), 1, (g.id,))
        else:
            other = occ[g.id][0]
            mine, theirs = tp.pair(probe, other, g.gpu_type)
            if mine <= 0 or theirs < other.required_throughput:
                continue
            rho = rng.uniform(*q_range) * mine
            job = Job(jid, jt, rho, work(rho), 1, (g.id,))
        occ[g.id].append(job)
        return job
    return None


def _place_running_gang(rng, tp, gpus, occ, jid, jt, n, work, q_range) -> Job | None:
    by_type: dict[str, list[str]] = {}
    for g in gpus:
        if not occ[g.id]:
            by_type.setdefault(g.gpu_type, []).append(g.id)
    options = [t for t, ids in by_type.items()
               if len(ids) >= n and tp.isolated(Job(jid, jt, 1.0, 1.0, n), t) > 0]
    if not options:
        return None
    t = rng.choice(options)
    ids = tuple(by_type[t][:n])
    rho = rng.uniform(*q_range) * tp.isolated(Job(jid, jt, 1.0, 1.0, n), t)
    job = Job(jid, jt, rho, work(rho), n, ids)
    for gid in ids:
        occ[gid].append(job)
    return job


__all__ = ["DEFAULT_MIX", "mixed_fleet", "random_problem"]

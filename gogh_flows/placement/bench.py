"""Decision-time measurement of a placement policy on seeded random problems."""

from __future__ import annotations

import math

import numpy as np

from gogh_flows.placement.generate import random_problem
from gogh_flows.placement.optimizer import GoghOptimizer
from gogh_flows.truth.table import ThroughputTable


def bench_placement(
    table: ThroughputTable, *, gpus: int, running: int, arrivals: int, repeat: int = 10,
    seed: int = 0, time_limit_s: float = 2.0, num_workers: int = 1,
    power_limit_levels: tuple[float, ...] = (),
) -> dict:
    """p50/p99 wall time (ms) of one decision and the worst reported optimality gap.

    Problem generation is excluded; option enumeration and the solve are included,
    since a user waits for both.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    policy = GoghOptimizer(time_limit_s=time_limit_s, num_workers=num_workers,
                           power_limit_levels=tuple(power_limit_levels))
    times, gaps, placed, statuses = [], [], [], {}
    for r in range(repeat):
        problem = random_problem(table, num_gpus=gpus, running=running, arrivals=arrivals, seed=seed + r)
        result = policy.place(problem)
        times.append(result.solve_ms)
        gaps.append(result.gap)
        placed.append(len(result.assignments))
        statuses[result.status] = statuses.get(result.status, 0) + 1
    finite = [g for g in gaps if not math.isnan(g)]
    return {
        "p50_ms": float(np.percentile(times, 50)),
        "p99_ms": float(np.percentile(times, 99)),
        "max_gap": max(finite) if len(finite) == len(gaps) else None,
        "gpus": gpus, "running": running, "arrivals": arrivals, "repeat": repeat, "seed": seed,
        "time_limit_s": time_limit_s, "power_limit_levels": list(power_limit_levels), "mean_placed": float(np.mean(placed)), "status": statuses,
    }

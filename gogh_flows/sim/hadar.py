"""Hadar-style and HadarE-style allocators for ``sim.rounds``: RECONSTRUCTIONS, not Hadar.

Hadar (Sultana et al., IPDPS'24; journal version arXiv 2503.10918) schedules deep
learning jobs on a heterogeneous cluster in rounds with an online primal-dual framework
whose dual subroutine decides, job by job, where (and whether) each runs; it reports
1.20x shorter total time than Gavel in simulation. HadarE forks a job into copies that
train at once on GPUs of different nodes and types (utilisation x1.45, total time -50% on
AWS). The exact price update of Hadar is not public, so this module builds the closest
public template, OASiS's (Bao et al., arXiv 1801.00936): every GPU type has a price per
GPU that rises exponentially with the share of its GPUs already given out this round,

    price_t(y) = (L / 2) * (2 U / L) ** (y / C_t),

from ``L / 2`` when the type is empty to ``U`` when it is full, where ``U`` and ``L`` are
the largest and smallest utility per GPU any active job has on any type. A job's utility
on a type, per GPU, is its throughput there over its best throughput anywhere (1 on its
best type: jobs are comparable whatever their step size), set against that type's price
per GPU at the share already given out. Jobs are taken in arrival order (online:
a job is decided on when it comes up, as in the primal-dual template); each takes the
type with the largest utility minus priced cost and is admitted only when that is
positive, so a job that gains little from a fast type leaves it to one that gains more
once the type fills. Decisions are re-taken at every arrival and completion
(``reset_s = 0``), not on Gavel's 1920 s clock; a job not admitted waits.

HadarE here: the same admission, then GPUs still free after it go to *copies* of the
admitted jobs on other types (up to ``max_copies`` types per job), again while the
utility exceeds the price; the copies' steps add up as if training on shards with
perfect aggregation, which bounds from above what forking can give.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gogh_flows.sim.rounds import AllocationState

__all__ = ["HADAR_POLICIES", "HadarAllocator", "make_hadar_policy"]


@dataclass(frozen=True)
class HadarAllocator:
    name: str = "hadar"
    max_copies: int = 1  # > 1: HadarE's forking
    skips_unallocated: bool = True
    reset_s: float = 0.0

    def allocate(self, state: AllocationState) -> np.ndarray:
        m, n = state.rate.shape
        out = np.zeros((m, n))
        best = state.rate.max(axis=1)
        ok = best > 0
        if not ok.any():
            return out
        utility = np.divide(state.rate, best[:, None], out=np.zeros_like(state.rate), where=ok[:, None])
        positive = utility[utility > 0]
        hi, lo = float(positive.max()), float(positive.min())
        used = np.zeros(n)

        def price(c: int) -> float:
            """Per GPU of type c, at the share of it already given out this round."""
            return (lo / 2) * (2 * hi / lo) ** (used[c] / state.capacity[c])

        order = [int(i) for i in np.argsort(state.arrival_s, kind="stable") if ok[i]]
        admitted: list[int] = []
        for i in order:
            gain = [(utility[i, c] - price(c), c) for c in range(n)
                    if utility[i, c] > 0 and used[c] + state.scale[i] <= state.capacity[c]]
            if not gain:
                continue
            value, c = max(gain)
            if value > 0:
                out[i, c] = 1.0
                used[c] += state.scale[i]
                admitted.append(i)
        for _ in range(self.max_copies - 1):  # HadarE: copies on the types still free
            for i in admitted:
                gain = [(utility[i, c] - price(c), c) for c in range(n)
                        if out[i, c] == 0 and utility[i, c] > 0
                        and used[c] + state.scale[i] <= state.capacity[c]]
                if gain:
                    value, c = max(gain)
                    if value > 0:
                        out[i, c] = 1.0
                        used[c] += state.scale[i]
        return out


HADAR_POLICIES = ("hadar", "hadare")


def make_hadar_policy(name: str) -> HadarAllocator:
    """``hadar`` or ``hadare`` (forking into copies on up to every type of the fleet)."""
    if name == "hadar":
        return HadarAllocator()
    if name == "hadare":
        return HadarAllocator(name="hadare", max_copies=8)
    raise ValueError(f"unknown Hadar policy {name!r}; choose from: {', '.join(HADAR_POLICIES)}")

"""Gavel's policies (Narayanan et al., OSDI'20) as round-based allocators for ``sim.rounds``.

Re-written from the paper and from the policy files of stanford-futuredata/gavel at
commit c4fa400 (MIT), read to understand; no code is copied. Gavel solves its programs
with cvxpy (ECOS, an interior-point solver); here every program is a linear program
solved with OR-Tools' GLOP. Where Gavel's program has many optimal allocations, GLOP
returns a vertex and ECOS a point inside the optimal face, so the two can schedule
differently at equal objective: ``benchmarks/gavel_calibration.py`` measures what that
changes against the figures Gavel's own simulator gave.

Besides Gavel's heterogeneity-agnostic ``fifo`` (``GavelFifo``, kept for calibration),
four ``_perf`` (heterogeneity-aware) variants, without space sharing:

* ``gavel-fifo-perf``: at each reset, jobs in arrival order each get the whole of the
  fastest type that still has enough free GPUs; the first job that fits nowhere stops
  the pass (no backfilling).
* ``gavel-max-min-fairness``: maximise the smallest normalised throughput, where a job's
  throughput under the allocation is divided by what it would get from an equal share
  of every type (Gavel's proportional allocation) and multiplied by its GPU count.
* ``gavel-min-total-duration``: the allocation under which every job can finish its
  remaining steps soonest (the makespan of the active jobs), solved as one LP in 1/T;
  Gavel bisects on T with a feasibility program, to within 5%.
* ``gavel-energy-slo``: Gavel's ``ThroughputNormalizedByCostSum_PerfSLOs`` with watts in
  place of the hourly price: maximise the sum over jobs of throughput per watt on each
  type (the job's own board power there, from the energy model: what an energy-aware
  operator would use), subject to every job's allocation giving at least its required
  throughput (Gavel's SLO is a deadline on the remaining steps; ours is the run's
  required steps/s, the same thing per unit of time). When the requirements cannot all
  be met, Gavel drops them and maximises throughput per cost alone; so does this.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import pywraplp

from gogh_flows.sim.rounds import AllocationState

__all__ = ["GAVEL_POLICIES", "GavelEnergySlo", "GavelFifo", "GavelFifoPerf", "GavelMaxMinFairness",
           "GavelMinTotalDuration", "make_gavel_policy"]


TIME_LIMIT_S = 10.0


class _Program:
    """x[j, t] in [0, 1] for the pairs a job can run on, with Gavel's base constraints:
    a job's time fractions sum to at most 1; a type's GPUs are not over-committed."""

    def __init__(self, state: AllocationState, rows: np.ndarray | None = None) -> None:
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        if self.solver is None:  # pragma: no cover - GLOP ships with every OR-Tools wheel
            raise RuntimeError("OR-Tools' GLOP solver is unavailable in this installation")
        self.state = state
        m, n = state.rate.shape
        usable = state.rate > 0
        if rows is not None:
            usable &= rows[:, None]
        self.x: dict[tuple[int, int], pywraplp.Variable] = {
            (i, c): self.solver.NumVar(0.0, 1.0, f"x_{i}_{c}")
            for i in range(m) for c in range(n) if usable[i, c]}
        self.row: dict[int, list[tuple[int, pywraplp.Variable]]] = {}
        for (i, c), v in self.x.items():
            self.row.setdefault(i, []).append((c, v))
        for terms in self.row.values():
            if len(terms) > 1:
                self.solver.Add(sum(v for _, v in terms) <= 1.0)
        for c in range(n):
            terms = [state.scale[i] * self.x[i, c] for i in range(m) if (i, c) in self.x]
            if terms:
                self.solver.Add(sum(terms) <= float(state.capacity[c]))

    def throughput(self, i: int, weight: np.ndarray | None = None):
        w = self.state.rate[i] if weight is None else weight
        return sum(float(w[c]) * v for c, v in self.row.get(i, []))

    def solve(self) -> np.ndarray | None:
        # A bound on a pathological solve: the allocation then falls back as when the
        # program is infeasible, and the rounds still run.
        self.solver.SetTimeLimit(int(TIME_LIMIT_S * 1000))
        status = self.solver.Solve()
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return None
        out = np.zeros(self.state.rate.shape)
        for (i, c), v in self.x.items():
            out[i, c] = v.solution_value()
        return out.clip(0.0, 1.0)


def _max_min(state: AllocationState, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The allocation maximising the least ``sum_t weight[j, t] * x[j, t]`` over the ``rows``."""
    lp = _Program(state, rows)
    z = lp.solver.NumVar(0.0, lp.solver.infinity(), "z")
    for i in np.flatnonzero(rows):
        lp.solver.Add(lp.throughput(int(i), weight[i]) >= z)
    lp.solver.Maximize(z)
    out = lp.solve()
    return out if out is not None else np.zeros(state.rate.shape)


@dataclass(frozen=True)
class GavelFifoPerf:
    name: str = "gavel-fifo-perf"
    skips_unallocated: bool = True

    def allocate(self, state: AllocationState) -> np.ndarray:
        m, n = state.rate.shape
        out = np.zeros((m, n))
        free = state.capacity.copy()
        alphabetical = sorted(range(n), key=lambda c: state.types[c])
        for i in np.argsort(state.arrival_s, kind="stable"):
            fits = [c for c in alphabetical if free[c] >= state.scale[i]]
            if not fits:
                break  # FIFO: nobody overtakes the head of the queue
            best = max(fits, key=lambda c: (state.rate[i, c], -alphabetical.index(c)))
            if state.rate[i, best] > 0:
                out[i, best] = 1.0
                free[best] -= state.scale[i]
        return out


@dataclass(frozen=True)
class GavelMaxMinFairness:
    name: str = "gavel-max-min-fairness"
    skips_unallocated: bool = False

    def allocate(self, state: AllocationState) -> np.ndarray:
        # A job's throughput under an equal share of every type: Gavel's proportional
        # allocation gives each job cap[t] / sum(cap) of each type's time.
        equal = state.rate @ (state.capacity / state.capacity.sum())
        rows = equal > 0
        if not rows.any():
            return np.zeros(state.rate.shape)
        weight = state.rate * state.scale[:, None] / np.where(rows, equal, 1.0)[:, None]
        return _max_min(state, rows, weight)


@dataclass(frozen=True)
class GavelMinTotalDuration:
    name: str = "gavel-min-total-duration"
    skips_unallocated: bool = False

    def allocate(self, state: AllocationState) -> np.ndarray:
        rows = state.rate.max(axis=1) > 0
        if not rows.any():
            return np.zeros(state.rate.shape)
        # Every job finishes within T: throughput >= remaining / T. With u = 1/T this is linear:
        # the largest u over the rows divided by their remaining steps (well scaled) gives the
        # least T (Gavel bisects on T instead).
        return _max_min(state, rows, state.rate / np.maximum(state.remaining, 1e-9)[:, None])


@dataclass(frozen=True)
class GavelEnergySlo:
    name: str = "gavel-energy-slo"
    skips_unallocated: bool = False

    def allocate(self, state: AllocationState) -> np.ndarray:
        rows = state.rate.max(axis=1) > 0
        if not rows.any():
            return np.zeros(state.rate.shape)
        per_watt = np.divide(state.rate, state.watts, out=np.zeros_like(state.rate),
                             where=state.watts > 0)
        for with_slos in (True, False):
            lp = _Program(state, rows)
            lp.solver.Maximize(sum(float(per_watt[i, c]) * v for (i, c), v in lp.x.items()))
            if with_slos:
                for i in np.flatnonzero(rows):
                    lp.solver.Add(lp.throughput(int(i)) >= float(state.required[i]))
            out = lp.solve()
            if out is not None:
                return out
        return np.zeros(state.rate.shape)


@dataclass
class GavelFifo:
    """Gavel's heterogeneity-agnostic ``fifo``: a job keeps the type it was given until it ends.

    New jobs, in arrival order, each get a type drawn at random among those with enough
    free GPUs; a finished job's type goes to the head of the queue when it fits there.
    Rounds serve the types in a random order (``shuffle_types``), as Gavel does for
    policies without ``Perf`` in their name. ``c4fa400=True`` reproduces what Gavel's code
    at that commit does instead (the drawn index is never used: the job gets the *last*
    of the alphabetically sorted types with free GPUs, even when it lacks room there),
    which is how its published ``fifo`` figure came about. Stateful: one per simulation.
    """

    seed: int = 0
    c4fa400: bool = False
    name: str = "gavel-fifo"
    skips_unallocated: bool = True
    shuffle_types: bool = True
    _alloc: dict[str, int] = field(default_factory=dict, init=False)  # job -> type column
    _order: dict[str, int] = field(default_factory=dict, init=False)  # job -> first seen
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def allocate(self, state: AllocationState) -> np.ndarray:
        m, n = state.rate.shape
        index = {j: i for i, j in enumerate(state.job_ids)}
        for j in state.job_ids:
            self._order.setdefault(j, len(self._order))
        free = state.capacity.copy()
        waiting = [j for j in state.job_ids if j not in self._alloc]
        for j in sorted(self._alloc, key=self._order.__getitem__):
            c = self._alloc[j]
            if j in index:
                free[c] -= state.scale[index[j]]
                continue
            # Finished: its type goes to the head of the queue if it fits there.
            if waiting:
                head = index[waiting[0]]
                if state.scale[head] <= free[c] and state.rate[head, c] > 0:
                    self._alloc[waiting.pop(0)] = c
                    free[c] -= state.scale[head]
            del self._alloc[j]
        listed = sorted((c for c in range(n) if free[c] > 0), key=lambda c: state.types[c])
        while waiting and listed:
            i = index[waiting.pop(0)]
            fits = [(p, c) for p, c in enumerate(listed) if free[c] >= state.scale[i]]
            if not fits:
                break  # FIFO: nobody overtakes the head of the queue
            pos, c = fits[self._rng.randrange(len(fits))]
            if self.c4fa400:
                c = listed[-1]
            if state.rate[i, c] > 0:
                self._alloc[state.job_ids[i]] = c
                free[c] -= state.scale[i]
                if free[c] == 0:
                    listed.pop(pos)
        out = np.zeros((m, n))
        for j, c in self._alloc.items():
            out[index[j], c] = 1.0
        return out


#: The Gavel policies by name; each call of ``make_gavel_policy`` gives a fresh one.
GAVEL_POLICIES = ("gavel-fifo", "gavel-fifo-perf", "gavel-max-min-fairness",
                  "gavel-min-total-duration", "gavel-energy-slo")


def make_gavel_policy(name: str, seed: int = 0):
    """The Gavel allocator called ``name``; an unknown name is an error that lists them."""
    makers = {"gavel-fifo": lambda: GavelFifo(seed=seed), "gavel-fifo-perf": GavelFifoPerf,
              "gavel-max-min-fairness": GavelMaxMinFairness,
              "gavel-min-total-duration": GavelMinTotalDuration, "gavel-energy-slo": GavelEnergySlo}
    if name not in makers:
        raise ValueError(f"unknown Gavel policy {name!r}; choose from: {', '.join(GAVEL_POLICIES)}")
    return makers[name]()

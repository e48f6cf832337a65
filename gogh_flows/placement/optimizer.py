"""The GOGH allocation step as a CP-SAT model (DESIGN §4), sized for big fleets.

A naive model has one boolean per (job, GPU) and one per (job, job, GPU): at
1,024 GPUs and 64 arrivals that is millions of variables. This model is exact
but much smaller, because most GPUs are interchangeable from a new job's point
of view:

* **Free GPUs are aggregated** by (type, capacity): a job takes "one free V100",
  constrained by the count of free V100s; concrete ids are handed out after the
  solve. This also removes all symmetry between identical GPUs.
* **Joins are pruned exactly**: a GPU with one running job takes at most one new
  job, so each job only needs its ``J`` cheapest such GPUs (``J`` = number of
  arrivals). If an optimum used a worse one, one of the ``J`` best is unused by
  the other ``J - 1`` jobs and moving there costs no more.
* **Pairs of arriving jobs** on one free GPU are enumerated; when every class has
  free GPUs for everybody, a pair that is not cheaper than both jobs' best
  alone options is dominated and dropped.

Objective: lexicographic via a large reward per placed job (place as many jobs
as possible, then least energy), energies scaled to integers (~1e-6 relative
resolution). A single arrival is solved by enumeration, which is exact and fast.
A greedy solution is given as a hint and is the fallback if the time limit hits
before CP-SAT finds anything.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations

from ortools.sat.python import cp_model

from gogh_flows.placement.baselines import explain
from gogh_flows.placement.options import (
    FleetState,
    JobOptions,
    alone_energy,
    options_for,
    pair_figures,
    waiting_reason,
)
from gogh_flows.placement.problem import Job, PlacementProblem
from gogh_flows.placement.result import Assignment, Choice, Explanation, Placement, Waiting

_RESOLUTION = 1_000_000  # integer steps for the largest single cost


@dataclass
class _Var:
    var: cp_model.IntVar | None
    jobs: tuple[Job, ...]
    cost: float
    resource: tuple  # ("class", (type, cap), n) or ("single", gpu_id)
    choices: tuple[Choice, ...]  # one per job in ``jobs``


@dataclass
class GoghOptimizer:
    """Least-energy placement that protects every job's throughput requirement."""

    time_limit_s: float = 2.0
    num_workers: int = 2
    relative_gap: float = 0.0
    name: str = "optimizer"

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0 seconds, got {self.time_limit_s!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers!r}")
        if not 0 <= self.relative_gap < 1:
            raise ValueError(f"relative_gap must be in [0, 1), got {self.relative_gap!r}")

    def place(self, problem: PlacementProblem) -> Placement:
        start = time.perf_counter()
        state = FleetState(problem)
        free = state.free_by_class()
        singles = state.singles()
        arrivals = problem.arriving
        opts = {j.id: options_for(problem, state, j, free, singles) for j in arrivals}
        candidates = self._candidates(problem, arrivals, opts, free)
        hint = _greedy(candidates, free, arrivals)
        if len(arrivals) <= 1:
            chosen, status, gap = hint, "optimal", 0.0  # enumeration of one job's options
        else:
            chosen, status, gap = self._solve(candidates, free, arrivals, hint)
        return self._placement(opts, chosen, status, gap, start, free)

    # -- model ------------------------------------------------------------------------
    def _candidates(
        self, problem: PlacementProblem, arrivals: tuple[Job, ...],
        opts: dict[str, JobOptions], free: dict[tuple[str, int], list[str]],
    ) -> list[_Var]:
        out: list[_Var] = []
        keep_joins = max(1, len(arrivals))
        for job in arrivals:
            joins = []
            for c in opts[job.id].choices:
                if c.partner is None:
                    key = (c.gpu_type, problem.gpu(c.gpus[0]).capacity)
                    out.append(_Var(None, (job,), c.energy_j, ("class", key, job.num_gpus), (c,)))
                else:
                    joins.append(c)
            joins.sort(key=lambda c: c.energy_j)
            for c in joins[:keep_joins]:
                out.append(_Var(None, (job,), c.energy_j, ("single", c.gpus[0]), (c,)))
        out.extend(self._new_pairs(problem, arrivals, opts, free))
        return out

    def _new_pairs(
        self, problem: PlacementProblem, arrivals: tuple[Job, ...],
        opts: dict[str, JobOptions], free: dict[tuple[str, int], list[str]],
    ) -> list[_Var]:
        shareable = [k for k, ids in free.items() if k[1] == 2 and ids]
        singles = [j for j in arrivals if j.num_gpus == 1]
        if not shareable or len(singles) < 2:
            return []
        need = sum(j.num_gpus for j in arrivals)
        plentiful = all(len(ids) >= need for ids in free.values())
        best_alone = {
            j.id: min((c.energy_j for c in opts[j.id].choices if c.partner is None), default=math.inf)
            for j in singles
        }
        thr = problem.throughputs
        fast_enough = {
            (j.id, k[0]): thr.isolated(j, k[0]) >= j.required_throughput
            for j in singles for k in shareable
        }
        out = []
        for a, b in combinations(singles, 2):
            for key in shareable:
                t = key[0]
                if not (fast_enough[(a.id, t)] and fast_enough[(b.id, t)]):
                    continue
                reason, ta, tb, energy, power = pair_figures(problem, a, b, t)
                if reason is not None:
                    continue
                if plentiful and energy >= best_alone[a.id] + best_alone[b.id]:
                    continue
                # Each job carries the pair's energy in proportion to what it would
                # use alone on this type, so its share compares with its solo options.
                ea = alone_energy(problem, a, t, max(thr.isolated(a, t), ta))
                eb = alone_energy(problem, b, t, max(thr.isolated(b, t), tb))
                sa = ea / (ea + eb) if ea + eb > 0 else 0.5
                ca = Choice(t, (), ta, energy * sa, power * sa, b.id, tb, True)
                cb = Choice(t, (), tb, energy * (1 - sa), power * (1 - sa), a.id, ta, True)
                out.append(_Var(None, (a, b), energy, ("class", key, 1), (ca, cb)))
        return out

    def _solve(
        self, cands: list[_Var], free: dict[tuple[str, int], list[str]],
        arrivals: tuple[Job, ...], hint: list[_Var],
    ) -> tuple[list[_Var], str, float]:
        if not cands:
            return [], "optimal", 0.0
        model = cp_model.CpModel()
        top = max(abs(v.cost) for v in cands) or 1.0
        unit = top / _RESOLUTION
        reward = sum(_RESOLUTION * len(v.jobs) for v in cands) + 1
        per_job: dict[str, list] = defaultdict(list)
        per_class: dict[tuple[str, int], list] = defaultdict(list)
        per_single: dict[str, list] = defaultdict(list)
        terms = []
        hinted = {id(v) for v in hint}
        for i, v in enumerate(cands):
            v.var = model.new_bool_var(f"v{i}")
            for job in v.jobs:
                per_job[job.id].append(v.var)
            kind = v.resource[0]
            if kind == "class":
                per_class[v.resource[1]].append(v.resource[2] * v.var)
            else:
                per_single[v.resource[1]].append(v.var)
            terms.append((round(v.cost / unit) - reward * len(v.jobs), v.var))
            model.add_hint(v.var, id(v) in hinted)
        for vs in per_job.values():
            model.add_at_most_one(vs)
        for vs in per_single.values():
            model.add_at_most_one(vs)
        for key, uses in per_class.items():
            model.add(sum(uses) <= len(free[key]))
        model.minimize(sum(c * x for c, x in terms))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = self.time_limit_s
        solver.parameters.num_workers = self.num_workers
        solver.parameters.relative_gap_limit = self.relative_gap
        code = solver.solve(model)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return hint, "feasible", math.nan
        chosen = [v for v in cands if solver.boolean_value(v.var)]
        obj, bound = solver.objective_value, solver.best_objective_bound
        placed = sum(len(v.jobs) for v in chosen)
        energy_part = obj + reward * placed
        if code == cp_model.OPTIMAL:
            return chosen, "optimal", max(0.0, (obj - bound) / max(abs(energy_part), 1.0))
        return chosen, "feasible", (obj - bound) / max(abs(energy_part), 1.0)

    # -- result -----------------------------------------------------------------------
    def _placement(
        self, opts: dict[str, JobOptions], chosen: list[_Var], status: str, gap: float,
        start: float, free: dict[tuple[str, int], list[str]],
    ) -> Placement:
        next_free = {k: iter(ids) for k, ids in free.items()}
        assignments: list[Assignment] = []
        explanations: dict[str, Explanation] = {}
        for v in chosen:
            if v.resource[0] == "class":
                key, n = v.resource[1], v.resource[2]
                gpus = tuple(next(next_free[key]) for _ in range(n))
            else:
                gpus = (v.resource[1],)
            for job, option in zip(v.jobs, v.choices, strict=True):
                c = Choice(option.gpu_type, gpus, option.throughput, option.energy_j,
                           option.power_w, option.partner, option.partner_throughput,
                           option.partner_is_new)
                assignments.append(Assignment(
                    job_id=job.id, gpu_type=c.gpu_type, gpus=gpus, throughput=c.throughput,
                    energy_j=c.energy_j, partner=c.partner, partner_throughput=c.partner_throughput,
                ))
                explanations[job.id] = explain(
                    opts[job.id], c, note=f"{self.name} ({status})", option=option
                )
        placed = {a.job_id for a in assignments}
        waiting = []
        for jid, o in opts.items():
            if jid not in placed:
                waiting.append(Waiting(jid, waiting_reason(o), o.best_throughput))
                explanations[jid] = explain(o, None, note=self.name)
        order = {jid: i for i, jid in enumerate(opts)}
        assignments.sort(key=lambda a: order[a.job_id])
        return Placement(
            policy=self.name, assignments=tuple(assignments), waiting=tuple(waiting),
            status=status, gap=gap, solve_ms=(time.perf_counter() - start) * 1e3,
            explanations=explanations,
        )


def _greedy(
    cands: list[_Var], free: dict[tuple[str, int], list[str]], arrivals: tuple[Job, ...]
) -> list[_Var]:
    """Cheapest available candidate per job, in arrival order: the hint and the fallback."""
    left = {k: len(ids) for k, ids in free.items()}
    used_single: set[str] = set()
    placed: set[str] = set()
    by_job: dict[str, list[_Var]] = defaultdict(list)
    for v in cands:
        if len(v.jobs) == 1:
            by_job[v.jobs[0].id].append(v)
    out = []
    for job in arrivals:
        for v in sorted(by_job[job.id], key=lambda v: v.cost):
            kind = v.resource[0]
            if kind == "class" and left[v.resource[1]] >= v.resource[2]:
                left[v.resource[1]] -= v.resource[2]
            elif kind == "single" and v.resource[1] not in used_single:
                used_single.add(v.resource[1])
            else:
                continue
            out.append(v)
            placed.add(job.id)
            break
    return out


__all__ = ["GoghOptimizer"]

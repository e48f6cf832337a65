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

Objective: lexicographic, in two stages on one model (place as many jobs as
possible; then least energy at that count), energies scaled to integers
(~1e-6 relative resolution). A single arrival is solved by enumeration, which is exact and fast.
A greedy solution is given as a hint and is the fallback if the time limit hits
before CP-SAT finds anything.
"""

from __future__ import annotations

import dataclasses
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
    best_pair,
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
    # One CP-SAT worker with the full LP relaxation beat two default workers on
    # 2 cores, on every benchmark case (docs/performance.md).
    num_workers: int = 1
    relative_gap: float = 0.0
    name: str = "optimizer"
    #: power-limit levels this policy chooses from (fractions of each type's range) when the
    #: problem names none: the optimiser decides GPU, partner and limit together
    power_limit_levels: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0 seconds, got {self.time_limit_s!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers!r}")
        if not 0 <= self.relative_gap < 1:
            raise ValueError(f"relative_gap must be in [0, 1), got {self.relative_gap!r}")

    def place(self, problem: PlacementProblem) -> Placement:
        start = time.perf_counter()
        if self.power_limit_levels and not problem.power_limit_levels:
            problem = dataclasses.replace(problem, power_limit_levels=tuple(self.power_limit_levels))
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
            deadline = start + self.time_limit_s  # the limit bounds the whole decision
            chosen, status, gap = self._solve(candidates, free, arrivals, hint, deadline)
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
                reason, ta, tb, energy, power, limit, e_ref = best_pair(problem, a, b, t, problem.limit_levels(t))
                if reason is not None:
                    continue
                if plentiful and energy >= best_alone[a.id] + best_alone[b.id]:
                    continue
                # Each job carries the pair's energy in proportion to what it would
                # use alone on this type, so its share compares with its solo options.
                ea = alone_energy(problem, a, t, max(thr.isolated(a, t), ta))
                eb = alone_energy(problem, b, t, max(thr.isolated(b, t), tb))
                sa = ea / (ea + eb) if ea + eb > 0 else 0.5
                saved = e_ref - energy
                ca = Choice(t, (), ta, energy * sa, power * sa, b.id, tb, True, limit, saved * sa)
                cb = Choice(t, (), tb, energy * (1 - sa), power * (1 - sa), a.id, ta, True, limit, saved * (1 - sa))
                out.append(_Var(None, (a, b), energy, ("class", key, 1), (ca, cb)))
        return out

    def _solve(
        self, cands: list[_Var], free: dict[tuple[str, int], list[str]],
        arrivals: tuple[Job, ...], hint: list[_Var], deadline: float,
    ) -> tuple[list[_Var], str, float]:
        """Two stages on one model: most jobs placed, then least energy at that count.

        Solving the lexicographic objective in stages keeps the energy gap
        meaningful: a single weighted objective mixes the count into the bound.
        """
        if not cands:
            return [], "optimal", 0.0
        model = cp_model.CpModel()
        top = max(abs(v.cost) for v in cands) or 1.0
        unit = top / _RESOLUTION
        per_job: dict[str, list] = defaultdict(list)
        per_class: dict[tuple[str, int], list] = defaultdict(list)
        per_single: dict[str, list] = defaultdict(list)
        for i, v in enumerate(cands):
            v.var = model.new_bool_var(f"v{i}")
            for job in v.jobs:
                per_job[job.id].append(v.var)
            if v.resource[0] == "class":
                per_class[v.resource[1]].append(v.resource[2] * v.var)
            else:
                per_single[v.resource[1]].append(v.var)
        for vs in per_job.values():
            model.add_at_most_one(vs)
        for vs in per_single.values():
            model.add_at_most_one(vs)
        for key, uses in per_class.items():
            model.add(sum(uses) <= len(free[key]))
        placed = sum(len(v.jobs) * v.var for v in cands)
        energy = sum(round(v.cost / unit) * v.var for v in cands)

        # Stage 1: place as many arriving jobs as possible (nothing to prove when
        # the greedy hint already places every one of them).
        stage1 = {id(v) for v in hint}
        count = sum(len(v.jobs) for v in hint)
        code1 = cp_model.OPTIMAL
        if count < len(arrivals):
            self._hint(model, cands, stage1)
            model.maximize(placed)
            code1, solver = self._run(model, deadline, share=0.5, linearization=1)
            if code1 not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                return hint, "feasible", math.nan
            count = round(solver.objective_value)
            stage1 = {id(v) for v in cands if solver.boolean_value(v.var)}

        # Stage 2: least energy among placements of that many jobs.
        model.add(placed >= count)
        self._hint(model, cands, stage1)
        model.minimize(energy)
        code2, solver = self._run(model, deadline, share=1.0, linearization=2)
        if code2 not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return [v for v in cands if id(v) in stage1], "feasible", math.nan
        chosen = [v for v in cands if solver.boolean_value(v.var)]
        obj, bound = solver.objective_value, solver.best_objective_bound
        gap = max(0.0, obj - bound) / max(abs(obj), 1.0)
        optimal = code1 == cp_model.OPTIMAL and code2 == cp_model.OPTIMAL
        return chosen, "optimal" if optimal else "feasible", 0.0 if code2 == cp_model.OPTIMAL else gap

    @staticmethod
    def _hint(model: cp_model.CpModel, cands: list[_Var], on: set[int]) -> None:
        model.clear_hints()
        for v in cands:
            model.add_hint(v.var, id(v) in on)

    def _run(self, model: cp_model.CpModel, deadline: float, share: float, linearization: int):
        """Solve with part of the time left.

        The energy stage needs the full LP relaxation (level 2) to prove
        assignment-shaped models optimal; the counting stage finds good
        solutions faster with the default level (docs/optimizer.md).
        """
        solver = cp_model.CpSolver()
        left = max(0.01, deadline - time.perf_counter())
        solver.parameters.max_time_in_seconds = left * share
        solver.parameters.num_workers = self.num_workers
        solver.parameters.relative_gap_limit = self.relative_gap
        solver.parameters.linearization_level = linearization
        return solver.solve(model), solver

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
                c = dataclasses.replace(option, gpus=gpus)
                assignments.append(Assignment(
                    job_id=job.id, gpu_type=c.gpu_type, gpus=gpus, throughput=c.throughput,
                    energy_j=c.energy_j, partner=c.partner, partner_throughput=c.partner_throughput,
                    power_limit_w=c.power_limit_w,
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
    """A quick feasible answer: the hint for CP-SAT and the fallback at the time limit.

    Each job in arrival order takes its cheapest available solo option. (A pass
    that also pairs arrivals placed more jobs on scarce fleets but gave CP-SAT
    worse starting points elsewhere; measured, not kept.)
    """
    return _greedy_pass([v for v in cands if len(v.jobs) == 1], free, arrivals)


def _greedy_pass(
    cands: list[_Var], free: dict[tuple[str, int], list[str]], arrivals: tuple[Job, ...]
) -> list[_Var]:
    left = {k: len(ids) for k, ids in free.items()}
    used_single: set[str] = set()
    placed: set[str] = set()
    by_job: dict[str, list[_Var]] = defaultdict(list)
    for v in cands:
        for job in v.jobs:
            by_job[job.id].append(v)
    for vs in by_job.values():
        vs.sort(key=lambda v: v.cost / len(v.jobs))
    out = []
    for job in arrivals:
        if job.id in placed:
            continue
        for v in by_job[job.id]:
            if any(j.id in placed for j in v.jobs):
                continue
            kind, key = v.resource[0], v.resource[1]
            if kind == "class" and left[key] >= v.resource[2]:
                left[key] -= v.resource[2]
            elif kind == "single" and key not in used_single:
                used_single.add(key)
            else:
                continue
            out.append(v)
            placed.update(j.id for j in v.jobs)
            break
    return out


__all__ = ["GoghOptimizer"]

"""Fleet-level re-optimisation: running jobs re-assigned together, not one arrival at a time.

Why: each arrival is placed optimally *for that moment*. A job that came early may hold an
efficient GPU type that a later job would gain far more from, and a board's power limit chosen
for a pair stays after one of them leaves. Gavel's insight (OSDI'20) is that scarce fast GPUs
should go to the jobs that gain most from them; here the gain is energy at each job's
requirement. :func:`reoptimize` re-solves the running jobs together:

* every job running **alone** (a gang on its GPUs included) may **move** to empty GPUs of
  another type (including those another mover leaves: swaps), paying the migration (its new
  boards draw for ``migration_s`` without progress), or **stay**;
* every board that stays keeps its jobs and gets the least-energy power limit at which all of
  them still meet their requirements (limits follow partners coming and going);
* at most ``budget`` jobs move per call, and a move must save at least ``min_gain`` of that
  job's remaining energy where it is (moves have costs the model does not see: checkpoints,
  risk), so a marginal reshuffle never happens.

One job of a shared board may leave it for an empty GPU (charged, as a join is, what the
pair uses beyond its partner alone; the partner then gets its own best limit). Moves land on
empty GPUs only (pairs are formed at arrival by the optimiser). The assignment is a small integer programme solved
with CP-SAT: one boolean per (movable job, type it could move to), a capacity constraint per
type counting the GPUs movers leave, and the budget.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

from ortools.sat.python import cp_model

from gogh_flows.energy import EnergyModel
from gogh_flows.placement.options import best_pair, least_alone_energy
from gogh_flows.placement.problem import Job, PlacementProblem

_RESOLUTION = 1_000_000


@dataclass(frozen=True, slots=True)
class Move:
    job_id: str
    from_gpus: tuple[str, ...]
    to_gpus: tuple[str, ...]
    to_type: str
    power_limit_w: float | None  # the limit to set on the new GPU (None: its maximum)
    saving_j: float  # predicted remaining energy where it was minus where it goes, migration included


@dataclass(frozen=True)
class Replan:
    moves: tuple[Move, ...]
    limits: dict[str, float | None]  # GPU id -> new limit, for boards that stay and change it
    saving_j: float  # predicted remaining energy saved by the moves and limit changes together
    status: str  # "optimal", "feasible" or "unchanged" (nothing worth doing)
    solve_ms: float
    gap: float = 0.0  # relative gap of the moves' saving to CP-SAT's bound (0 when proven optimal)


def reoptimize(problem: PlacementProblem, *, migration_s: float = 60.0, budget: int = 8,
               min_gain: float = 0.1, time_limit_s: float = 10.0,
               energy: EnergyModel | None = None, pinned: frozenset[str] = frozenset()) -> Replan:
    """Moves and limit changes that cut the running jobs' predicted remaining energy.

    ``problem`` holds the running jobs (with their remaining work) on the fleet; arriving jobs
    are ignored (the per-arrival path places them). ``energy`` costs the decision (default the
    problem's; the simulator passes one without idle power for an always-on fleet). The
    limit levels are the problem's ``power_limit_levels``; without them only moves are weighed.
    Jobs in ``pinned`` (for example, restarting after a move) stay where they are.
    """
    if budget < 0:
        raise ValueError(f"budget must be a number of moves >= 0, got {budget!r}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
    if migration_s < 0:
        raise ValueError(f"migration_s must be >= 0 seconds, got {migration_s!r}")
    start = time.perf_counter()
    energy = energy or problem.energy
    thr = problem.throughputs
    limited = bool(problem.power_limit_levels)
    limits: dict[str, float | None] = {}
    saving = 0.0
    stay_cost: dict[str, float] = {}  # movable job id -> its remaining energy if it stays
    movable: list[tuple[Job, str, str]] = []  # (job, gpu id, gpu type)
    partner_of: dict[str, Job] = {}  # a movable job sharing its board -> the other job
    after_leave: dict[str, float | None] = {}  # board -> its limit when one of its pair leaves
    free: dict[str, list[str]] = defaultdict(list)
    for g in problem.gpus:
        occ = problem.occupants(g.id)
        now = problem.gpu_limit(g.id)
        levels = (now, *(v for v in problem.limit_levels(g.gpu_type) if v != now)) if limited else (now,)
        if not occ:
            free[g.gpu_type].append(g.id)
        elif len(occ) == 1 and (occ[0].num_gpus == 1 or occ[0].gpus[0] == g.id):
            job = occ[0]  # alone, or a gang seen once (on its first GPU)
            current = least_alone_energy(problem, energy, job, g.gpu_type, job.work, (now,))[0]
            best, limit = least_alone_energy(problem, energy, job, g.gpu_type, job.work, levels)
            if limit != now and best < current:
                limits.update({gid: limit for gid in job.gpus})
                saving += current - best
            stay_cost[job.id] = min(best, current)
            movable.append((job, g.id, g.gpu_type))
        elif len(occ) == 2:
            a, b = occ
            reason, _, _, e_best, _, limit, e_now = best_pair(problem, a, b, g.gpu_type, levels)
            if reason is None and limit != now and math.isfinite(e_now) and e_best < e_now:
                limits[g.id] = limit
                saving += e_now - e_best
            if not math.isfinite(e_now):
                continue
            # Either may leave for an empty GPU (not both): it is charged what the pair uses
            # beyond its partner alone, as a join is costed (options.options_for).
            for job, other in ((a, b), (b, a)):
                alone_other, other_limit = least_alone_energy(problem, energy, other, g.gpu_type, other.work, levels)
                if not math.isfinite(alone_other):
                    continue
                stay_cost[job.id] = e_now - alone_other
                partner_of[job.id] = other
                after_leave[(g.id, job.id)] = other_limit  # type: ignore[index]
                movable.append((job, g.id, g.gpu_type))
    # Where each movable job could go, and what it would cost there (migration included).
    types = sorted({g.gpu_type for g in problem.gpus})
    options: list[tuple[Job, str, str, float, float | None]] = []  # job, from gpu, to type, cost, limit
    for job, gid, here in movable:
        if budget == 0 or job.id in pinned or not math.isfinite(stay_cost[job.id]):
            continue
        for t in types:
            if t == here:
                continue  # the same type alone again gains nothing
            rate = thr.isolated(job, t)
            if not rate > 0:
                continue
            cost, limit = least_alone_energy(problem, energy, job, t, job.work + migration_s * rate,
                                 problem.limit_levels(t))
            if cost <= (1 - min_gain) * stay_cost[job.id]:
                options.append((job, gid, t, cost, limit))
    if not options:
        status = "unchanged" if not limits else "optimal"
        return Replan((), limits, saving, status, (time.perf_counter() - start) * 1e3)

    model = cp_model.CpModel()
    gain = [stay_cost[job.id] - cost for job, _, _, cost, _ in options]
    unit = max(gain) / _RESOLUTION
    x = [model.new_bool_var(f"m{i}") for i in range(len(options))]
    by_job: dict[str, list[int]] = defaultdict(list)
    into: dict[str, list[int]] = defaultdict(list)
    for i, (job, _, t, _, _) in enumerate(options):
        by_job[job.id].append(i)
        into[t].append(i)
    for idx in by_job.values():
        model.add(sum(x[i] for i in idx) <= 1)
    by_board: dict[str, list[int]] = defaultdict(list)
    for i, (_, gid, _, _, _) in enumerate(options):
        by_board[gid].append(i)
    for idx in by_board.values():
        model.add(sum(x[i] for i in idx) <= 1)  # one job per board leaves at most
    here_of = {job.id: here for job, _, here in movable}
    leaving: dict[str, list[int]] = defaultdict(list)  # type -> options that empty a GPU of it
    for i, (job, _, _, _, _) in enumerate(options):
        if job.id not in partner_of:
            leaving[here_of[job.id]].append(i)
    size = [job.num_gpus for job, _, _, _, _ in options]
    for t in types:
        if into[t]:
            model.add(sum(size[i] * x[i] for i in into[t])
                      <= len(free[t]) + sum(size[i] * x[i] for i in leaving[t]))
    model.add(sum(x) <= budget)
    model.maximize(sum(round(g / unit) * x[i] for i, g in enumerate(gain)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    code = solver.solve(model)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Replan((), limits, saving, "optimal" if limits else "unchanged", (time.perf_counter() - start) * 1e3)
    chosen = [i for i in range(len(options)) if solver.value(x[i])]
    # GPU ids: empty GPUs first, then those the movers leave (every mover leaves first).
    pool = {t: list(free[t]) for t in types}
    for i in chosen:
        job, gid, _, _, _ = options[i]
        if job.id not in partner_of:
            pool[here_of[job.id]].extend(job.gpus)
    moves = []
    for i in chosen:
        job, gid, t, cost, limit = options[i]
        to = tuple(pool[t].pop(0) for _ in range(job.num_gpus))
        moves.append(Move(job.id, job.gpus, to, t, limit, stay_cost[job.id] - cost))
        saving += stay_cost[job.id] - cost
        if job.id in partner_of:  # the partner stays, alone, at its own best limit
            left = after_leave[(gid, job.id)]  # type: ignore[index]
            if left != problem.gpu_limit(gid):
                limits[gid] = left
            else:
                limits.pop(gid, None)
        else:
            for old in job.gpus:
                limits.pop(old, None)  # it leaves: the board is empty now
    status = "optimal" if code == cp_model.OPTIMAL else "feasible"
    best, bound = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if status == "optimal" or bound <= 0 else max(0.0, (bound - best) / bound)
    return Replan(tuple(moves), limits, saving, status, (time.perf_counter() - start) * 1e3, gap)


__all__ = ["Move", "Replan", "reoptimize"]

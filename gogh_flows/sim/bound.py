"""The least energy any schedule could spend on a run's jobs: how far a policy is from the floor.

A ratio to greedy-fastest says how much a policy saved, not how much there was to save. This
module answers the second question from the run's own jobs, truth and energy model, at two
strengths:

* **per job** (:attr:`EnergyFloor.per_job_kwh`): every job done at its least-energy
  configuration that meets its requirement (GPU type, partner, power limit), as if no job
  ever had to wait for or compete over a GPU;
* **with capacity** (:attr:`EnergyFloor.fleet_kwh`): a linear relaxation of the whole trace.
  Time is cut into buckets; a job may do any share of its work in any configuration in any
  bucket from its arrival on, no faster than that configuration's rate, and the GPUs of a type
  cannot give more board-time in a bucket than they have. The scarce efficient GPUs then go
  to the jobs that gain most from them, over the whole trace, with hindsight. Solved to
  optimality (the figure is None, with a note saying why, when it is not or when no schedule
  meets the deadlines).

Why they are lower bounds. The simulator charges every busy board its power at its limit.
Split a shared board's draw between its two jobs in proportion to the load each puts on it
(``a_j * r_j``, activity times shared/isolated rate, as the energy model builds the board's
power) and its time half and half; the shares add up to the board's draw and time, so a run's
energy is the sum over jobs of what each was charged for its steps, and every step was done
in some configuration at or above the job's requirement (if the policy met it). A
configuration here is optimistic where partners of one type differ (measurement noise): it
takes the least charge, the least board time and the highest rate over them. Migrations'
restarts only add. Both bounds hold for schedules that meet every requirement all the time
and, for the second, finish within the window; a policy at attainment < 1 can go below them
by the steps it ran too slowly.

Charge per step of job ``j`` sharing a board of type ``t`` with partner ``k`` at limit ``L``:
``(P - idle) * (a_j r_j / load) * slow / shared_j`` above idle (``P`` the board's draw at ``L``,
``slow`` its slowdown, ``r_j = min(1, shared_j / iso_j)``, ``load = a_j r_j + a_k r_k``; with
idle: ``P`` for ``P - idle``), board time ``slow / (2 * shared_j)``; alone ``(P - idle) * slow /
iso_j`` and ``slow / iso_j`` on each of its GPUs. The split by load is exact; the bound is loose
where each job of a pair picks its most favourable partner on its own, where a job's work is
split across configurations and buckets at will, and where gangs would wait for a whole pool.
GLOP solves the relaxation; when it gives up on a badly conditioned program, HiGHS (scipy).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gogh_flows.energy import J_PER_KWH, EnergyModel
from gogh_flows.placement.problem import Job, level_watts
from gogh_flows.sim.engine import SimJob, SimResult, TrueRates

__all__ = ["INFEASIBLE", "EnergyFloor", "FINE_LEVELS", "energy_floor", "floor_rows", "job_configurations"]

#: "any limit in the range": 5% steps (the policies choose among a handful of levels)
FINE_LEVELS = tuple(round(0.05 * i, 2) for i in range(20))
#: bounds the relaxation's size (variables ~ jobs x configurations x buckets)
MAX_LP_VARIABLES = 400_000
#: the least time a job is given in a bucket it may use at all (numerical conditioning)
MIN_OPEN_S = 60.0
#: why a floor is missing when no schedule meeting every requirement meets the deadlines (with
#: measurement noise a reference policy can finish a job sooner by running it, or its partner,
#: below its requirement)
INFEASIBLE = "infeasible: no schedule meeting every requirement finishes every job by its deadline"


@dataclass(frozen=True)
class Configurations:
    """One job's ways to run: a row per (GPU type, partner type or alone, limit).

    Per step: ``above_j`` and ``total_j`` (J, above idle and with the board's idle), ``board_s``
    (GPU-seconds charged to its type's capacity), ``rate`` (steps/s); per row its GPU type (index
    into the fleet's sorted types), whether it shares the board, and the limit (W).
    """

    gpu_type: np.ndarray
    above_j: np.ndarray
    total_j: np.ndarray
    board_s: np.ndarray
    rate: np.ndarray
    shared: np.ndarray
    limit_w: np.ndarray


@dataclass(frozen=True)
class EnergyFloor:
    """Least energy of a run's jobs, in kWh: above idle (what an always-on fleet's jobs add to
    its idle floor) and in total (busy boards' idle included: what a parked fleet pays)."""

    per_job_above_kwh: float
    per_job_total_kwh: float
    levels: tuple[float, ...]
    #: with the fleet's capacity over the window (None: not solved to optimality, or not asked)
    fleet_above_kwh: float | None = None
    fleet_total_kwh: float | None = None
    buckets: int = 0
    #: jobs that no configuration meets (not counted: no policy can run them at their requirement)
    infeasible: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: how the above-idle relaxation does the work: share of its GPU-hours per (GPU type, shares
    #: its board, limit W)
    usage: Mapping[tuple[str, bool, float], float] = field(default_factory=dict)


def _limits(energy: EnergyModel, gpu_type: str, levels: Sequence[float]) -> np.ndarray:
    """Limits in W, the maximum first; only the maximum for a type without a known range."""
    g = energy.gpu(gpu_type)
    top = energy.max_limit(g)
    if g.power_limit_range_w is None or not levels:
        return np.array([top])
    return np.array([top, *sorted({level_watts(g, f) for f in levels if f < 1}, reverse=True)])


def job_configurations(jobs: Sequence[SimJob], fleet: Mapping[str, int], rates: TrueRates,
                       energy: EnergyModel | None = None,
                       levels: Sequence[float] = FINE_LEVELS) -> dict[str, Configurations]:
    """Every job's configurations that meet its requirement (and its partner's), by job id; a
    gang only on a type with as many GPUs in ``fleet`` (GPUs per type)."""
    gpu_types = sorted(fleet)
    energy = energy or EnergyModel()
    view = rates.view
    as_job = {s.id: Job(s.id, s.job_type, float(s.required_throughput), float(s.total_steps), s.num_gpus)
              for s in jobs}
    rho = {s.id: float(s.required_throughput) for s in jobs}
    rows: dict[str, list[np.ndarray]] = defaultdict(list)  # id -> blocks of Configurations' columns
    singles: dict[str, list[str]] = defaultdict(list)
    for s in jobs:
        if s.num_gpus == 1:
            singles[s.job_type].append(s.id)
    first = {s.job_type: as_job[s.id] for s in jobs}

    def add(j: str, ti: int, above, total, board, rate, limit, shared: bool) -> None:
        above = np.ravel(above)
        rows[j].append(np.stack([np.full(above.shape, float(ti)), above, np.ravel(total),
                                 np.ravel(board), np.ravel(rate), np.full(above.shape, float(shared)),
                                 np.ravel(limit)]))

    for ti, t in enumerate(gpu_types):
        if fleet[t] < 1:
            continue  # no GPU of the type: nothing runs there
        g = energy.gpu(t)
        idle, dyn = g.idle_w, g.tdp_w - g.idle_w
        lims = _limits(energy, t, levels)
        iso = {j: rates.alone(job, t) for j, job in as_job.items()}
        act = {jt: view.activity(job, t) for jt, job in first.items()}
        for j, job in as_job.items():  # alone, on each of its GPUs
            if iso[j] <= 0 or job.num_gpus > fleet[t]:
                continue
            slow, board = energy.at_limits(t, np.array([idle + act[job.job_type] * dyn]), lims)
            ok = iso[j] / slow >= rho[j] * (1 - 1e-9)
            if ok.any():
                per_step = job.num_gpus * slow[ok] / iso[j]
                add(j, ti, (board[ok] - idle) * per_step, board[ok] * per_step, per_step, iso[j] / slow[ok], lims[ok], False)
        for jt, own_ids in singles.items():  # sharing: own jobs x partners x limits per type pair
            own_iso = np.array([iso[j] for j in own_ids])
            if not (own_iso > 0).any():
                continue
            own_rho = np.array([rho[j] for j in own_ids])
            safe_iso = np.where(own_iso > 0, own_iso, np.inf)
            for pt, partner_ids in singles.items():
                pair_own, pair_partner = view.table.pair(jt, pt, t)
                if pair_own <= 0 or pair_partner <= 0:
                    continue
                shared = np.array([rates.shared(as_job[j], first[pt], t) for j in own_ids])
                r_own = np.minimum(1.0, shared / safe_iso)
                k_iso = np.array([iso[k] for k in partner_ids])
                k_shared = np.array([rates.shared(as_job[k], first[jt], t) for k in partner_ids])
                k_rho = np.array([rho[k] for k in partner_ids])
                r_k = np.minimum(1.0, k_shared / np.where(k_iso > 0, k_iso, np.inf))
                # partners alike to the bound: keep the least demanding requirement (the slowest
                # board they allow)
                keys, inverse = np.unique(np.round(r_k, 12), return_inverse=True)
                allow = np.zeros(keys.shape)
                np.maximum.at(allow, inverse, np.where(k_rho > 0, k_shared / k_rho, 0.0))
                keep = (allow > 0) & (keys > 0)
                keys, allow = keys[keep], allow[keep]
                if keys.size == 0:
                    continue
                a_j, a_k = act[jt], act[pt]
                load = a_j * r_own[:, None] + a_k * keys[None, :]  # own job x partner
                p0 = idle + np.minimum(1.0, load) * dyn
                slow, board = energy.at_limits(t, p0[:, :, None], lims[None, None, :])
                rate = shared[:, None, None] / slow
                ok = (rate >= own_rho[:, None, None] * (1 - 1e-9)) & (slow <= allow[None, :, None] * (1 + 1e-9)) \
                    & (shared[:, None, None] > 0)
                # the job's share of the board, a_j r_j / load, over its steps per second: r_j is
                # capped at 1 (as the engine builds the board's power), so a pair that runs a job
                # faster than alone does not lower its share
                safe_shared = np.where(shared > 0, shared, np.inf)
                per_step = a_j * r_own[:, None, None] * slow / (load[:, :, None] * safe_shared[:, None, None])
                inf = np.inf
                # optimistic over the partners of this type: least charge and board time, best rate
                above = np.where(ok, (board - idle) * per_step, inf).min(axis=1)
                total = np.where(ok, board * per_step, inf).min(axis=1)
                board_s = np.where(ok, slow / (2 * safe_shared[:, None, None]), inf).min(axis=1)
                best_rate = np.where(ok, rate, 0.0).max(axis=1)
                for i, j in enumerate(own_ids):
                    fine = np.isfinite(above[i])
                    if fine.any():
                        add(j, ti, above[i][fine], total[i][fine], board_s[i][fine], best_rate[i][fine], lims[fine], True)
    out: dict[str, Configurations] = {}
    for j, blocks in rows.items():
        m = np.concatenate(blocks, axis=1)
        out[j] = Configurations(gpu_type=m[0].astype(int), above_j=m[1], total_j=m[2], board_s=m[3], rate=m[4],
                                shared=m[5].astype(bool), limit_w=m[6])
    return out


def _pareto(cost: np.ndarray, board: np.ndarray, rate: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Indices of configurations no other of the same GPU type beats on charge, board time and rate."""
    keep = []
    for t in np.unique(types):
        idx = np.flatnonzero(types == t)
        c, b, r = cost[idx], board[idx], rate[idx]
        no_worse = (c[:, None] <= c[None, :]) & (b[:, None] <= b[None, :]) & (r[:, None] >= r[None, :])
        better = (c[:, None] < c[None, :]) | (b[:, None] < b[None, :]) | (r[:, None] > r[None, :])
        dominated = (no_worse & better).any(axis=0)
        # exact duplicates: keep the first
        same = no_worse & ~better
        dup = np.triu(same, 1).any(axis=0)
        keep.extend(idx[~dominated & ~dup])
    return np.array(sorted(keep), dtype=int)


def _spans(jobs: Sequence[SimJob], window_s: float, deadlines: Mapping[str, float] | None,
           buckets: int) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """Bucket edges and each job's [first, last) bucket between its arrival and its deadline."""
    edges = np.linspace(0.0, window_s, buckets + 1)
    spans = {}
    for s in jobs:
        end = min(window_s, deadlines.get(s.id, window_s)) if deadlines else window_s
        first = max(0, int(np.searchsorted(edges, s.arrival_s, side="right")) - 1)
        last = min(buckets, int(np.searchsorted(edges, end, side="left")))
        spans[s.id] = (first, max(first, last))
    return edges, spans


def _fleet_lp(jobs: Sequence[SimJob], configs: Mapping[str, Configurations], keep: Mapping[str, np.ndarray],
              fleet: Mapping[str, int], gpu_types: Sequence[str], window_s: float, buckets: int,
              deadlines: Mapping[str, float] | None, use_total: bool,
              time_limit_s: float) -> tuple[float | None, dict[tuple[str, bool, float], float], str]:
    """The relaxation's optimum in kWh, how it does the work (share of the GPU-hours it uses per
    (GPU type, shared, limit W)) and, when there is no optimum, why: :data:`INFEASIBLE` (no
    schedule meeting every requirement meets the deadlines either) or GLOP's status."""
    import scipy.sparse as sp
    from ortools.linear_solver.python import model_builder as mb

    edges, spans = _spans(jobs, window_s, deadlines, buckets)
    blocks: dict[str, list[np.ndarray]] = defaultdict(list)
    n_jobs = 0
    for s in jobs:
        c = configs.get(s.id)
        if c is None:
            continue
        k = keep[s.id]
        cost = (c.total_j if use_total else c.above_j)[k] * s.total_steps / J_PER_KWH
        end = min(window_s, deadlines.get(s.id, window_s)) if deadlines else window_s
        # not even its fastest configuration finishes it in time: no schedule meets the deadline
        if (end - s.arrival_s) * float(c.rate[k].max()) < s.total_steps * (1 - 1e-6):
            return None, {}, INFEASIBLE
        for b in range(*spans[s.id]):
            open_s = min(edges[b + 1], end) - max(edges[b], s.arrival_s)
            if open_s <= 0:
                continue
            n = k.size
            blocks["job"].append(np.full(n, n_jobs))
            blocks["cost"].append(cost)
            blocks["board"].append(c.board_s[k] * s.total_steps / 3600.0)  # GPU-h for all its work
            blocks["hours"].append(s.total_steps / c.rate[k] / 3600.0)  # hours to do all of it there
            blocks["type"].append(c.gpu_type[k])
            blocks["bucket"].append(np.full(n, b))
            # a sliver of a bucket (a deadline just past its start) counts as a minute: more time
            # only loosens the relaxation, and a coefficient ratio of 1e7 makes GLOP give up
            blocks["open"].append(np.full(n, max(open_s, MIN_OPEN_S) / 3600.0))
            blocks["shared"].append(c.shared[k])
            blocks["limit"].append(c.limit_w[k])
        n_jobs += 1
    if not blocks:
        return 0.0, {}, ""
    col = {name: np.concatenate(parts) for name, parts in blocks.items()}
    n_var = col["cost"].size
    # rows: each job done once; a job's time within a bucket; a type's board-time per bucket
    jb_unique, jb_row = np.unique(col["job"] * buckets + col["bucket"], return_inverse=True)
    jb_open = np.zeros(jb_unique.size)
    np.maximum.at(jb_open, jb_row, col["open"])
    cap_row = col["type"] * buckets + col["bucket"]
    hours = np.diff(edges) / 3600.0
    capacity = np.array([fleet.get(t, 0) * h for t in gpu_types for h in hours])
    # every row scaled to a right-hand side of 1 (time as a share of the open time, board time
    # as a share of the capacity): hours and GPU-hours of a long trace span 1e-2..1e5
    var = np.arange(n_var)
    matrix = sp.csr_matrix(
        (np.concatenate([np.ones(n_var), col["hours"] / jb_open[jb_row], col["board"] / capacity[cap_row]]),
         (np.concatenate([col["job"], n_jobs + jb_row, n_jobs + jb_unique.size + cap_row]), np.tile(var, 3))),
        shape=(n_jobs + jb_unique.size + len(gpu_types) * buckets, n_var))
    lower = np.concatenate([np.ones(n_jobs), np.full(matrix.shape[0] - n_jobs, -np.inf)])
    model = mb.Model()
    model.helper.fill_model_from_sparse_data(np.zeros(n_var), np.ones(n_var), col["cost"], lower,
                                             np.ones(matrix.shape[0]), matrix)
    solver = mb.Solver("glop")
    solver.set_time_limit_in_seconds(time_limit_s)
    status = solver.solve(model)
    if status == mb.SolveStatus.OPTIMAL:
        value, x = float(solver.objective_value), np.asarray(solver.values(model.get_variables()), dtype=float)
    elif status == mb.SolveStatus.INFEASIBLE:
        return None, {}, INFEASIBLE
    else:
        # GLOP gives up on some badly conditioned programs (ABNORMAL on the MSR trace with noise
        # and deadlines); HiGHS, through scipy, solves them to optimality
        from scipy.optimize import linprog

        rows_ub = matrix[n_jobs:]
        res = linprog(col["cost"], A_ub=rows_ub, b_ub=np.ones(rows_ub.shape[0]), A_eq=matrix[:n_jobs],
                      b_eq=np.ones(n_jobs), bounds=(0.0, 1.0), method="highs",
                      options={"time_limit": time_limit_s})
        if res.status == 2:
            return None, {}, INFEASIBLE
        if res.status != 0:
            return None, {}, f"not solved to optimality (GLOP {status.name}; HiGHS: {res.message})"
        value, x = float(res.fun), np.asarray(res.x, dtype=float)
    done = x * col["board"]  # GPU-h
    usage: dict[tuple[str, bool, float], float] = defaultdict(float)
    for key in zip(col["type"][done > 0], col["shared"][done > 0], col["limit"][done > 0], done[done > 0]):
        usage[(gpu_types[int(key[0])], bool(key[1]), round(float(key[2]), 1))] += float(key[3])
    total = sum(usage.values())
    return value, ({k: v / total for k, v in usage.items()} if total > 0 else {}), ""


def energy_floor(jobs: Sequence[SimJob], fleet: Mapping[str, int], rates: TrueRates,
                 energy: EnergyModel | None = None, levels: Sequence[float] = FINE_LEVELS,
                 window_s: float | None = None, deadlines: Mapping[str, float] | None = None,
                 buckets: int = 96, time_limit_s: float = 120.0) -> EnergyFloor:
    """The least energy ``jobs`` could take on ``fleet`` (GPUs per type) under the truth ``rates``.

    ``levels``: fractions of each type's limit range a board may be set to (the maximum is
    always allowed); ``()`` for no limits. ``rates`` is the simulator's truth
    (``TrueRates(table, noise, seed)``, the noise and seed of the runs it is set beside).
    ``window_s``: the common window of those runs; with it the capacity relaxation is solved
    too, on at most ``buckets`` buckets (fewer for a long trace, to bound its size).
    ``deadlines``: by job id, the time (s) by which a job must be done, for example when a
    reference policy finished it: the floor then holds for schedules that delay no job
    beyond it. Without, a job may wait until the window's end.
    """
    gpu_types = sorted(fleet)
    configs = job_configurations(jobs, fleet, rates, energy, levels)
    infeasible = tuple(s.id for s in jobs if s.id not in configs)
    per_above = sum(s.total_steps * configs[s.id].above_j.min() for s in jobs if s.id in configs)
    per_total = sum(s.total_steps * configs[s.id].total_j.min() for s in jobs if s.id in configs)
    fleet_kwh: list[float | None] = [None, None]
    usage: dict[tuple[str, bool, float], float] = {}
    notes: list[str] = []
    used = 0
    if window_s is not None and window_s > 0:
        for i, use_total in enumerate((False, True)):
            keep = {j: _pareto(c.total_j if use_total else c.above_j, c.board_s, c.rate, c.gpu_type)
                    for j, c in configs.items()}
            used = buckets
            while used > 4:  # the finest buckets that keep the program within its size
                _, spans = _spans(jobs, window_s, deadlines, used)
                size = sum(keep[s.id].size * (spans[s.id][1] - spans[s.id][0]) for s in jobs if s.id in keep)
                if size <= MAX_LP_VARIABLES:
                    break
                used = max(4, int(used * MAX_LP_VARIABLES / size))
            fleet_kwh[i], how, why = _fleet_lp(jobs, configs, keep, fleet, gpu_types, window_s, used,
                                               deadlines, use_total, time_limit_s)
            usage = usage or how
            if why and why not in notes:
                notes.append(why)
    return EnergyFloor(per_job_above_kwh=per_above / J_PER_KWH, per_job_total_kwh=per_total / J_PER_KWH,
                       levels=tuple(levels), fleet_above_kwh=fleet_kwh[0], fleet_total_kwh=fleet_kwh[1],
                       buckets=used, infeasible=infeasible, notes=tuple(notes), usage=usage)


def floor_rows(jobs: Sequence[SimJob], fleet: Mapping[str, int], rates: TrueRates,
               results: Mapping[str, SimResult], *, levels: Sequence[float],
               parked: Mapping[str, SimResult] | None = None,
               reference: str = "greedy-fastest", label: str = "floor") -> dict[str, dict[str, float]]:
    """The floors beside a run's policies, as rows of its energy account (``gogh simulate --floor``).

    ``results``: the run's always-on results (``parked``: the same policies' parked run, when
    there is one; else the parked figures come from the always-on run's occupancy). Two rows:
    jobs free to wait until the common window's end, and (when ``reference`` ran) no job done
    later than ``reference`` did it. Each has ``energy_kwh_on`` (the idle floor plus the least
    draw above it), ``energy_kwh_parked``, and ``on_vs_X`` / ``parked_vs_X`` /
    ``above_idle_vs_X`` for every reference policy of the account (or only a ``note`` saying
    why there is no floor). Rows are named ``"<label>, may wait"`` and ``"<label>, by <reference>"``.
    """
    from gogh_flows.sim.account import energy_accounts

    acc_on = energy_accounts(results)
    acc_p = energy_accounts(parked, parked_run=True) if parked is not None else acc_on
    window = max(next(iter(acc_on.values())).window_s, next(iter(acc_p.values())).window_s)
    # the always-on account's own window (a longer one for the relaxation only loosens it)
    idle_kwh = next(iter(acc_on.values())).idle_floor_kwh
    cases: list[tuple[str, Mapping[str, float] | None]] = [("may wait", None)]
    if reference in results:
        due = {j: r.finished_s for j, r in results[reference].jobs.items() if r.finished_s is not None}
        cases.append((f"by {reference}", due))
    out: dict[str, dict[str, float]] = {}
    for when, deadlines in cases:
        f = energy_floor(jobs, fleet, rates, levels=levels, window_s=window, deadlines=deadlines)
        if f.fleet_above_kwh is None or f.fleet_total_kwh is None:
            out[f"{label}, {when}"] = {"note": "; ".join(f.notes)}
            continue
        on, park = idle_kwh + f.fleet_above_kwh, f.fleet_total_kwh
        row = {"window_h": window / 3600, "energy_kwh_on": on, "energy_kwh_parked": park,
               "idle_floor_kwh": idle_kwh, "lp_buckets": float(f.buckets)}
        for ref, a in acc_on.items():
            if ref in ("greedy-fastest", "oracle"):
                row[f"on_vs_{ref}"] = on / a.always_on_kwh
                row[f"above_idle_vs_{ref}"] = f.fleet_above_kwh / (a.always_on_kwh - a.idle_floor_kwh)
                row[f"parked_vs_{ref}"] = park / acc_p[ref].parked_kwh
        out[f"{label}, {when}"] = row
    return out

"""Round-based, time-sliced simulation: how Gavel's scheduler runs a fleet.

Why a second engine: the event-driven engine (``sim.engine``) places each job on GPUs
until it finishes or moves, which is how gogh-flows and its greedy baselines work.
Gavel-style policies (Narayanan et al., OSDI'20) decide differently: an allocation
gives every active job a *fraction of time* on each GPU type, and rounds of
``round_s`` (360 s in Gavel) run the jobs that are furthest behind their share. That
needs time slicing, which the event-driven path has no use for; keeping it apart keeps
that path as fast as it was.

What is reproduced, from Gavel's simulator as published (``scheduler.py`` at commit
c4fa400, the snapshot our data come from; read to understand, no code copied):

* **Allocation resets.** The allocation is recomputed only when a job arrived or
  finished *and* ``reset_s`` (1920 s) passed since the last reset (or none happened
  yet). Between resets a new job has no allocation: a FIFO-style allocator never runs
  it; others run it only on GPUs nobody with an allocation wants (priority 0).
* **Priorities.** Per GPU type, a job's priority is its allocation there over the share
  of that type's time it received since the reset (received time starts at half a
  round, so newcomers are not infinitely behind); ties go to the larger deficit
  (time owed at earlier resets), then the larger allocation.
* **Rounds.** Types are served fastest first (Gavel's v100, p100, k80; here by FP32
  peak); on each, jobs are taken in priority order while GPUs are left, a job at most
  once per round. A scheduled job runs ``min(int(rate * round_s), steps left)`` steps;
  the round ends when its last job does, so a GPU freed early idles until then.
* **Bookkeeping quirks.** Gavel charges a round's time from the previous round's end
  (also across a gap with nothing running); the priorities here do the same, because
  they decide who runs next. Energy, SLA and JCT use the real times.

What is ours: energy (each scheduled job's board power from the energy model for its
whole run in the round; empty GPUs at idle, or parked at 0 W), true rates with the same
seeded measurement noise as the event-driven engine, and SLA attainment in the event-
driven engine's terms: from a job's first round to its end, the time it ran at or above
its requirement over that whole span. A round in which an active job is not scheduled
counts as time below its requirement (it made no progress), which is what time slicing
costs a job that needs a throughput. ``met_on_average`` in the summary asks the milder
question: did the job's mean rate, first round to end, meet its requirement. ``migrations``
counts every time a job runs on other GPU types than in its previous round (Gavel charges
no cost for it, and neither does this engine).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gogh_flows.catalog import get_gpu_type
from gogh_flows.energy import EnergyModel
from gogh_flows.placement.problem import Gpu, Job, TableThroughputs
from gogh_flows.sim.engine import JobRecord, SimJob, SimResult, TrueRates
from gogh_flows.truth.table import ThroughputTable

__all__ = ["AllocationState", "Allocator", "RoundConfig", "round_order", "simulate_rounds"]


@dataclass(frozen=True)
class RoundConfig:
    """Gavel's defaults: 360 s rounds, allocation resets at most every 1920 s."""

    seed: int = 0
    noise: float = 0.0  # as SimConfig.noise: log-normal sigma on the true rates
    park_idle: bool = False  # empty GPUs draw 0 W instead of their idle power
    horizon_s: float = math.inf  # stop here; later jobs are reported unfinished
    round_s: float = 360.0
    reset_s: float = 1920.0

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise ValueError(f"round_s must be > 0 seconds, got {self.round_s!r}")
        if not self.reset_s >= 0:
            raise ValueError(f"reset_s must be >= 0 seconds, got {self.reset_s!r}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be a log-normal sigma in [0, 1), got {self.noise!r}")
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 seconds, got {self.horizon_s!r}")


@dataclass(frozen=True)
class AllocationState:
    """What an allocator sees at a reset: the active jobs (arrival order) by GPU type.

    Rates are the planning view's isolated steps/s of the whole job (all its GPUs) on
    each type, 0 where it cannot run; ``watts`` is what the job's GPUs draw there.
    """

    now_s: float
    job_ids: tuple[str, ...]
    types: tuple[str, ...]
    rate: np.ndarray  # (jobs, types) steps/s
    watts: np.ndarray  # (jobs, types) W of the job's GPUs together
    scale: np.ndarray  # (jobs,) GPUs per job
    remaining: np.ndarray  # (jobs,) steps left
    required: np.ndarray  # (jobs,) required steps/s
    arrival_s: np.ndarray  # (jobs,)
    capacity: np.ndarray  # (types,) GPUs per type


class Allocator(Protocol):
    """A round-based policy: time fractions per (job, type), rows summing to at most 1."""

    name: str
    #: FIFO-style: a job without an allocation on a type is never scheduled there.
    skips_unallocated: bool

    def allocate(self, state: AllocationState) -> np.ndarray: ...


#: Optional allocator attributes the engine honours: ``shuffle_types = True`` serves the
#: types in a seeded random order each round (Gavel, for heterogeneity-agnostic policies);
#: ``reset_s`` replaces ``RoundConfig.reset_s`` (0: re-allocate at every arrival and end);
#: ``max_copies`` > 1 lets a job run on that many types at once in a round, its copies'
#: steps adding up (HadarE's forking); ``wake_at_s``, when set, is a time by which the
#: allocator wants to decide again even if nothing arrived or ended (RLTune's bounded wait).


def round_order(types: Sequence[str]) -> list[str]:
    """Types in the order a round serves them: fastest (FP32 peak) first, as Gavel's v100, p100, k80."""
    return sorted(types, key=lambda t: (-get_gpu_type(t).fp32_tflops, t))


def simulate_rounds(
    jobs: Sequence[SimJob],
    gpus: Sequence[Gpu],
    truth: ThroughputTable,
    allocator: Allocator,
    *,
    config: RoundConfig | None = None,
    energy: EnergyModel | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Run ``allocator`` in rounds on the job stream; the result reads like ``simulate``'s."""
    config = config or RoundConfig()
    energy = energy or EnergyModel()
    fleet: dict[str, int] = {}
    for g in gpus:
        fleet[g.gpu_type] = fleet.get(g.gpu_type, 0) + 1
    types = round_order(fleet)
    col = {t: i for i, t in enumerate(types)}
    capacity = np.array([fleet[t] for t in types], dtype=float)
    idle_w = np.array([0.0 if config.park_idle else energy.idle_power(t) for t in types])

    pending = sorted(jobs, key=lambda s: s.arrival_s)  # stable: ties keep the trace's order, as Gavel
    view, true = TableThroughputs(truth), TrueRates(truth, config.noise, config.seed)
    plan_rate: dict[str, np.ndarray] = {}
    true_rate: dict[str, np.ndarray] = {}
    watts: dict[str, np.ndarray] = {}
    for s in pending:
        req = s.required_throughput
        job = Job(s.id, s.job_type, float(req) if req and req > 0 else 1e-12,
                  float(max(s.total_steps, 1)), s.num_gpus)
        plan_rate[s.id] = np.array([view.isolated(job, t) for t in types])
        true_rate[s.id] = np.array([true.alone(job, t) if plan_rate[s.id][i] > 0 else 0.0
                                    for i, t in enumerate(types)])
        watts[s.id] = np.array([energy.power_alone(t, view.activity(job, t)) * s.num_gpus
                                for t in types])
    spec = {s.id: s for s in pending}
    records = {s.id: JobRecord(s.id, s.job_type, s.arrival_s, required=s.required_throughput)
               for s in pending}
    size = {s.id: s.num_gpus for s in pending}
    left: dict[str, float] = {s.id: max(1, int(s.total_steps)) for s in pending}
    required = {s.id: float(s.required_throughput or 0.0) for s in pending}

    half = config.round_s / 2
    active: list[str] = []
    share: dict[str, np.ndarray] = {}  # the allocation in force, set at the last reset
    got: dict[str, np.ndarray] = {}  # time received per type since the reset (+ half a round)
    spent = np.zeros(len(types))
    deficit: dict[str, np.ndarray] = {}
    last_reset, dirty = 0.0, False
    decision_ms: list[float] = []
    trace: list[tuple[float, float, float]] = []
    occupancy: list[tuple[float, dict[str, int]]] = [(0.0, dict.fromkeys(fleet, 0))]
    total_j, now, nxt, done = 0.0, 0.0, 0, 0
    round_start, round_end = 0.0, None  # Gavel's bookkeeping (see the module docstring)
    batch: list[tuple[float, str, int, int]] = []  # (finish s, job, type column, steps)
    first_s: dict[str, float] = {}
    shuffler = random.Random(config.seed + 5) if getattr(allocator, "shuffle_types", False) else None
    max_copies = int(getattr(allocator, "max_copies", 1))
    plan: list[tuple[str, int, float, float]] = []  # a round to repeat: (job, type, steps, duration)
    repeat, replay, plan_profile = 0, False, []
    last_on: dict[str, frozenset[int]] = {}  # the GPU types each job last ran on
    migrations = 0
    reset_s = float(getattr(allocator, "reset_s", config.reset_s))

    def profile(segs: list[tuple[float, str, int]]) -> list[tuple[float, float, float, dict[str, int]]]:
        """One round's power steps, relative to its start: (from s, to s, fleet W, busy GPUs per type)."""
        out, a = [], 0.0
        for b in sorted({d for d, *_ in segs}):
            busy = [0] * len(types)
            w = 0.0
            for d, j, c in segs:
                if d > a:
                    busy[c] += size[j]
                    w += watts[j][c]
            w += sum(float(capacity[c] - busy[c]) * float(idle_w[c]) for c in range(len(types)))
            out.append((a, b, float(w), {t: busy[col[t]] for t in types}))
            a = b
        return out

    def account(t0: float, prof: list[tuple[float, float, float, dict[str, int]]]) -> float:
        """Integrate the fleet's power over one round from ``t0``; its end."""
        nonlocal total_j
        for a, b, w, busy in prof:
            trace.append((t0 + a, t0 + b, w))
            total_j += w * (b - a)
            occupancy.append((t0 + a, busy))
        return t0 + prof[-1][1] if prof else t0

    while done < len(pending):
        if nxt >= len(pending) and not batch:
            last_reset = 0.0  # nothing ran and nothing will arrive: a reset may happen now
        if batch:
            if round_end is not None:
                round_start = round_end
            t0 = now
            prof = plan_profile if replay else profile([(f - t0, j, c) for f, j, c, _ in batch])
            round_end = now = account(t0, prof)
            replay = False
        elif nxt < len(pending):
            gap_to = pending[nxt].arrival_s
            if gap_to > now:  # nothing runs until the next arrival
                w = float(np.dot(capacity, idle_w))
                trace.append((now, gap_to, w))
                total_j += w * (gap_to - now)
                occupancy.append((now, dict.fromkeys(fleet, 0)))
                now = gap_to
        elif not dirty:
            break  # active jobs that no GPU type of the fleet can run: reported unfinished
        if now >= config.horizon_s:
            break
        per_job: dict[str, list[float]] = {}  # job -> [its rate this round, its last copy's end]
        for finish, j, c, steps in batch:
            left[j] -= steps
            took = finish - round_start
            got[j][c] += took
            spent[c] += took
            records[j].steps_done += steps
            agg = per_job.setdefault(j, [0.0, t0])
            agg[0] += true_rate[j][c]
            agg[1] = max(agg[1], finish)
        for j, (rate, finish) in per_job.items():
            rec = records[j]
            if rate >= required[j] * (1 - 1e-9):
                rec.ok_s += finish - t0
            if left[j] <= 1e-6:
                rec.finished_s = finish
                rec.run_s = finish - first_s[j]
                active.remove(j)
                del got[j], deficit[j]
                share.pop(j, None)
                done += 1
                dirty = True
        batch = []
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            j = pending[nxt].id
            nxt += 1
            active.append(j)
            got[j] = np.full(len(types), half)
            deficit[j] = np.zeros(len(types))
            dirty = True
        if progress is not None:
            progress(done, len(pending))
        if not active:
            continue
        if getattr(allocator, "wake_at_s", math.inf) <= now:
            dirty = True  # the allocator asked to decide again by now (RLTune's bounded wait)
        if dirty and (now - last_reset >= reset_s or last_reset == 0):
            elapsed = now - last_reset
            spent[:] = 0.0
            for j in active:
                owed = share[j] * elapsed if j in share else 0.0
                deficit[j] += owed - (got[j] - half)
                got[j][:] = half
                spent += half
            last_reset, dirty = now, False
            state = AllocationState(
                now_s=now, job_ids=tuple(active), types=tuple(types),
                rate=np.array([plan_rate[j] for j in active]),
                watts=np.array([watts[j] for j in active]),
                scale=np.array([size[j] for j in active], dtype=float),
                remaining=np.array([left[j] for j in active], dtype=float),
                required=np.array([required[j] for j in active]),
                arrival_s=np.array([spec[j].arrival_s for j in active]),
                capacity=capacity.copy())
            t_dec = time.perf_counter()
            x = np.clip(np.asarray(allocator.allocate(state), dtype=float), 0.0, 1.0)
            decision_ms.append((time.perf_counter() - t_dec) * 1e3)
            if x.shape != state.rate.shape:
                raise ValueError(f"allocator {allocator.name!r} returned an allocation of shape "
                                 f"{x.shape}; expected (jobs, types) = {state.rate.shape}")
            share = {j: x[i] for i, j in enumerate(active)}
        if repeat:  # the previous round again, unchanged (see below): no ranking needed
            repeat -= 1
            batch = [(now + d, j, c, steps) for j, c, steps, d in plan]
            replay = True
            continue
        gpus_left = capacity.copy()
        copies: dict[str, list[int]] = {}  # job -> the type columns it runs on this round
        order = list(types)
        if shuffler is not None:
            shuffler.shuffle(order)
        for t in order:
            c = col[t]
            prio: dict[str, float] = {}
            for j in active:
                a = share[j][c] if j in share else 0.0
                if a <= 0 or plan_rate[j][c] <= 0:
                    prio[j] = 0.0
                else:
                    frac = got[j][c] / spent[c] if spent[c] > 0 else 0.0
                    prio[j] = a / frac if frac > 0 else a * 1e9
            ranked = sorted(active, key=lambda j, c=c: (
                prio[j], deficit[j][c], share[j][c] if j in share else 0.0), reverse=True)
            for j in ranked:
                if gpus_left[c] == 0:
                    break
                have = copies.get(j, ())
                if len(have) >= max_copies or true_rate[j][c] <= 0 or size[j] > gpus_left[c]:
                    continue
                if allocator.skips_unallocated and prio[j] <= 0:
                    continue
                gpus_left[c] -= size[j]
                copies.setdefault(j, []).append(c)
                first_s.setdefault(j, now)
                rec = records[j]
                if rec.placed_s is None:
                    rec.placed_s = now
                rec.gpu_type = t
        for j, cols in copies.items():
            where = frozenset(cols)
            if last_on.get(j, where) != where:
                migrations += 1  # moved to other GPU types between rounds (free in Gavel's model)
            last_on[j] = where
            if len(cols) == 1:  # Gavel's rule: whole steps, the round's worth or what is left
                c = cols[0]
                rate = true_rate[j][c]
                steps = max(1, min(int(rate * config.round_s), math.ceil(left[j])))
                steps = min(steps, left[j])
                batch.append((now + steps / rate, j, c, steps))
            else:  # copies of one job (HadarE): their steps add up; they end together
                span = min(config.round_s, left[j] / sum(true_rate[j][c] for c in cols))
                batch += [(now + span, j, c, true_rate[j][c] * span) for c in cols]
        if allocator.skips_unallocated and batch:
            plan, repeat = _repeats(batch, now, active, share, plan_rate, true_rate, left, config,
                                    next_arrival=pending[nxt].arrival_s if nxt < len(pending) else math.inf,
                                    reset_at=min(last_reset + reset_s if dirty else math.inf,
                                                 getattr(allocator, "wake_at_s", math.inf)))
            if repeat:
                plan_profile = profile([(d, j, c) for j, c, _, d in plan])

    unfinished = [j for j, r in records.items() if r.finished_s is None]
    for j in unfinished:
        if j in first_s:
            records[j].run_s = now - first_s[j]
    return SimResult(policy=allocator.name, energy_j=float(total_j), jobs=records, decision_ms=decision_ms,
                     power_trace=trace, end_s=float(now), unfinished=unfinished, occupancy=occupancy,
                     fleet=dict(fleet), migrations=migrations)


def _repeats(batch, now, active, share, plan_rate, true_rate, left, config: RoundConfig, *,
             next_arrival: float, reset_at: float) -> tuple[list[tuple[str, int, float, float]], int]:
    """How many more times this round will run unchanged, and the round to repeat.

    With an allocator that runs only jobs it allocated (``skips_unallocated``), a round in
    which every allocated job ran, each a full round's steps on one type, is followed by
    identical rounds until a job finishes, a job arrives, a due reset, or the horizon. The
    engine then replays it without ranking the queue again (which dominates when hundreds
    wait): the same rounds, the same figures, much less work.
    """
    held = {j for j in active if j in share and bool(((share[j] > 0) & (plan_rate[j] > 0)).any())}
    ran = [j for _, j, _, _ in batch]
    if len(set(ran)) != len(ran) or set(ran) != held:
        return [], 0
    plan, k = [], math.inf
    for finish, j, c, steps in batch:
        full = int(true_rate[j][c] * config.round_s)
        after = left[j] - steps
        if full < 1 or steps != full or after <= 0:
            return [], 0
        k = min(k, math.ceil(after / full) - 1)
        plan.append((j, c, steps, finish - now))
    length = max(d for *_, d in plan)
    for limit in (next_arrival, reset_at, config.horizon_s):
        if limit < math.inf:
            k = min(k, math.ceil((limit - now) / length) - 1)
    return plan, max(0, int(k)) if k < math.inf else 0

"""Event-driven simulation of a placement policy on a fleet, from a job stream.

Why event-driven rather than rounds: between two events (an arrival or a
completion) nothing changes, so every job's progress and every GPU's energy
can be integrated exactly, and a decision is taken exactly when the state
changes, as a live scheduler would.

The policy plans with its own view of throughputs (``oracle`` = the truth
table); jobs progress at the *true* rates, with seeded measurement noise, so a
policy that mispredicts pays for it in energy and requirement misses.

Re-placement of running jobs (docs/simulation.md): a job observed below its
requirement is evicted and re-placed; and when GPUs free up, a running job of a
heterogeneity-aware policy moves to an empty GPU when that is *clearly better*
for the policy's own objective (remaining time or remaining energy, migration
included). Waiting jobs always get free GPUs first.

Metrics (see ``SimResult``): energy integrates every GPU's power over time,
idle GPUs included (or parked at 0 W); SLA attainment is the fraction of
running job-time at or above the job's requirement (queueing and the restarts
after migrations are reported separately, as ``avg_queue_s`` and
``restart_h``); JCT is completion minus arrival.
"""

from __future__ import annotations

import heapq
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from gogh_flows.energy import EnergyModel, Occupant, kwh
from gogh_flows.placement.optimizer import GoghOptimizer
from gogh_flows.placement.patience import HeldAhead, Patience, hold_for_efficiency
from gogh_flows.placement.problem import Gpu, Job, PlacementProblem, TableThroughputs, Throughputs, level_watts
from gogh_flows.truth.table import ThroughputTable

_EPS_STEPS = 1e-6


class SimJob(Protocol):
    """What the simulator needs of a job (``sim.traces.TraceJob`` fits)."""

    id: str
    job_type: str
    total_steps: float
    num_gpus: int
    arrival_s: float
    required_throughput: float | None


class Policy(Protocol):
    name: str

    def place(self, problem: PlacementProblem): ...


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    noise: float = 0.0  # sigma of per-(job, GPU type, partner) log-normal noise on true rates
    park_idle: bool = False  # empty GPUs draw 0 W instead of their idle power
    horizon_s: float = math.inf  # stop integrating here; later jobs are reported unfinished
    # Monitoring: a job's rate is observed this long after it changes; a job seen below its
    # requirement is re-placed (a migration when it lands elsewhere).
    replace_below_requirement: bool = True
    observe_after_s: float = 300.0
    migration_s: float = 60.0  # no progress while a migrated job restarts; its GPU still draws
    # A decision looks at this many queued jobs at a time (FIFO chunks, until a chunk places
    # nothing), so a long backlog costs linear time rather than one huge solve.
    decision_window: int = 64
    # "Clearly better slot": when GPUs free up, a running job moves to empty GPUs if that cuts
    # its predicted remaining time (speed-seeking policies) or remaining energy (energy-
    # minimising ones) by at least ``rebalance_gain``, the migration's ``migration_s``
    # included. At most ``rebalance_candidates`` running jobs are weighed per empty GPU.
    rebalance: bool = True
    rebalance_gain: float = 0.2
    rebalance_candidates: int = 4
    # Fleet-level re-optimisation (placement.reoptimize), for policies that ask for it
    # (``simulate(reoptimize_s=...)``): at most ``reopt_budget`` moves per re-solve, each saving
    # at least ``reopt_gain`` of the job's remaining energy where it runs.
    reopt_budget: int = 8
    reopt_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.decision_window < 1:
            raise ValueError(f"decision_window must be >= 1 job, got {self.decision_window!r}")
        if not 0 <= self.rebalance_gain < 1:
            raise ValueError(f"rebalance_gain must be a fraction in [0, 1), got {self.rebalance_gain!r}")
        if self.rebalance_candidates < 1:
            raise ValueError(
                f"rebalance_candidates must be >= 1 job per free GPU, got {self.rebalance_candidates!r}")
        for name in ("observe_after_s", "migration_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be a log-normal sigma in [0, 1), got {self.noise!r}")
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 seconds, got {self.horizon_s!r}")


@dataclass
class _Running:
    job: Job  # the placement view: remaining work kept up to date
    spec: SimJob
    gpus: tuple[str, ...]
    remaining: float
    rate: float = 0.0
    placed_s: float = 0.0
    ok_s: float = 0.0  # running time at or above the requirement
    run_s: float = 0.0  # time on GPUs, restarts after a migration excluded
    restart_s: float = 0.0  # time restarting after migrations (no progress)
    done: float = 0.0  # steps done
    paused_until: float = 0.0  # migration restart: no progress before this time
    observe_at: float = math.inf  # next monitoring observation
    slot_s: float = 0.0  # when it landed on its current GPUs
    slow: float = 1.0  # how much its GPU's power limit slows it (1: at the maximum limit)


@dataclass
class JobRecord:
    id: str
    job_type: str
    arrival_s: float
    placed_s: float | None = None
    finished_s: float | None = None
    gpu_type: str | None = None
    ok_s: float = 0.0
    run_s: float = 0.0
    restart_s: float = 0.0
    steps_done: float = 0.0
    required: float | None = None  # steps/s the job had to get

    def met_on_average(self) -> bool:
        """Whether the job's mean rate from its first placement to its end met its requirement.

        The instantaneous account (``ok_s``) charges a time-sliced job for every round it
        waits; this one asks only whether its work got done at the rate it needed.
        """
        if self.required is None or self.finished_s is None or self.placed_s is None:
            return self.finished_s is not None
        span = self.finished_s - self.placed_s
        return span <= 0 or self.steps_done / span >= self.required * (1 - 1e-6)


@dataclass
class SimResult:
    policy: str
    energy_j: float
    jobs: dict[str, JobRecord]
    decision_ms: list[float]
    power_trace: list[tuple[float, float, float]]  # (start s, end s, fleet watts)
    migrations: int = 0  # every move of a running job: below requirement, or rebalanced
    end_s: float = 0.0
    unfinished: list[str] = field(default_factory=list)
    # (time s, busy GPUs per type) after every event that changed occupancy
    occupancy: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    fleet: dict[str, int] = field(default_factory=dict)  # GPUs per type
    rebalances: int = 0  # the migrations that moved a job to a clearly better free slot
    rebalance_ms: list[float] = field(default_factory=list)  # time of each rebalancing pass

    def summary(self) -> dict[str, float | int]:
        done = [r for r in self.jobs.values() if r.finished_s is not None]
        placed = [r for r in self.jobs.values() if r.placed_s is not None]
        run = sum(r.run_s for r in self.jobs.values())
        ok = sum(r.ok_s for r in self.jobs.values())
        arrivals = [r.arrival_s for r in self.jobs.values()]
        return {
            "energy_kwh": kwh(self.energy_j),
            "sla_attainment": ok / run if run > 0 else 1.0,
            "met_on_average": (sum(r.met_on_average() for r in done) / len(done)) if done else math.nan,
            "avg_jct_s": float(np.mean([r.finished_s - r.arrival_s for r in done])) if done else math.nan,
            "makespan_s": (max(r.finished_s for r in done) - min(arrivals)) if done else math.nan,
            "avg_queue_s": float(np.mean([r.placed_s - r.arrival_s for r in placed])) if placed else math.nan,
            "migrations": self.migrations,
            "rebalances": self.rebalances,
            "restart_h": sum(r.restart_s for r in self.jobs.values()) / 3600,
            "jobs_completed": len(done),
            "jobs_unfinished": len(self.unfinished),
            "decision_p50_ms": float(np.percentile(self.decision_ms, 50)) if self.decision_ms else 0.0,
            "decision_p99_ms": float(np.percentile(self.decision_ms, 99)) if self.decision_ms else 0.0,
            "rebalance_p99_ms": float(np.percentile(self.rebalance_ms, 99)) if self.rebalance_ms else 0.0,
        }


class TrueRates:
    """The truth table plus seeded, fixed measurement noise per (job, GPU type, partner)."""

    def __init__(self, table: ThroughputTable, noise: float, seed: int) -> None:
        self.view = TableThroughputs(table)
        self.noise, self.seed = noise, seed

    def _factor(self, *key: str) -> float:
        if self.noise <= 0:
            return 1.0
        h = zlib.crc32("|".join(key).encode())
        return float(math.exp(np.random.default_rng([self.seed, h]).normal(0.0, self.noise)))

    def alone(self, job: Job, gpu_type: str) -> float:
        return self.view.isolated(job, gpu_type) * self._factor(job.id, gpu_type, "")

    def shared(self, job: Job, partner: Job, gpu_type: str) -> float:
        own, _ = self.view.pair(job, partner, gpu_type)
        return own * self._factor(job.id, gpu_type, partner.job_type)


class ObservedThroughputs:
    """A planning view where what was measured replaces what was predicted.

    Keyed by (job id, GPU type, partner job type or None): a job re-placed after
    running below its requirement is not sent back to the same kind of slot on
    the strength of the prediction that was just proven wrong. (The learned
    refiner of GOGH generalises observations to unobserved types and partners;
    this overlay only remembers them.)
    """

    def __init__(self, base: Throughputs) -> None:
        self.base = base
        self.seen: dict[tuple[str, str, str | None], float] = {}

    def observe(self, job: Job, gpu_type: str, partner: Job | None, rate: float) -> None:
        self.seen[(job.id, gpu_type, partner.job_type if partner else None)] = rate
        forward = getattr(self.base, "observe", None)
        if forward is not None:  # a learned predictor refines itself from what was measured
            forward(job, gpu_type, partner, rate)

    def isolated(self, job: Job, gpu_type: str) -> float:
        hit = self.seen.get((job.id, gpu_type, None))
        return self.base.isolated(job, gpu_type) if hit is None else hit

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        own, other = self.base.pair(job, partner, gpu_type)
        own = self.seen.get((job.id, gpu_type, partner.job_type), own)
        other = self.seen.get((partner.id, gpu_type, job.job_type), other)
        return own, other

    def activity(self, job: Job, gpu_type: str) -> float:
        return self.base.activity(job, gpu_type)

    def knows(self, job_type: str) -> bool:
        knows = getattr(self.base, "knows", None)
        return True if knows is None else knows(job_type)


def attainment_text(share: float) -> str:
    """SLA attainment to 4 places, rounded down: 0.99965 must not read 1.000 (every requirement
    met), nor 0.97998 read 0.9800 (the 0.98 bar it misses). Rounded to 6 places first, since
    0.57 * 1e4 is 5699.999..."""
    return f"{math.floor(round(share * 1e4, 6)) / 1e4:.4f}"


def simulate(
    jobs: Sequence[SimJob],
    gpus: Sequence[Gpu],
    truth: ThroughputTable,
    policy: Policy,
    *,
    planning: Throughputs | None = None,
    config: SimConfig | None = None,
    energy: EnergyModel | None = None,
    progress: Callable[[int, int], None] | None = None,
    rebalance_by: str | None = "auto",
    reoptimize_s: float = 0.0,
    patience: Patience | None = None,
) -> SimResult:
    """Run ``policy`` on the job stream; ``planning`` is what it predicts with (default: truth).

    ``rebalance_by`` is the objective by which running jobs move to clearly better
    free slots: ``"time"``, ``"energy"``, ``None`` (never), or ``"auto"``: the
    policy's own (:func:`rebalance_objective`).

    ``reoptimize_s`` > 0 re-solves the running jobs together (moves with a migration cost and
    budget, limits re-chosen: :func:`gogh_flows.placement.reoptimize.reoptimize`) every
    ``reoptimize_s`` seconds and whenever a completion frees GPUs with nobody waiting; it
    replaces the one-job-at-a-time rebalancing.

    ``patience`` lets a new job wait (up to its ``max_wait_s`` after arrival) rather than start
    on a GPU type that another type would beat by ``min_saving`` of energy
    (:func:`gogh_flows.placement.patience.hold_for_efficiency`); the queue is served again
    when a hold runs out.
    """
    energy = energy or EnergyModel()
    config = config or SimConfig()
    objective = rebalance_objective(policy) if rebalance_by == "auto" else rebalance_by
    if objective not in REBALANCE_OBJECTIVES:
        raise ValueError(f"rebalance_by must be 'auto', 'time', 'energy' or None, got {rebalance_by!r}")
    if not config.rebalance:
        objective = None
    if reoptimize_s < 0:
        raise ValueError(f"reoptimize_s must be >= 0 seconds (0: off), got {reoptimize_s!r}")
    next_reopt = reoptimize_s if reoptimize_s > 0 else math.inf
    levels = tuple(getattr(policy, "power_limit_levels", ()))
    # What a move changes in the fleet's energy: with GPUs always on, the idle draw of the
    # GPUs it leaves and takes is paid either way, so only dynamic power counts.
    move_energy = EnergyModel(count_idle=energy.count_idle and config.park_idle,
                              gpu_types=energy.gpu_types)
    rates = TrueRates(truth, config.noise, config.seed)
    planning = ObservedThroughputs(planning or rates.view)
    by_id = {g.id: g for g in gpus}
    for spec in jobs:
        if spec.required_throughput is None or not spec.required_throughput > 0:
            raise ValueError(
                f"job {spec.id!r} has no throughput requirement; assign one "
                "(sim.traces.assign_requirements) before simulating"
            )
    pending = sorted(jobs, key=lambda s: (s.arrival_s, s.id))
    records = {s.id: JobRecord(s.id, s.job_type, s.arrival_s, required=s.required_throughput)
               for s in pending}
    occupants: dict[str, list[_Running]] = {g.id: [] for g in gpus}
    running: dict[str, _Running] = {}
    queue: list[SimJob | _Running] = []  # arrivals, and evicted jobs waiting to be re-placed
    migrations = rebalanced = 0
    rebalance_ms: list[float] = []
    fleet_index = {g.id: i for i, g in enumerate(gpus)}
    power = {g.id: _gpu_power(energy, by_id[g.id], [], rates, config) for g in gpus}
    limits: dict[str, float | None] = {g.id: None for g in gpus}  # each board's power limit
    trace: list[tuple[float, float, float]] = []
    decision_ms: list[float] = []
    total_j, now, nxt = 0.0, 0.0, 0
    done_count = 0
    fleet: dict[str, int] = {}
    for g in gpus:
        fleet[g.gpu_type] = fleet.get(g.gpu_type, 0) + 1
    busy = {t: 0 for t in fleet}
    busy_ids: set[str] = set()
    occupancy: list[tuple[float, dict[str, int]]] = [(0.0, dict(busy))]
    holds: dict[str, float] = {}  # job held for an efficient GPU -> when its patience runs out

    while nxt < len(pending) or running or holds:
        t_arrival = pending[nxt].arrival_s if nxt < len(pending) else math.inf
        t_done = min((now + r.remaining / r.rate for r in running.values()
                      if r.rate > 0 and r.paused_until <= now), default=math.inf)
        t_resume = min((r.paused_until for r in running.values() if r.paused_until > now),
                       default=math.inf)
        t_observe = min((r.observe_at for r in running.values()), default=math.inf)
        t_reopt = next_reopt if running else math.inf
        t_wake = min(holds.values(), default=math.inf)
        t_next = min(t_arrival, t_done, t_resume, t_observe, t_reopt, t_wake, config.horizon_s)
        if t_next == math.inf:
            break  # queued jobs that no GPU can ever take: reported unfinished
        dt = t_next - now
        if dt > 0:
            watts = sum(power.values())
            trace.append((now, t_next, watts))
            total_j += watts * dt
            for r in running.values():
                if r.paused_until > now:  # restarting after a migration: no progress
                    r.restart_s += dt
                    continue
                r.remaining -= r.rate * dt
                r.done += r.rate * dt
                r.run_s += dt
                if r.rate >= r.job.required_throughput * (1 - 1e-9):
                    r.ok_s += dt
        now = t_next
        if now >= config.horizon_s:
            break
        changed: set[str] = set()
        vacated = False  # a completion or an eviction left GPUs to other jobs
        for r in [r for r in running.values() if r.remaining <= _EPS_STEPS * max(1.0, r.spec.total_steps)]:
            rec = records[r.job.id]
            rec.finished_s, rec.ok_s, rec.run_s, rec.steps_done = now, r.ok_s, r.run_s, r.done
            rec.restart_s = r.restart_s
            del running[r.job.id]
            for gid in r.gpus:
                occupants[gid].remove(r)
                changed.add(gid)
            done_count += 1
            vacated = True
        for r in [r for r in running.values() if r.observe_at <= now]:
            if any(gid in changed for gid in r.gpus):
                # A partner just left: r.rate is still the shared rate, which would be
                # recorded against the wrong slot. Its GPU changed, so it is observed
                # afresh ``observe_after_s`` from now (set below).
                continue
            r.observe_at = math.inf
            gpu_type = by_id[r.gpus[0]].gpu_type
            partners = [o for o in occupants[r.gpus[0]] if o is not r]
            # what the job does at full power: the limit's slowdown is the simulator's own doing
            planning.observe(r.job, gpu_type, partners[0].job if partners else None, r.rate * r.slow)
            short = r.rate < r.job.required_throughput * (1 - 1e-9)
            if short and r.slow > 1 and r.rate * r.slow >= r.job.required_throughput * (1 - 1e-9):
                # Short only because of the board's limit, which the plan expected to be enough (its
                # slowdown is predicted from an assumed power draw): raise the limit to the level the
                # observed slowdown says suffices and look again, rather than re-place the job where
                # the same plan would put it again.
                need = r.rate * r.slow / r.job.required_throughput
                up = _sufficient_limit(energy, gpu_type, limits[r.gpus[0]], r.slow, need, levels)
                for gid in r.gpus:
                    limits[gid] = up
                    changed.add(gid)
                continue
            if short:
                del running[r.job.id]  # evicted: re-placed first, ahead of new arrivals
                for gid in r.gpus:
                    occupants[gid].remove(r)
                    changed.add(gid)
                queue.insert(0, r)
                vacated = True
        arrived = False
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            queue.append(pending[nxt])
            nxt += 1
            arrived = True
        if queue and (arrived or changed or now >= t_wake):
            moved, placed_on = _serve_queue(policy, planning, energy, gpus, running, occupants,
                                            queue, records, now, decision_ms, config, limits, patience, holds,
                                            move_energy)
            migrations += moved
            changed |= placed_on
        freed = [gid for gid in changed if not occupants[gid]] if vacated else []
        if reoptimize_s > 0:
            # held jobs turned the free GPUs down: they do not keep them from the re-solve
            if now >= next_reopt or (freed and all(_queue_id(q) in holds for q in queue)):
                if now >= next_reopt:
                    next_reopt = now + reoptimize_s
                t0 = time.perf_counter()
                moves, touched = _reoptimize(planning, move_energy, gpus, occupants, running, records,
                                             limits, now, config, levels)
                rebalance_ms.append((time.perf_counter() - t0) * 1e3)
                migrations += moves
                rebalanced += moves
                changed |= touched
        elif objective is not None and freed:
            t0 = time.perf_counter()
            unheld = [q for q in queue if _queue_id(q) not in holds]
            moves, touched, weighed = _rebalance(objective, planning, move_energy, gpus, by_id,
                                                 fleet_index, occupants, running, unheld, records,
                                                 now, config, len(freed))
            if weighed:
                rebalance_ms.append((time.perf_counter() - t0) * 1e3)
            if moves:
                migrations += moves
                rebalanced += moves
                changed |= touched
                if queue:  # GPUs the moved jobs left go to waiting jobs first
                    moved, placed_on = _serve_queue(policy, planning, energy, gpus, running,
                                                    occupants, queue, records, now, decision_ms,
                                                    config, limits, patience, holds, move_energy)
                    migrations += moved
                    changed |= placed_on
        for gid in changed:
            if not occupants[gid]:
                limits[gid] = None  # an empty board goes back to its maximum limit
            _update_rates(by_id[gid], occupants[gid], rates, energy, limits[gid])
            if config.replace_below_requirement:
                for r in occupants[gid]:
                    r.observe_at = max(now, r.paused_until) + config.observe_after_s
            power[gid] = _gpu_power(energy, by_id[gid], occupants[gid], rates, config, limits[gid])
            now_busy = bool(occupants[gid])
            if now_busy != (gid in busy_ids):
                busy[by_id[gid].gpu_type] += 1 if now_busy else -1
                (busy_ids.add if now_busy else busy_ids.discard)(gid)
        if changed:
            occupancy.append((now, dict(busy)))
        if progress is not None:
            progress(done_count, len(pending))

    # Horizon reached or nothing left that can run: keep what was measured.
    for r in [*running.values(), *(q for q in queue if isinstance(q, _Running))]:
        rec = records[r.job.id]
        rec.ok_s, rec.run_s, rec.steps_done, rec.restart_s = r.ok_s, r.run_s, r.done, r.restart_s
    unfinished = [s.id for s in pending if records[s.id].finished_s is None]
    return SimResult(policy.name, total_j, records, decision_ms, trace, migrations, now,
                     unfinished, occupancy, fleet, rebalanced, rebalance_ms)


def _serve_queue(policy, planning, energy, gpus, running, occupants, queue, records, now,
                 decision_ms, config: SimConfig, limits: dict[str, float | None],
                 patience: Patience | None = None, holds: dict[str, float] | None = None,
                 hold_energy: EnergyModel | None = None) -> tuple[int, set[str]]:
    """Decide on the queue in FIFO chunks until a chunk places and holds nothing; ``holds`` is
    refilled with the jobs held for an efficient GPU (job id -> when their patience runs out),
    which stay queued without blocking the jobs behind them. ``hold_energy``: what a decision
    changes, for the hold (without idle power on an always-on fleet)."""
    moved, changed = 0, set()
    start = 0
    if holds is not None:
        holds.clear()
    ahead = HeldAhead()  # the line each hold joins: the jobs held before it in this pass
    while start < len(queue):
        before = len(queue)
        m, placed_on, n_held = _decide(policy, planning, energy, gpus, running, occupants, queue, records,
                                       now, decision_ms, config.migration_s, start, config.decision_window,
                                       limits, patience, holds, hold_energy, ahead)
        moved += m
        changed |= placed_on
        if len(queue) == before and not n_held:
            break  # this chunk placed nothing and held nothing: the fleet is full for now
        start += config.decision_window - (before - len(queue))
    return moved, changed


def _decide(policy, planning, energy, gpus, running, occupants, queue, records, now, decision_ms,
            migration_s, start, window, limits, patience=None, holds=None,
            hold_energy=None, ahead: HeldAhead | None = None) -> tuple[int, set[str], int]:
    """Place queue[start:start + window]; returns (migrations, GPUs whose occupants changed,
    jobs held).

    Each assignment's power limit is set on its GPU(s), for a partner already there too. With
    ``patience``, new jobs worth holding for an efficient GPU are left queued (into ``holds``).
    """
    run_jobs = [
        Job(r.job.id, r.job.job_type, r.job.required_throughput, max(r.remaining, _EPS_STEPS),
            r.job.num_gpus, r.gpus, limits[r.gpus[0]])
        for r in running.values()
    ]
    chunk = queue[start:start + window]
    waiting = []
    for q in chunk:
        if isinstance(q, _Running):  # evicted: re-placed with the work it has left
            waiting.append(replace(q.job, work=max(q.remaining, _EPS_STEPS), gpus=()))
        else:
            waiting.append(Job(q.id, q.job_type, float(q.required_throughput),
                               float(q.total_steps), q.num_gpus))
    problem = PlacementProblem(tuple(gpus), tuple(run_jobs + waiting), planning, energy)
    t0 = time.perf_counter()
    placement = policy.place(problem)
    held: dict[str, str] = {}
    if patience is not None:
        # a hold runs out at arrival + max_wait_s exactly (the engine wakes then), whatever
        # ``now - arrival`` rounds to
        fresh = {q.id: (patience.max_wait_s if now >= q.arrival_s + patience.max_wait_s else now - q.arrival_s)
                 for q in chunk if not isinstance(q, _Running)}
        levels = tuple(getattr(policy, "power_limit_levels", ()))
        placement, held = hold_for_efficiency(placement, replace(problem, power_limit_levels=levels), fresh,
                                              patience, energy=hold_energy, ahead=ahead)
        if holds is not None:
            holds.update({j: records[j].arrival_s + patience.max_wait_s for j in held})
    decision_ms.append((time.perf_counter() - t0) * 1e3)
    by_id = {_queue_id(q): q for q in chunk}
    placed_job = {j.id: j for j in waiting}
    changed: set[str] = set()
    moved = 0
    for a in placement.assignments:
        item = by_id[a.job_id]
        if isinstance(item, _Running):
            r = item
            if set(a.gpus) != set(r.gpus):
                r.paused_until = now + migration_s
                moved += 1
            r.gpus, r.slot_s = a.gpus, now
        else:
            r = _Running(placed_job[a.job_id], item, a.gpus, float(item.total_steps), placed_s=now,
                         slot_s=now)
            records[a.job_id].placed_s = now
        running[a.job_id] = r
        for gid in a.gpus:
            occupants[gid].append(r)
            changed.add(gid)
            limits[gid] = a.power_limit_w
        records[a.job_id].gpu_type = a.gpu_type
    placed = {a.job_id for a in placement.assignments}
    queue[:] = [q for q in queue if _queue_id(q) not in placed]
    return moved, changed, len(held)


REBALANCE_OBJECTIVES = (None, "time", "energy")
_UNDECLARED = object()


def rebalance_objective(policy: Policy) -> str | None:
    """What ``policy`` moves a running job to a free slot for: ``"time"``, ``"energy"`` or None.

    A policy declares it with a ``rebalance_objective`` attribute (the baselines
    do); the GOGH optimiser minimises energy. None means never: a
    heterogeneity-unaware policy has no reason to prefer another GPU type.
    """
    declared = getattr(policy, "rebalance_objective", _UNDECLARED)
    if declared is not _UNDECLARED:
        return declared
    return "energy" if isinstance(policy, GoghOptimizer) else None


def _queue_id(q: SimJob | _Running) -> str:
    return q.job.id if isinstance(q, _Running) else q.id


def _queued_job(q: SimJob | _Running) -> Job:
    if isinstance(q, _Running):
        return q.job
    return Job(q.id, q.job_type, float(q.required_throughput), float(q.total_steps), q.num_gpus)


def _partner(r: _Running, occupants: dict[str, list[_Running]]) -> _Running | None:
    others = [o for o in occupants[r.gpus[0]] if o is not r]
    return others[0] if others else None


def _cost_here(objective: str, planning: Throughputs, energy: EnergyModel, r: _Running,
               gpu_type: str, partner: _Running | None) -> float:
    """The job's predicted remaining time (s) or energy (J) where it runs now."""
    job, work = r.job, max(r.remaining, 0.0)
    if partner is None:
        rate = planning.isolated(job, gpu_type)
        if not rate > 0:
            return math.inf
        if objective == "time":
            return work / rate
        return energy.energy_alone(gpu_type, Occupant(work, rate, planning.activity(job, gpu_type)),
                                   num_gpus=job.num_gpus)
    own, other = planning.pair(job, partner.job, gpu_type)
    if not (own > 0 and other > 0):
        return math.inf
    if objective == "time":
        return work / own
    # As the optimiser costs a join: what the pair uses beyond the partner alone.
    iso_j = max(planning.isolated(job, gpu_type), own)
    iso_k = max(planning.isolated(partner.job, gpu_type), other)
    act_j, act_k = planning.activity(job, gpu_type), planning.activity(partner.job, gpu_type)
    work_k = max(partner.remaining, 0.0)
    pair = energy.energy_pair(gpu_type, Occupant(work, iso_j, act_j, own),
                              Occupant(work_k, iso_k, act_k, other))
    return pair - energy.energy_alone(gpu_type, Occupant(work_k, iso_k, act_k))


def _cost_moved(objective: str, planning: Throughputs, energy: EnergyModel, r: _Running,
                gpu_type: str, migration_s: float) -> float:
    """Predicted remaining time or energy alone on empty GPUs of ``gpu_type``, restart included."""
    job, work = r.job, max(r.remaining, 0.0)
    rate = planning.isolated(job, gpu_type)
    if not rate > 0 or rate < job.required_throughput:
        return math.inf
    if objective == "time":
        return migration_s + work / rate
    # The restart draws the new GPUs' busy power for migration_s, as in the simulation.
    occ = Occupant(work + migration_s * rate, rate, planning.activity(job, gpu_type))
    return energy.energy_alone(gpu_type, occ, num_gpus=job.num_gpus)


def _rebalance(objective, planning, energy, gpus, by_id, fleet_index, occupants, running, queue,
               records, now, config: SimConfig, freed: int) -> tuple[int, set[str], bool]:
    """Move running jobs to empty GPUs that are clearly better for ``objective``.

    ``freed``: GPUs this event emptied that are still free after the queue was
    served; at most ``config.rebalance_candidates`` jobs are weighed per such GPU.

    Returns (moves, GPUs whose occupants changed, whether any job was weighed).
    Deterministic: candidates in order of remaining time at their measured rate
    (longest first, then job id), free GPUs in fleet order.
    """
    free: dict[str, list[str]] = {}
    count: dict[str, int] = {}
    for g in gpus:
        count[g.gpu_type] = count.get(g.gpu_type, 0) + 1
        if not occupants[g.id]:
            free.setdefault(g.gpu_type, []).append(g.id)
    # Waiting jobs first: a GPU type a job at the head of the queue could run on stays
    # free for it (a gang waiting for enough GPUs of one type is not overtaken).
    for q in queue[:config.decision_window]:
        job = _queued_job(q)
        for t in [t for t in free if count[t] >= job.num_gpus]:
            if planning.isolated(job, t) >= job.required_throughput:
                del free[t]
        if not free:
            break
    n_free = sum(len(ids) for ids in free.values())
    if not n_free:
        return 0, set(), False
    # Candidates: the longest remaining time at the rate the job is measured running at (what
    # monitoring reports), skipping jobs restarting after a move or placed at this very event.
    # One pass over the running jobs, no predictions: the predictions are for candidates only.
    keyed = [(-(r.remaining / r.rate) if r.rate > 0 else -math.inf, r.job.id, r)
             for r in running.values() if r.paused_until <= now and r.slot_s < now]
    if not keyed:
        return 0, set(), False
    candidates = heapq.nsmallest(config.rebalance_candidates * min(freed, n_free), keyed,
                                 key=lambda x: (x[0], x[1]))
    keep = 1.0 - config.rebalance_gain
    moves, touched = 0, set()
    for _, _, r in candidates:
        n = r.job.num_gpus
        here = by_id[r.gpus[0]].gpu_type
        partner = _partner(r, occupants)
        cost_here = _cost_here(objective, planning, energy, r, here, partner)
        best: tuple[float, str] | None = None
        for t, ids in free.items():
            if len(ids) < n or (t == here and partner is None):
                continue  # the same type alone again gains nothing
            cost = _cost_moved(objective, planning, energy, r, t, config.migration_s)
            if cost <= keep * cost_here and (best is None or cost < best[0]):
                best = (cost, t)
        if best is None:
            continue
        t = best[1]
        old, new = r.gpus, tuple(free[t][:n])
        del free[t][:n]
        for gid in old:
            occupants[gid].remove(r)
            touched.add(gid)
        for gid in new:
            occupants[gid].append(r)
            touched.add(gid)
        r.gpus, r.slot_s, r.paused_until = new, now, now + config.migration_s
        records[r.job.id].gpu_type = t
        moves += 1
        if not queue:  # with jobs waiting, what a move leaves is theirs (served next)
            left = [gid for gid in old if not occupants[gid]]
            if left:
                free[here] = sorted([*free.get(here, []), *left], key=fleet_index.__getitem__)
    return moves, touched, True


def _reoptimize(planning, energy, gpus, occupants, running, records, limits, now, config: SimConfig,
                levels: tuple[float, ...]) -> tuple[int, set[str]]:
    """One fleet-level re-solve, applied: (moves, GPUs whose occupants or limit changed)."""
    from gogh_flows.placement.reoptimize import reoptimize

    jobs = tuple(Job(r.job.id, r.job.job_type, r.job.required_throughput, max(r.remaining, _EPS_STEPS),
                     r.job.num_gpus, r.gpus, limits[r.gpus[0]]) for r in running.values())
    problem = PlacementProblem(tuple(gpus), jobs, planning, energy, levels)
    pinned = frozenset(r.job.id for r in running.values() if r.paused_until > now or r.slot_s >= now)
    plan = reoptimize(problem, migration_s=config.migration_s, budget=config.reopt_budget,
                      min_gain=config.reopt_gain, pinned=pinned)
    touched: set[str] = set()
    for gid, limit in plan.limits.items():
        limits[gid] = limit
        touched.add(gid)
    for m in plan.moves:  # every mover leaves before any lands (swaps)
        r = running[m.job_id]
        for gid in m.from_gpus:
            occupants[gid].remove(r)
            touched.add(gid)
    for m in plan.moves:
        r = running[m.job_id]
        for gid in m.to_gpus:
            occupants[gid].append(r)
            limits[gid] = m.power_limit_w
            touched.add(gid)
        r.gpus, r.slot_s, r.paused_until = m.to_gpus, now, now + config.migration_s
        records[m.job_id].gpu_type = m.to_type
    return len(plan.moves), touched


def _sufficient_limit(energy: EnergyModel, gpu_type: str, limit: float | None, slow: float, need: float,
                      levels: tuple[float, ...]) -> float | None:
    """The lowest of the policy's limit levels above ``limit`` on ``gpu_type`` at which a board
    observed slowed ``slow``-fold there is slowed at most ``need``-fold (None: its maximum).

    The board's draw at its maximum is what the observed slowdown implies under the limit
    model (a slowdown grows with the draw it cuts): a plan's assumed draw is what left the
    job short. Stepping one level at a time instead cost a short job an observation interval
    per level."""
    g = energy.gpu(gpu_type)
    if limit is None or g.power_limit_range_w is None:
        return None
    # the most the board can draw at its maximum and be slowed no more than observed: at the
    # clock floor larger draws are all slowed about alike (not even monotonically), so the
    # largest that fits is the safe side
    draws = np.linspace(g.idle_w, energy.max_limit(g), 257)
    fits = draws[energy.at_limits(g, draws, limit)[0] <= slow * (1 + 1e-6)]
    p0 = float(fits[-1]) if fits.size else float(draws[-1])
    above = sorted(w for w in (level_watts(g, f) for f in levels if f < 1) if w > limit + 1e-6)
    for w in above:
        if energy.at_limit(g, p0, w)[0] <= need * (1 - 1e-9):
            return w
    return None


def _update_rates(gpu: Gpu, occ: list[_Running], rates: TrueRates, energy: EnergyModel,
                  limit: float | None = None) -> None:
    """True rates of a board's jobs; under a limit both slow by the board's common factor."""
    if len(occ) == 1:
        occ[0].rate = rates.alone(occ[0].job, gpu.gpu_type)
    elif len(occ) == 2:
        a, b = occ
        a.rate = rates.shared(a.job, b.job, gpu.gpu_type)
        b.rate = rates.shared(b.job, a.job, gpu.gpu_type)
    for r in occ:
        r.slow = 1.0  # the raw rates above are at the maximum limit
    slow = 1.0
    if limit is not None and occ:
        slow = energy.at_limit(gpu.gpu_type, _board_power(energy, gpu, occ, rates), limit)[0]
    for r in occ:
        r.slow = slow
        r.rate /= slow


def _board_power(energy: EnergyModel, gpu: Gpu, occ: list[_Running], rates: TrueRates) -> float:
    """What the busy board would draw at its maximum limit."""
    view = rates.view
    if len(occ) == 1:
        return energy.power_alone(gpu.gpu_type, view.activity(occ[0].job, gpu.gpu_type))
    loads = []
    for r in occ:
        alone = rates.alone(r.job, gpu.gpu_type)
        full = r.rate * r.slow  # the shared rate at the maximum limit
        loads.append((view.activity(r.job, gpu.gpu_type), min(1.0, full / alone) if alone > 0 else 0.0))
    return energy.power_shared(gpu.gpu_type, (loads[0], loads[1]))


def _gpu_power(energy: EnergyModel, gpu: Gpu, occ: list[_Running], rates: TrueRates,
               config: SimConfig, limit: float | None = None) -> float:
    if not occ:
        return 0.0 if config.park_idle else energy.idle_power(gpu.gpu_type)
    board = _board_power(energy, gpu, occ, rates)
    return board if limit is None else energy.at_limit(gpu.gpu_type, board, limit)[1]


__all__ = [
    "REBALANCE_OBJECTIVES", "JobRecord", "ObservedThroughputs", "SimConfig", "SimJob", "SimResult",
    "TrueRates", "attainment_text", "rebalance_objective", "simulate",
]

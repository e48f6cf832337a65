"""Event-driven simulation of a placement policy on a fleet, from a job stream.

Why event-driven rather than rounds: between two events (an arrival or a
completion) nothing changes, so every job's progress and every GPU's energy
can be integrated exactly, and a decision is taken exactly when the state
changes, as a live scheduler would.

The policy plans with its own view of throughputs (``oracle`` = the truth
table); jobs progress at the *true* rates, with seeded measurement noise, so a
policy that mispredicts pays for it in energy and requirement misses.

Metrics (see ``SimResult``): energy integrates every GPU's power over time,
idle GPUs included (or parked at 0 W); SLA attainment is the fraction of
running job-time at or above the job's requirement (queueing is reported
separately as ``avg_queue_s``); JCT is completion minus arrival.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from gogh_flows.energy import EnergyModel, kwh
from gogh_flows.placement.problem import Gpu, Job, PlacementProblem, TableThroughputs, Throughputs
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

    def __post_init__(self) -> None:
        if self.decision_window < 1:
            raise ValueError(f"decision_window must be >= 1 job, got {self.decision_window!r}")
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
    run_s: float = 0.0
    done: float = 0.0  # steps done
    paused_until: float = 0.0  # migration restart: no progress before this time
    observe_at: float = math.inf  # next monitoring observation


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
    steps_done: float = 0.0


@dataclass
class SimResult:
    policy: str
    energy_j: float
    jobs: dict[str, JobRecord]
    decision_ms: list[float]
    power_trace: list[tuple[float, float, float]]  # (start s, end s, fleet watts)
    migrations: int = 0
    end_s: float = 0.0
    unfinished: list[str] = field(default_factory=list)
    # (time s, busy GPUs per type) after every event that changed occupancy
    occupancy: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    fleet: dict[str, int] = field(default_factory=dict)  # GPUs per type

    def summary(self) -> dict[str, float | int]:
        done = [r for r in self.jobs.values() if r.finished_s is not None]
        placed = [r for r in self.jobs.values() if r.placed_s is not None]
        run = sum(r.run_s for r in self.jobs.values())
        ok = sum(r.ok_s for r in self.jobs.values())
        arrivals = [r.arrival_s for r in self.jobs.values()]
        return {
            "energy_kwh": kwh(self.energy_j),
            "sla_attainment": ok / run if run > 0 else 1.0,
            "avg_jct_s": float(np.mean([r.finished_s - r.arrival_s for r in done])) if done else math.nan,
            "makespan_s": (max(r.finished_s for r in done) - min(arrivals)) if done else math.nan,
            "avg_queue_s": float(np.mean([r.placed_s - r.arrival_s for r in placed])) if placed else math.nan,
            "migrations": self.migrations,
            "jobs_completed": len(done),
            "jobs_unfinished": len(self.unfinished),
            "decision_p50_ms": float(np.percentile(self.decision_ms, 50)) if self.decision_ms else 0.0,
            "decision_p99_ms": float(np.percentile(self.decision_ms, 99)) if self.decision_ms else 0.0,
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
) -> SimResult:
    """Run ``policy`` on the job stream; ``planning`` is what it predicts with (default: truth)."""
    energy = energy or EnergyModel()
    config = config or SimConfig()
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
    records = {s.id: JobRecord(s.id, s.job_type, s.arrival_s) for s in pending}
    occupants: dict[str, list[_Running]] = {g.id: [] for g in gpus}
    running: dict[str, _Running] = {}
    queue: list[SimJob | _Running] = []  # arrivals, and evicted jobs waiting to be re-placed
    migrations = 0
    power = {g.id: _gpu_power(energy, by_id[g.id], [], rates, config) for g in gpus}
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

    while nxt < len(pending) or running:
        t_arrival = pending[nxt].arrival_s if nxt < len(pending) else math.inf
        t_done = min((now + r.remaining / r.rate for r in running.values()
                      if r.rate > 0 and r.paused_until <= now), default=math.inf)
        t_resume = min((r.paused_until for r in running.values() if r.paused_until > now),
                       default=math.inf)
        t_observe = min((r.observe_at for r in running.values()), default=math.inf)
        t_next = min(t_arrival, t_done, t_resume, t_observe, config.horizon_s)
        if t_next == math.inf:
            break  # queued jobs that no GPU can ever take: reported unfinished
        dt = t_next - now
        if dt > 0:
            watts = sum(power.values())
            trace.append((now, t_next, watts))
            total_j += watts * dt
            for r in running.values():
                rate = 0.0 if r.paused_until > now else r.rate
                r.remaining -= rate * dt
                r.done += rate * dt
                r.run_s += dt
                if rate >= r.job.required_throughput * (1 - 1e-9):
                    r.ok_s += dt
        now = t_next
        if now >= config.horizon_s:
            break
        changed: set[str] = set()
        for r in [r for r in running.values() if r.remaining <= _EPS_STEPS * max(1.0, r.spec.total_steps)]:
            rec = records[r.job.id]
            rec.finished_s, rec.ok_s, rec.run_s, rec.steps_done = now, r.ok_s, r.run_s, r.done
            del running[r.job.id]
            for gid in r.gpus:
                occupants[gid].remove(r)
                changed.add(gid)
            done_count += 1
        for r in [r for r in running.values() if r.observe_at <= now]:
            r.observe_at = math.inf
            gpu_type = by_id[r.gpus[0]].gpu_type
            partners = [o for o in occupants[r.gpus[0]] if o is not r]
            planning.observe(r.job, gpu_type, partners[0].job if partners else None, r.rate)
            if r.rate < r.job.required_throughput * (1 - 1e-9):
                del running[r.job.id]  # evicted: re-placed first, ahead of new arrivals
                for gid in r.gpus:
                    occupants[gid].remove(r)
                    changed.add(gid)
                queue.insert(0, r)
        arrived = False
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            queue.append(pending[nxt])
            nxt += 1
            arrived = True
        if queue and (arrived or changed):
            start = 0
            while start < len(queue):
                before = len(queue)
                moved, placed_on = _decide(policy, planning, energy, gpus, running, occupants,
                                           queue, records, now, decision_ms, config.migration_s,
                                           start, config.decision_window)
                migrations += moved
                changed |= placed_on
                if len(queue) == before:
                    break  # this chunk placed nothing: the fleet is full for now
                start += config.decision_window - (before - len(queue))
        for gid in changed:
            _update_rates(by_id[gid], occupants[gid], rates)
            if config.replace_below_requirement:
                for r in occupants[gid]:
                    r.observe_at = max(now, r.paused_until) + config.observe_after_s
            power[gid] = _gpu_power(energy, by_id[gid], occupants[gid], rates, config)
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
        rec.ok_s, rec.run_s, rec.steps_done = r.ok_s, r.run_s, r.done
    unfinished = [s.id for s in pending if records[s.id].finished_s is None]
    return SimResult(policy.name, total_j, records, decision_ms, trace, migrations, now,
                     unfinished, occupancy, fleet)


def _decide(policy, planning, energy, gpus, running, occupants, queue, records, now,
            decision_ms, migration_s, start, window) -> tuple[int, set[str]]:
    """Place queue[start:start + window]; returns (migrations, GPUs whose occupants changed)."""
    run_jobs = [
        Job(r.job.id, r.job.job_type, r.job.required_throughput, max(r.remaining, _EPS_STEPS),
            r.job.num_gpus, r.gpus)
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
    decision_ms.append((time.perf_counter() - t0) * 1e3)
    by_id = {(q.job.id if isinstance(q, _Running) else q.id): q for q in chunk}
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
            r.gpus = a.gpus
        else:
            r = _Running(placed_job[a.job_id], item, a.gpus, float(item.total_steps), placed_s=now)
            records[a.job_id].placed_s = now
        running[a.job_id] = r
        for gid in a.gpus:
            occupants[gid].append(r)
            changed.add(gid)
        records[a.job_id].gpu_type = a.gpu_type
    placed = {a.job_id for a in placement.assignments}
    queue[:] = [q for q in queue if (q.job.id if isinstance(q, _Running) else q.id) not in placed]
    return moved, changed


def _update_rates(gpu: Gpu, occ: list[_Running], rates: TrueRates) -> None:
    if len(occ) == 1:
        occ[0].rate = rates.alone(occ[0].job, gpu.gpu_type)
    elif len(occ) == 2:
        a, b = occ
        a.rate = rates.shared(a.job, b.job, gpu.gpu_type)
        b.rate = rates.shared(b.job, a.job, gpu.gpu_type)


def _gpu_power(energy: EnergyModel, gpu: Gpu, occ: list[_Running], rates: TrueRates,
               config: SimConfig) -> float:
    view = rates.view
    if not occ:
        return 0.0 if config.park_idle else energy.idle_power(gpu.gpu_type)
    if len(occ) == 1:
        return energy.power_alone(gpu.gpu_type, view.activity(occ[0].job, gpu.gpu_type))
    loads = []
    for r in occ:
        alone = rates.alone(r.job, gpu.gpu_type)
        loads.append((view.activity(r.job, gpu.gpu_type), min(1.0, r.rate / alone) if alone > 0 else 0.0))
    return energy.power_shared(gpu.gpu_type, (loads[0], loads[1]))


__all__ = ["JobRecord", "ObservedThroughputs", "SimConfig", "SimJob", "SimResult", "TrueRates", "simulate"]

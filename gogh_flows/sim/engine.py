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
from dataclasses import dataclass, field
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

    def __post_init__(self) -> None:
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
    planning = planning or rates.view
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
    queue: list[SimJob] = []
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
        t_done = min((now + r.remaining / r.rate for r in running.values() if r.rate > 0), default=math.inf)
        t_next = min(t_arrival, t_done, config.horizon_s)
        if t_next == math.inf:
            break  # queued jobs that no GPU can ever take: reported unfinished
        dt = t_next - now
        if dt > 0:
            watts = sum(power.values())
            trace.append((now, t_next, watts))
            total_j += watts * dt
            for r in running.values():
                r.remaining -= r.rate * dt
                r.done += r.rate * dt
                r.run_s += dt
                if r.rate >= r.job.required_throughput * (1 - 1e-9):
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
        arrived = False
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            queue.append(pending[nxt])
            nxt += 1
            arrived = True
        if queue and (arrived or changed):
            changed |= _decide(policy, planning, energy, gpus, running, occupants, queue,
                               records, now, decision_ms)
        for gid in changed:
            _update_rates(by_id[gid], occupants[gid], rates)
            power[gid] = _gpu_power(energy, by_id[gid], occupants[gid], rates, config)
            now_busy = bool(occupants[gid])
            if now_busy != (gid in busy_ids):
                busy[by_id[gid].gpu_type] += 1 if now_busy else -1
                (busy_ids.add if now_busy else busy_ids.discard)(gid)
        if changed:
            occupancy.append((now, dict(busy)))
        if progress is not None:
            progress(done_count, len(pending))

    for r in running.values():  # horizon reached: keep what was measured
        rec = records[r.job.id]
        rec.ok_s, rec.run_s, rec.steps_done = r.ok_s, r.run_s, r.done
    unfinished = [s.id for s in pending if records[s.id].finished_s is None]
    return SimResult(policy.name, total_j, records, decision_ms, trace, 0, now, unfinished,
                     occupancy, fleet)


def _decide(policy, planning, energy, gpus, running, occupants, queue, records, now,
            decision_ms) -> set[str]:
    run_jobs = [
        Job(r.job.id, r.job.job_type, r.job.required_throughput, max(r.remaining, _EPS_STEPS),
            r.job.num_gpus, r.gpus)
        for r in running.values()
    ]
    waiting = [Job(s.id, s.job_type, float(s.required_throughput), float(s.total_steps), s.num_gpus)
               for s in queue]
    problem = PlacementProblem(tuple(gpus), tuple(run_jobs + waiting), planning, energy)
    t0 = time.perf_counter()
    placement = policy.place(problem)
    decision_ms.append((time.perf_counter() - t0) * 1e3)
    by_id = {s.id: s for s in queue}
    placed_job = {j.id: j for j in waiting}
    changed: set[str] = set()
    for a in placement.assignments:
        spec = by_id[a.job_id]
        r = _Running(placed_job[a.job_id], spec, a.gpus, float(spec.total_steps), placed_s=now)
        running[a.job_id] = r
        for gid in a.gpus:
            occupants[gid].append(r)
            changed.add(gid)
        rec = records[a.job_id]
        rec.placed_s, rec.gpu_type = now, a.gpu_type
    placed = {a.job_id for a in placement.assignments}
    queue[:] = [s for s in queue if s.id not in placed]
    return changed


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


__all__ = ["JobRecord", "SimConfig", "SimJob", "SimResult", "TrueRates", "simulate"]

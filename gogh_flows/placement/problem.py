"""What a placement decision is asked: the fleet, the jobs on it, the jobs arriving.

Throughputs come through the small :class:`Throughputs` protocol keyed by
*job* (not job type), because the GOGH refiner corrects each job's predictions
individually; :class:`TableThroughputs` serves a ground-truth table (the
``oracle`` view) by job type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gogh_flows.catalog import GpuType
from gogh_flows.energy import DEFAULT_ACTIVITY, EnergyModel
from gogh_flows.power_limits import evidence_bound, informed_rate, measured_watts, probe_limit
from gogh_flows.truth.table import ThroughputTable

GANG_SIZES = (1, 2, 4, 8)
MAX_CAPACITY = 2  # co-location data is pairwise: Gavel measured pairs, not triples


#: what a job type's runs at lowered limits measured: (limit W, steps/s) or (limit W, steps/s, board W)
EvidencePoint = tuple[float, ...]
#: (job type, GPU type) -> what that type's runs measured at lowered limits there
LimitEvidence = Mapping[tuple[str, str], tuple[EvidencePoint, ...]]
#: a job's (rate, measured board W or None) at a limit, given the model's rate there
Informed = Callable[[float, float], tuple[float, float | None]]


def _checked_evidence(evidence: Mapping) -> dict[tuple[str, str], tuple[EvidencePoint, ...]]:
    out: dict[tuple[str, str], tuple[EvidencePoint, ...]] = {}
    for key, points in (evidence or {}).items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) and k for k in key)):
            raise ValueError(f"limit_evidence is keyed by (job type, GPU type), got the key {key!r}")
        try:
            pts = tuple(tuple(float(v) for v in pt) for pt in points)
        except (TypeError, ValueError):
            pts = ((math.nan, math.nan),)  # not tuples of numbers: said below
        bad = [pt for pt in pts if not (len(pt) in (2, 3) and math.isfinite(pt[0]) and pt[0] > 0
                                        and math.isfinite(pt[1]) and pt[1] >= 0
                                        and (len(pt) == 2 or (math.isfinite(pt[2]) and pt[2] > 0)))]
        if bad:
            raise ValueError(f"limit_evidence for {key!r} holds (limit W, steps/s) pairs, or (limit W, steps/s, "
                             f"board W) triples, with a limit > 0, a rate >= 0 and a power > 0; got {list(points)!r}")
        out[key] = pts
    return out


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of the fleet; ``capacity`` is how many single-GPU jobs may share it."""

    id: str
    gpu_type: str
    capacity: int = 2

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Gpu.id must be a non-empty string")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or not (
            1 <= self.capacity <= MAX_CAPACITY
        ):
            raise ValueError(
                f"Gpu.capacity of {self.id!r} must be 1 (exclusive) or 2 (pairs may share), "
                f"got {self.capacity!r}: throughput data are pairwise, so larger groups "
                "cannot be predicted"
            )


@dataclass(frozen=True, slots=True)
class Job:
    """A job to place (``gpus`` empty) or one already running on ``gpus``."""

    id: str
    job_type: str
    required_throughput: float  # steps/s the job must get
    work: float  # remaining steps
    num_gpus: int = 1
    gpus: tuple[str, ...] = ()
    #: the power limit of the GPU(s) a running job is on; None: the board's maximum
    power_limit_w: float | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Job.id must be a non-empty string")
        if not self.job_type:
            raise ValueError(f"Job.job_type of {self.id!r} must be a non-empty string")
        for name in ("required_throughput", "work"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Job.{name} of {self.id!r} must be a number > 0, got {value!r}")
        if self.num_gpus not in GANG_SIZES:
            raise ValueError(
                f"Job.num_gpus of {self.id!r} must be one of {GANG_SIZES}, got {self.num_gpus!r}"
            )
        if self.gpus and len(self.gpus) != self.num_gpus:
            raise ValueError(
                f"Job {self.id!r} runs on {len(self.gpus)} GPU(s) {list(self.gpus)} "
                f"but num_gpus is {self.num_gpus}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"Job {self.id!r} lists a GPU twice: {list(self.gpus)}")
        if self.power_limit_w is not None:
            if not self.gpus:
                raise ValueError(f"Job {self.id!r} has a power limit but runs on no GPU; only a running "
                                 "job carries its GPU's limit (the placement chooses an arriving job's)")
            v = self.power_limit_w
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"Job.power_limit_w of {self.id!r} must be watts > 0 or None, got {v!r}")

    @property
    def running(self) -> bool:
        return bool(self.gpus)


@runtime_checkable
class Throughputs(Protocol):
    """Predicted (or true) throughputs the optimiser plans with, per job."""

    def isolated(self, job: Job, gpu_type: str) -> float:
        """Steps/s of ``job`` alone on ``job.num_gpus`` GPUs of ``gpu_type`` (0 = does not fit)."""
        ...

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        """(job, partner) steps/s while sharing one GPU of ``gpu_type``; (0, 0) = does not fit."""
        ...

    def activity(self, job: Job, gpu_type: str) -> float:
        """Fraction of the GPU's dynamic power range the job draws alone."""
        ...


def level_watts(gpu: GpuType, fraction: float) -> float:
    """The power limit (W, to 0.1 W) at ``fraction`` of ``gpu``'s allowed range: what a limit
    level means, for the placement and for whatever bounds it (``sim.bound``) alike."""
    if gpu.power_limit_range_w is None:
        raise ValueError(f"GPU type {gpu.name!r} has no power_limit_range_w; its limit cannot be set")
    lo, hi = gpu.power_limit_range_w
    return round(lo + fraction * (hi - lo), 1)


@dataclass(frozen=True)
class TableThroughputs:
    """A :class:`ThroughputTable` served by job type (the ``oracle`` view)."""

    table: ThroughputTable
    default_activity: float = DEFAULT_ACTIVITY

    def isolated(self, job: Job, gpu_type: str) -> float:
        if not self.table.has(job.job_type, gpu_type, job.num_gpus):
            return 0.0
        return self.table.isolated(job.job_type, gpu_type, job.num_gpus)

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        return self.table.pair(job.job_type, partner.job_type, gpu_type)

    def activity(self, job: Job, gpu_type: str) -> float:
        value = self.table.activity(job.job_type, gpu_type)
        return self.default_activity if value is None else value

    def knows(self, job_type: str) -> bool:
        return self.table.knows(job_type)


@dataclass(frozen=True)
class PlacementProblem:
    """The fleet, its running jobs and the arriving jobs, plus what to plan with.

    Validation happens here, once, so every policy can trust the problem.
    """

    gpus: tuple[Gpu, ...]
    jobs: tuple[Job, ...]
    throughputs: Throughputs
    energy: EnergyModel = field(default_factory=EnergyModel)
    #: power-limit levels to choose from, as fractions of each type's limit range (0 = its
    #: lowest limit, 1 = its maximum); empty: every GPU keeps the limit it has (docs/optimizer.md)
    power_limit_levels: tuple[float, ...] = ()
    #: rates measured at lowered limits, (job type, GPU type) -> ((limit W, steps/s), ...), of
    #: single-GPU runs alone: a board's throughput does not rise as its limit falls, so at a
    #: limit at or below one measured a job of that type runs at most as fast as it did there.
    #: The power-limit model predicts every job's slowdown from its draw alone; this is what a
    #: job's own runs showed (docs/energy.md, "Learning from runs at limits"). A measured level
    #: counts at its measured rate (and at the board power measured there, a third figure when
    #: known), and the level below the best measured is tried (:meth:`informed`, :meth:`probe_limit`)
    limit_evidence: LimitEvidence = field(default_factory=dict)
    #: whether a job alone may be offered the level below the best its type measured (:meth:`probe_limit`)
    limit_trials: bool = True
    #: (job type, GPU type) with a run whose measurement is still to come though it no longer
    #: runs (its body ended, its record not yet written): no trial for them meanwhile
    measuring: frozenset[tuple[str, str]] = frozenset()
    _by_id: Mapping[str, Gpu] = field(init=False, repr=False, compare=False)
    _occupants: Mapping[str, tuple[Job, ...]] = field(init=False, repr=False, compare=False)
    _levels: dict[str, tuple[float | None, ...]] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)
    _probes: dict[tuple[str, str], float | None] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "jobs", tuple(self.jobs))
        levels = tuple(self.power_limit_levels)
        bad = [v for v in levels if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1]
        if bad:
            raise ValueError(f"power_limit_levels are fractions of each GPU type's limit range in [0, 1] "
                             f"(1 = the maximum limit), got {bad!r}")
        object.__setattr__(self, "power_limit_levels", tuple(sorted(set(levels) | ({1.0} if levels else set()),
                                                                    reverse=True)))
        object.__setattr__(self, "limit_evidence", _checked_evidence(self.limit_evidence))
        by_id: dict[str, Gpu] = {}
        for g in self.gpus:
            if g.id in by_id:
                raise ValueError(f"duplicate GPU id {g.id!r} in the fleet")
            by_id[g.id] = g
        for gpu_type in {g.gpu_type for g in self.gpus}:
            self.energy.gpu(gpu_type)  # unknown type -> UnknownGpuTypeError naming it
        seen: set[str] = set()
        occupants: dict[str, list[Job]] = {g: [] for g in by_id}
        for job in self.jobs:
            if job.id in seen:
                raise ValueError(f"duplicate job id {job.id!r}")
            seen.add(job.id)
            knows = getattr(self.throughputs, "knows", None)
            if knows is not None and not knows(job.job_type):
                raise ValueError(
                    f"job {job.id!r} has job type {job.job_type!r}, which the throughput "
                    "source does not know; use a job type from its table or a predictor"
                )
            for gid in job.gpus:
                if gid not in by_id:
                    raise ValueError(f"running job {job.id!r} is on unknown GPU {gid!r}")
                occupants[gid].append(job)
            if job.num_gpus > 1 and job.gpus:
                types = {by_id[g].gpu_type for g in job.gpus}
                if len(types) > 1:
                    raise ValueError(
                        f"gang job {job.id!r} spans GPU types {sorted(types)}; a gang runs on one type"
                    )
        for gid, occ in occupants.items():
            limits = {j.power_limit_w for j in occ}
            if len(limits) > 1:
                raise ValueError(f"GPU {gid!r} is given two power limits by its jobs "
                                 f"{[(j.id, j.power_limit_w) for j in occ]}; a board has one limit")
            cap = by_id[gid].capacity
            if len(occ) > cap:
                raise ValueError(
                    f"GPU {gid!r} holds {len(occ)} jobs {[j.id for j in occ]} but its capacity is {cap}"
                )
            if len(occ) > 1 and any(j.num_gpus > 1 for j in occ):
                raise ValueError(
                    f"GPU {gid!r} is shared by {[j.id for j in occ]}, but gang jobs do not share GPUs"
                )
        object.__setattr__(self, "_by_id", by_id)
        object.__setattr__(self, "_occupants", {g: tuple(v) for g, v in occupants.items()})

    @classmethod
    def build(
        cls,
        gpus: Iterable[Gpu],
        jobs: Iterable[Job],
        throughputs: Throughputs | ThroughputTable,
        energy: EnergyModel | None = None,
        power_limit_levels: tuple[float, ...] = (),
        limit_evidence: Mapping[tuple[str, str], Iterable[EvidencePoint]] | None = None,
        limit_trials: bool = True,
        measuring: Iterable[tuple[str, str]] = (),
    ) -> PlacementProblem:
        tp = TableThroughputs(throughputs) if isinstance(throughputs, ThroughputTable) else throughputs
        problem = cls(tuple(gpus), tuple(jobs), tp, energy or EnergyModel(), tuple(power_limit_levels),
                      dict(limit_evidence or {}), limit_trials, frozenset(measuring))  # type: ignore[arg-type]
        if isinstance(throughputs, ThroughputTable):
            # a type the table has no column for would read as "does not fit" for every job
            absent = sorted({g.gpu_type for g in problem.gpus} - set(throughputs.gpu_types))
            if absent:
                raise ValueError(f"GPU type(s) {absent} of the fleet are not in the throughput table "
                                 f"({throughputs.source}; it covers {list(throughputs.gpu_types)}): give a table "
                                 "that measures them, or leave those GPUs out")
        return problem

    def rate_bound(self, job: Job, gpu_type: str, limit_w: float | None) -> float:
        """The most ``job`` can run at on ``gpu_type`` at ``limit_w`` by what its type's runs
        measured at that limit or above (inf: nothing known; at the maximum, for a gang, or for
        a type never measured at a lowered limit there, the predictions stand alone)."""
        if limit_w is None or job.num_gpus > 1 or not self.limit_evidence:
            return math.inf
        seen = self.limit_evidence.get((job.job_type, gpu_type))
        if not seen:
            return math.inf
        return evidence_bound(seen, limit_w)

    def probe_limit(self, job: Job, gpu_type: str) -> float | None:
        """The lowered limit worth one run of ``job`` alone on ``gpu_type``: the level just below
        the best its type's runs measured there (``power_limits.probe_limit``); None when nothing
        was measured, nothing lower is left to try, another run of its type is running on a GPU of
        the type, or ended there with its measurement still to come (:attr:`measuring`), or is an
        earlier arrival of this decision (one trial at a time, each decided on every measurement
        before it), for a gang, or without ``limit_trials``."""
        if job.num_gpus > 1 or not self.limit_evidence or not self.limit_trials:
            return None
        key = (job.id, gpu_type)
        if key not in self._probes:
            seen = self.limit_evidence.get((job.job_type, gpu_type))
            full = self.throughputs.isolated(job, gpu_type) if seen else 0.0
            probe = None
            if seen and full > 0:
                activity = self.throughputs.activity(job, gpu_type)
                g = self.energy.gpu(gpu_type)
                probe = probe_limit([w for w in self.limit_levels(gpu_type) if w is not None], seen,
                                    job.required_throughput, lambda w: self.energy.power_alone(gpu_type, activity, w),
                                    self.energy.max_limit(gpu_type), full,
                                    unpaid_w=0.0 if self.energy.count_idle else g.idle_w)
            if probe is not None and ((job.job_type, gpu_type) in self.measuring or any(
                    j.running and j.job_type == job.job_type and self._by_id[j.gpus[0]].gpu_type == gpu_type
                    for j in self.jobs if j.id != job.id)
                    or next((j for j in self.arriving if j.job_type == job.job_type), None) is not job):
                # one trial at a time: not while a run of the type is on a GPU of the type (its
                # measurement is still to come, and a trial the guard lifted no longer shows its
                # limit), nor for a later arrival of the same decision
                probe = None
            self._probes[key] = probe
        return self._probes[key]

    def informed(self, job: Job, gpu_type: str) -> Informed | None:
        """``(limit W, the model's rate there) -> (rate, measured board W or None)`` for ``job``
        alone on ``gpu_type``, from what runs of its type measured at lowered limits; None where
        nothing was (a gang, another type: the model stands, bounded by :meth:`rate_bound`).

        A measured limit is taken as measured, not as the model predicts it; the one level below
        the best measured (:meth:`probe_limit`) is offered at the rate measured above it, so a job
        type whose runs met their requirement comfortably tries a lower limit, one level per run,
        until a run falls short or costs more per step.
        """
        if job.num_gpus > 1 or not self.limit_evidence:
            return None
        seen = self.limit_evidence.get((job.job_type, gpu_type))
        if not seen:
            return None
        probe = self.probe_limit(job, gpu_type)

        def rate_at(limit_w: float, model_rate: float) -> tuple[float, float | None]:
            return informed_rate(seen, limit_w, model_rate, probe), measured_watts(seen, limit_w)
        return rate_at

    def limit_levels(self, gpu_type: str) -> tuple[float | None, ...]:
        """The limits a placement may set on a free GPU of ``gpu_type``, highest first; None is
        the maximum (nothing set). Just (None,) when limits are not chosen."""
        if not self.power_limit_levels:
            return (None,)
        cached = self._levels.get(gpu_type)
        if cached is None:
            g = self.energy.gpu(gpu_type)
            if g.power_limit_range_w is None:
                cached = (None,)  # a type without a known range is left at its maximum
            else:
                cached = tuple(None if f >= 1 else level_watts(g, f) for f in self.power_limit_levels)
            self._levels[gpu_type] = cached
        return cached

    def gpu_limit(self, gpu_id: str) -> float | None:
        """The limit a GPU runs at now (its running jobs'); None: its maximum."""
        occ = self._occupants[gpu_id]
        return occ[0].power_limit_w if occ else None

    def gpu(self, gpu_id: str) -> Gpu:
        return self._by_id[gpu_id]

    def occupants(self, gpu_id: str) -> tuple[Job, ...]:
        return self._occupants[gpu_id]

    @property
    def running(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if j.running)

    @property
    def arriving(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if not j.running)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({g.gpu_type for g in self.gpus}))

    def job(self, job_id: str) -> Job:
        for j in self.jobs:
            if j.id == job_id:
                return j
        raise KeyError(f"no job {job_id!r} in the problem")

"""The learned policies' view of throughputs: predictions per *job*, refined as it is observed.

Why per job and not per job type: GOGH's refiner (P2) corrects a job's whole prediction
vector -- every GPU type, every partner -- from what monitoring measured *for that job*.
Two jobs of one type may have been seen on different GPUs, so their corrected rows
differ. This class answers the planner's ``Throughputs`` protocol
(``isolated``/``pair``/``activity``) from those rows and receives the simulator's
monitoring observations through ``observe`` (the "learning base" hook of
``sim.engine.ObservedThroughputs``).

How an entry is formed:

- a job type's prior row (no observation) is the predictor service's table for it: P1,
  corrected by P2's learned prior shift when a refiner is given; computed once per type;
- a job's own row is recomputed only when it gets a new observation (simulations stay
  fast): the service's ``predict_table`` for that job alone with all of its
  observations, so P2 spreads one measured GPU type/partner to every other type;
- a co-located pair uses P1's slowdown ratio (shared / alone, per pair of job types and
  GPU type) applied to each job's own refined isolated value: P2's layout names only the
  job types it was trained on, and the jobs of a held-out family are not among them;
- a measured pair rate whose partner is outside P2's layout is turned into the isolated
  rate it implies (divided by that ratio) before it reaches P2; one inside the layout
  goes in as the pair entry it is;
- multi-GPU (gang) jobs: the predictors know one GPU; a gang's rate is the single-GPU
  rate x ``n`` x a scaling efficiency per (n, GPU type) measured on the *training* job
  types (:func:`gang_scaling`), and a gang's observation is divided by the same factor;
- power activity: not predicted; the planner's default (what a new job would get);
- feasibility floor: a requirement is a statement that the job can reach it somewhere
  in the fleet. When a job's predicted isolated rate is below its requirement on every
  GPU type it has not been measured alone on, those entries are scaled up until the best
  of them just meets it. Without this an underestimated job would wait forever and never
  be observed, so never corrected; with it, the job is tried on its most promising type,
  measured, and re-placed by the refined predictions if it falls short.

``refine=False`` is ``gogh-p1``: the same predictions with observations ignored (the
simulator's overlay still remembers exact measured entries for every policy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gogh_flows.placement.problem import DEFAULT_ACTIVITY, Job
from gogh_flows.truth.table import ThroughputTable

_FLOOR_MARGIN = 1e-3  # floored entries clear the requirement by this fraction (rounding)


@dataclass(frozen=True)
class Predictors:
    """A trained P1 (and optional P2) plus what the simulator needs beside them."""

    p1: object  # gogh_flows.predict.p1.P1Model
    p2: object | None  # gogh_flows.predict.p2.P2Model
    gang: Mapping[tuple[int, str], float] = field(default_factory=dict)  # (n, GPU type) -> efficiency
    description: str = ""  # how they were obtained (trained in-run, loaded from a directory)


def gang_scaling(truth: ThroughputTable, job_types: Iterable[str]) -> dict[tuple[int, str], float]:
    """Median scaling efficiency ``iso(n) / (n * iso(1))`` per (n, GPU type) over ``job_types``.

    Pass only the job types the predictors were trained on: the efficiency of a held-out
    family's gangs must not leak from the truth into the learned policies.
    """
    names = [j for j in job_types if truth.knows(j)]
    effs: dict[tuple[int, str], list[float]] = {}
    for n in (2, 4, 8):
        for g in truth.gpu_types:
            for j in names:
                if truth.has(j, g, n) and truth.has(j, g, 1):
                    one = truth.isolated(j, g, 1)
                    if one > 0:
                        effs.setdefault((n, g), []).append(truth.isolated(j, g, n) / (n * one))
    return {k: float(np.median(v)) for k, v in effs.items()}


class LearnedThroughputs:
    """Throughputs per job from a :class:`ThroughputPredictor`; see the module docstring."""

    def __init__(self, predictors: Predictors, gpu_types: Sequence[str], *, refine: bool = True,
                 features: Mapping[str, object] | None = None,
                 default_activity: float = DEFAULT_ACTIVITY) -> None:
        from gogh_flows.predict.service import ThroughputPredictor

        self.refine = refine
        self.gpus = tuple(dict.fromkeys(gpu_types))
        if not self.gpus:
            raise ValueError("LearnedThroughputs needs at least one GPU type")
        self.col = {g: i for i, g in enumerate(self.gpus)}
        # gogh-p1 plans with P1 alone: no refiner, not even its observation-free prior shift
        self.service = ThroughputPredictor(predictors.p1, predictors.p2 if refine else None)
        self.p1 = predictors.p1
        self.gang = dict(predictors.gang)
        self.default_activity = default_activity
        self._features: dict[str, object] = dict(features or {})
        self._layout_partners = set(predictors.p2.layout.partners) if (refine and predictors.p2) else set()
        self._type_iso: dict[str, np.ndarray] = {}  # job type -> prior isolated row [G]
        self._ratio: dict[tuple[str, str], np.ndarray] = {}  # (type, partner type) -> [G]
        self._obs: dict[str, list[dict]] = {}  # job id -> observation rows for the service
        self._row: dict[str, np.ndarray] = {}  # job id -> refined isolated row [G]
        self._dirty: set[str] = set()
        self._alone_seen: dict[str, set[str]] = {}  # job id -> GPU types measured alone on
        self._floored: dict[str, tuple[float, np.ndarray]] = {}  # job id -> (requirement, row)
        self.refinements = 0  # how many times a job's row was recomputed (for reports)

    # -- features and priors -----------------------------------------------------------------
    def _feat(self, job_type: str):
        if job_type not in self._features:
            from gogh_flows.predict.data import zoo_jobs

            self._features[job_type] = zoo_jobs([job_type])[job_type]
        return self._features[job_type]

    def knows(self, job_type: str) -> bool:
        try:
            self._feat(job_type)
        except (KeyError, ValueError):
            return False
        return True

    def _prior(self, job_type: str) -> np.ndarray:
        row = self._type_iso.get(job_type)
        if row is None:
            table = self.service.predict_table({job_type: self._feat(job_type)}, self.gpus)
            row = np.array([table.isolated(job_type, g) if table.has(job_type, g) else 0.0
                            for g in self.gpus])
            self._type_iso[job_type] = row
        return row

    def ratio(self, job_type: str, partner_type: str) -> np.ndarray:
        """P1's shared/alone throughput of ``job_type`` next to ``partner_type``, per GPU type."""
        key = (job_type, partner_type)
        r = self._ratio.get(key)
        if r is None:
            pred = self.p1.predict({job_type: self._feat(job_type)}, self.gpus,
                                   partners={partner_type: self._feat(partner_type)})
            iso, pair = pred.isolated[0], pred.pair[0, 0]
            r = np.where(iso > 0, pair / np.where(iso > 0, iso, 1.0), 0.0)
            self._ratio[key] = r
        return r

    # -- per-job rows ------------------------------------------------------------------------
    def _single(self, job: Job) -> np.ndarray:
        """The job's single-GPU isolated row: refined when it has observations, floored."""
        if job.id in self._dirty:
            self._dirty.discard(job.id)
            self._recompute(job)
            self._floored.pop(job.id, None)
        hit = self._floored.get(job.id)
        if hit is not None and hit[0] == job.required_throughput:
            return hit[1]
        row = self._row.get(job.id)
        row = self._prior(job.job_type) if row is None else row
        row = self._floor(job, row)
        self._floored[job.id] = (job.required_throughput, row)
        return row

    def _floor(self, job: Job, row: np.ndarray) -> np.ndarray:
        """Unmeasured entries scaled up so the best meets the requirement (module docstring)."""
        measured = self._alone_seen.get(job.id, set())
        need = np.array([job.required_throughput / self._gang(job.num_gpus, g) for g in self.gpus])
        free = np.array([g not in measured and row[i] > 0 for i, g in enumerate(self.gpus)])
        if not free.any():
            return row
        if (row[free] >= need[free]).any():
            return row
        scale = float(np.min(need[free] / row[free])) * (1 + _FLOOR_MARGIN)
        out = row.copy()
        out[free] *= scale
        return out

    def _recompute(self, job: Job) -> None:
        from gogh_flows.predict.service import observations_frame

        obs = observations_frame(self._obs[job.id])
        table = self.service.predict_table({job.id: self._feat(job.job_type)}, self.gpus, obs)
        self._row[job.id] = np.array([table.isolated(job.id, g) if table.has(job.id, g) else 0.0
                                      for g in self.gpus])
        self.refinements += 1

    def _gang(self, n: int, gpu_type: str) -> float:
        return 1.0 if n == 1 else n * self.gang.get((n, gpu_type), 1.0)

    # -- the Throughputs protocol --------------------------------------------------------------
    def isolated(self, job: Job, gpu_type: str) -> float:
        if gpu_type not in self.col:
            return 0.0
        return float(self._single(job)[self.col[gpu_type]]) * self._gang(job.num_gpus, gpu_type)

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        if gpu_type not in self.col:
            return 0.0, 0.0
        c = self.col[gpu_type]
        own = float(self._single(job)[c] * self.ratio(job.job_type, partner.job_type)[c])
        other = float(self._single(partner)[c] * self.ratio(partner.job_type, job.job_type)[c])
        if not (own > 0 and other > 0):
            return 0.0, 0.0  # memory: the pair does not fit
        return own, other

    def activity(self, job: Job, gpu_type: str) -> float:
        return self.default_activity

    def observe(self, job: Job, gpu_type: str, partner: Job | None, rate: float) -> None:
        """A monitoring observation: refines the job's whole row (``refine=True`` only)."""
        if gpu_type not in self.col or not math.isfinite(rate):
            return
        if partner is None:
            # also without refinement: the simulator's overlay now answers with the measured
            # value here, so the feasibility floor must lift the types not yet tried instead
            # (gogh-p1 once left jobs measured short on their floored best type queued forever)
            self._alone_seen.setdefault(job.id, set()).add(gpu_type)
            self._floored.pop(job.id, None)
        if not self.refine or not rate > 0:
            return  # an observed 0 (did not run) stays with the simulator's exact overlay
        single = rate / self._gang(job.num_gpus, gpu_type)
        row = {"job_type": job.id, "gpu_type": gpu_type, "partner": None, "throughput": single}
        if partner is not None:
            if partner.job_type in self._layout_partners:
                row["partner"] = partner.job_type
            else:
                r = float(self.ratio(job.job_type, partner.job_type)[self.col[gpu_type]])
                if not r > 0:
                    return
                row["throughput"] = single / r
        self._obs.setdefault(job.id, []).append(row)
        self._dirty.add(job.id)


__all__ = ["LearnedThroughputs", "Predictors", "gang_scaling"]

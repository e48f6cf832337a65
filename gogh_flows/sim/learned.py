"""The learned policies' view of throughputs: predictions per job type, refined as jobs are observed.

This is GOGH's learning base in the simulator. Every monitoring observation of a job is
kept under the job's *type* (model and batch size), as the product keeps measurements
under the job name: two jobs of one type run the same code, so what one of them showed
improves the predictions for every later job of that type -- the point of GOGH is that
each run makes later placements better. The class answers the planner's ``Throughputs``
protocol (``isolated``/``pair``/``activity``) from those rows and receives the simulator's
monitoring observations through ``observe`` (the "learning base" hook of
``sim.engine.ObservedThroughputs``).

How an entry is formed:

- a job type's prior row (no observation) is the predictor service's table for it: P1,
  corrected by P2's learned prior shift when a refiner is given;
- once jobs of the type have been observed, the row is the service's ``predict_table``
  for that type with all of the type's observations (recomputed only when a new one
  arrives, so simulations stay fast): P2 spreads one measured GPU type or partner to
  every other type, and measured entries come back as measured (mean over repeats);
- a co-located pair: a pair of job types measured together on a GPU type answers with
  what was measured (mean over repeats); otherwise P1's slowdown ratio (shared / alone,
  per pair of job types and GPU type) applied to each side's refined isolated value, as
  P2's layout names only the job types it was trained on (not a held-out family's);
- a measured pair rate whose partner is outside P2's layout is turned into the isolated
  rate it implies (divided by that ratio) before it reaches P2; one inside the layout
  goes in as the pair entry it is;
- multi-GPU (gang) jobs: a gang size measured on a GPU type answers with what was measured;
  otherwise the predictors know one GPU, and a gang's rate is the single-GPU
  rate x ``n`` x a scaling efficiency per (n, GPU type) measured on the *training* job
  types (:func:`gang_scaling`), and a gang's observation is divided by the same factor;
- power activity: not predicted; the planner's default (what a new job would get);
- feasibility floor: a requirement is a statement that the job can reach it somewhere
  in the fleet. When a job's predicted isolated rate is below its requirement on every
  GPU type that has not been measured alone (for this job, or for its type when
  refining), those entries are scaled up until the best of them just meets it. Without
  this an underestimated job would wait forever and never be observed, so never
  corrected; with it, the job is tried on its most promising type, measured, and
  re-placed by the refined predictions if it falls short.

``refine=False`` is ``gogh-p1``: P1's predictions with observations ignored, no learning
base (the simulator's per-job overlay still remembers exact measured entries for every
policy).

``risk_level`` (0.5-0.95, as ``PlacementPolicy.risk_level``): every isolated entry not yet
measured is planned at the lower end of the refiner's calibrated interval at that level,
the ``isolated`` width before the job type has any measurement and the narrower
``isolated_1obs`` width after; measured entries stay as measured. A co-located rate is the
lowered isolated rate times P1's slowdown ratio (the co-located widths are not applied on
top). The feasibility floor still applies after lowering: a job must be tried somewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
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
                 default_activity: float = DEFAULT_ACTIVITY, risk_level: float | None = None,
                 explore_types: Sequence[str] = (), gpu_counts: Mapping[str, int] | None = None) -> None:
        from gogh_flows.predict.service import ThroughputPredictor

        self.refine = refine
        self.gpus = tuple(dict.fromkeys(gpu_types))
        if not self.gpus:
            raise ValueError("LearnedThroughputs needs at least one GPU type")
        self.col = {g: i for i, g in enumerate(self.gpus)}
        # GPUs of each type in the fleet (None: unknown, any gang fits): the feasibility floor looks
        # for a type that can host the job's gang; a 4-GPU job predicted fast enough on a type with
        # two GPUs was never lifted on the one type that could host it, and waited for ever (a review)
        self.gpu_counts = dict(gpu_counts) if gpu_counts is not None else None
        # gogh-p1 plans with P1 alone: no refiner, not even its observation-free prior shift
        self.service = ThroughputPredictor(predictors.p1, predictors.p2 if refine else None)
        # Planning with margin (issue: calibrated uncertainty): the lower end of the refiner's
        # interval at ``risk_level``, wide before a job type is measured, narrower after.
        self.risk_level = risk_level
        # Choosing the observation (issue 13, item 4): a job type nothing was measured of is
        # first offered only these GPU types, when one of them is predicted to meet its
        # requirement, so its first measurement is taken where it tells the most.
        self.explore_types = tuple(g for g in explore_types if g in self.col)
        self._shrink = {}
        if risk_level is not None:
            from gogh_flows.predict.intervals import NoIntervalsError

            intervals = ThroughputPredictor(predictors.p1, predictors.p2).intervals
            if intervals is None:
                raise NoIntervalsError(
                    f"risk level {risk_level:g} needs the refiner's calibrated intervals and these "
                    "predictors have none: train them with intervals (train_holdout(intervals=True), "
                    "`gogh predictors train`) or plan with risk_level=None")
            self._shrink = {case: math.exp(-intervals.halfwidth(case, risk_level))
                            for case in ("isolated", "isolated_1obs")}
        self.p1 = predictors.p1
        self.gang = dict(predictors.gang)
        self.default_activity = default_activity
        self._features: dict[str, object] = dict(features or {})
        self._layout_partners = set(predictors.p2.layout.partners) if (refine and predictors.p2) else set()
        self._type_iso: dict[str, np.ndarray] = {}  # job type -> prior isolated row [G]
        self._ratio: dict[tuple[str, str], np.ndarray] = {}  # (type, partner type) -> [G]
        # the learning base, per job type (refine=True only)
        self._obs: dict[str, list[dict]] = {}  # job type -> observation rows for the service
        self._row: dict[str, np.ndarray] = {}  # job type -> refined isolated row [G]
        self._version: dict[str, int] = {}  # job type -> how often its row changed
        self._dirty: set[str] = set()
        self._pair_seen: dict[tuple[str, str, str], list[float]] = {}  # (type, partner, GPU) -> rates
        self._gang_seen: dict[tuple[str, int, str], list[float]] = {}  # (type, n, GPU) -> gang rates
        # single-GPU isolated measurements per (type, GPU index), and their geometric means
        self._alone_rates: dict[tuple[str, int], list[float]] = {}
        self._measured: dict[str, dict[int, float]] = {}  # job type -> {GPU index: mean}
        self._measured_version = 0
        self._with_siblings: dict[str, tuple[tuple[int, int], np.ndarray]] = {}
        # per job: what the simulator's overlay answers with exact measurements
        self._own: dict[str, dict[str, float]] = {}  # job id -> {GPU type measured alone on: its rate}
        self._floored: dict[str, tuple[tuple, np.ndarray]] = {}  # job id -> (stamp, row)
        self.refinements = 0  # how many times a type's row was recomputed (for reports)

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

    # -- rows ------------------------------------------------------------------------------
    def _type_row(self, job_type: str) -> np.ndarray:
        """The type's single-GPU isolated row: refined from its observations, else the prior,
        then moved by what its measured siblings (same family) show (``predict.siblings``)."""
        if job_type in self._dirty:
            self._dirty.discard(job_type)
            self._recompute(job_type)
        row = self._row.get(job_type)
        row = self._prior(job_type) if row is None else row
        if not self.refine or not self._measured:
            return row
        stamp = (self._measured_version, self._version.get(job_type, 0))  # siblings', own row
        hit = self._with_siblings.get(job_type)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        from gogh_flows.predict.siblings import family_and_batch, sibling_transfer

        kin = {t: family_and_batch(t) for t in (job_type, *self._measured)}
        priors = {t: self._prior(t) for t in kin}
        out = sibling_transfer({job_type: row}, priors, self._measured, {t: k[0] for t, k in kin.items()},
                               [job_type], batch_size={t: k[1] for t, k in kin.items() if k[1]})[job_type]
        self._with_siblings[job_type] = (stamp, out)
        return out

    def _single(self, job: Job) -> np.ndarray:
        """The job's single-GPU isolated row (at its lower bound under a risk level), floored
        for its requirement."""
        row = self._type_row(job.job_type)
        own = self._own.get(job.id, {})
        typed = self._type_measured(job.job_type, job.num_gpus)
        if self._shrink:  # measured entries stay as measured; the rest at their lower bound
            case = "isolated_1obs" if (typed or own) else "isolated"
            keep = np.array([g in typed or g in own for g in self.gpus])
            row = np.where(keep, row, row * self._shrink[case])
        if self.explore_types and not (typed or own or self._measured.get(job.job_type)):
            first = np.array([g in self.explore_types for g in self.gpus])
            need = self._need(job)
            if (row[first] >= need[first]).any():  # it can start there: nowhere else, for now
                row = np.where(first, row, 0.0)
        stamp = (job.required_throughput, self._version.get(job.job_type, 0), len(own), len(typed),
                 self._measured_version, tuple(own.items()),
                 tuple(len(self._gang_seen.get((job.job_type, job.num_gpus, g), ())) for g in self.gpus)
                 if job.num_gpus > 1 else ())
        hit = self._floored.get(job.id)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        # Nothing to lift when the job meets its requirement somewhere already: where it was
        # measured to (its own measurements, at its gang size), or where a type it has not
        # tried is predicted to (one its siblings were measured on counts). Lifting the others
        # then would offer a cheaper type predicted short, to be measured short, or move the
        # job there from where it was fine (a job visited V100, T4 and K80 in turn while its
        # type's H100 measurement met it).
        need = self._need(job)
        # what isolated() answers, per GPU: a gang size measured on a type answers as measured
        answer = row.copy()
        if job.num_gpus > 1:
            for i, g in enumerate(self.gpus):
                seen = self._gang_seen.get((job.job_type, job.num_gpus, g))
                if seen:
                    answer[i] = _geomean(seen) / self._gang(job.num_gpus, g)
        hosts = self._hosts(job)
        untried = np.array([g not in own and answer[i] > 0 for i, g in enumerate(self.gpus)]) & hosts
        met = any(rate >= job.required_throughput * (1 - 1e-9) for rate in own.values())
        out = None
        if not met and not (answer[untried] >= need[untried] * (1 - 1e-9)).any():
            # GPU types nobody measured this job type on are lifted first; failing those, the
            # ones only *other* jobs of its type were measured on (with measurement noise a
            # job can reach its requirement where its type's mean does not)
            out = self._floor(answer, need, own.keys() | typed, hosts)
            if out is None:
                out = self._floor(answer, need, own.keys(), hosts)
        row = answer if out is None else out
        self._floored[job.id] = (stamp, row)
        return row

    def _need(self, job: Job) -> np.ndarray:
        """Per GPU type, the single-GPU rate that meets the job's requirement at its gang size."""
        return np.array([job.required_throughput / self._gang(job.num_gpus, g) for g in self.gpus])

    def _hosts(self, job: Job) -> np.ndarray:
        """Per GPU type, whether the fleet has enough GPUs of it for the job's gang."""
        if self.gpu_counts is None:
            return np.ones(len(self.gpus), dtype=bool)
        return np.array([self.gpu_counts.get(g, 0) >= job.num_gpus for g in self.gpus])

    def _floor(self, row: np.ndarray, need: np.ndarray, measured: AbstractSet[str],
               hosts: np.ndarray) -> np.ndarray | None:
        """Unmeasured entries of types that can host the job scaled up so the best meets ``need``
        (module docstring); None when there is no such entry to lift."""
        free = np.array([g not in measured and row[i] > 0 for i, g in enumerate(self.gpus)]) & hosts
        if not free.any():
            return None
        if (row[free] >= need[free]).any():
            return row
        scale = float(np.min(need[free] / row[free])) * (1 + _FLOOR_MARGIN)
        out = row.copy()
        out[free] *= scale
        return out

    def _recompute(self, job_type: str) -> None:
        from gogh_flows.predict.service import observations_frame

        alone = self._type_measured(job_type, 1)
        # an isolated rate implied by a pair or gang measurement is a guess: where the type
        # was measured alone on one GPU, that measurement alone counts
        obs = observations_frame([{k: v for k, v in o.items() if k != "implied"}
                                  for o in self._obs[job_type]
                                  if not (o.get("implied") and o["gpu_type"] in alone)])
        table = self.service.predict_table({job_type: self._feat(job_type)}, self.gpus, obs)
        self._row[job_type] = np.array([table.isolated(job_type, g) if table.has(job_type, g) else 0.0
                                        for g in self.gpus])
        self._version[job_type] = self._version.get(job_type, 0) + 1
        self.refinements += 1

    def _type_measured(self, job_type: str, num_gpus: int) -> set[str]:
        """GPU types the job type was measured alone on at this gang size (``refine`` only): a
        gang's rate is pinned only by gangs of its size (single-GPU rates reach it through an
        assumed scaling efficiency)."""
        if num_gpus == 1:
            return {self.gpus[c] for c in self._measured.get(job_type, ())}
        return {g for g in self.gpus if (job_type, num_gpus, g) in self._gang_seen}

    def _gang(self, n: int, gpu_type: str) -> float:
        return 1.0 if n == 1 else n * self.gang.get((n, gpu_type), 1.0)

    # -- the Throughputs protocol --------------------------------------------------------------
    def isolated(self, job: Job, gpu_type: str) -> float:
        if gpu_type not in self.col:
            return 0.0
        # a gang size measured on the type answers as measured (``_single`` puts it in the row),
        # unless the feasibility floor lifted it
        return float(self._single(job)[self.col[gpu_type]]) * self._gang(job.num_gpus, gpu_type)

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        if gpu_type not in self.col:
            return 0.0, 0.0
        own = self.pair_side(job, partner, gpu_type)
        other = self.pair_side(partner, job, gpu_type)
        if not (own > 0 and other > 0):
            return 0.0, 0.0  # memory: the pair does not fit
        return own, other

    def pair_side(self, job: Job, partner: Job, gpu_type: str) -> float:
        """``job``'s rate next to ``partner`` on ``gpu_type`` (one side of :meth:`pair`)."""
        seen = self._pair_seen.get((job.job_type, partner.job_type, gpu_type))
        if seen and job.num_gpus == 1:
            return _geomean(seen)  # measured for this pair of types
        c = self.col[gpu_type]
        return float(self._single(job)[c] * self.ratio(job.job_type, partner.job_type)[c])

    def activity(self, job: Job, gpu_type: str) -> float:
        return self.default_activity

    def observe(self, job: Job, gpu_type: str, partner: Job | None, rate: float) -> None:
        """A monitoring observation: goes into the job type's learning base (``refine=True``)."""
        if gpu_type not in self.col or not math.isfinite(rate):
            return
        if partner is None:
            # also without refinement: the simulator's overlay now answers with the measured
            # value here, so the feasibility floor must lift the types not yet tried instead
            # (gogh-p1 once left jobs measured short on their floored best type queued forever)
            self._own.setdefault(job.id, {})[gpu_type] = rate
        if not self.refine or not rate > 0:
            return  # an observed 0 (did not run) stays with the simulator's exact overlay
        single = rate / self._gang(job.num_gpus, gpu_type)
        # a gang's single-GPU rate goes through an assumed scaling efficiency: a guess, like a
        # pair rate turned into an isolated one (below)
        row = {"job_type": job.job_type, "gpu_type": gpu_type, "partner": None, "throughput": single,
               "implied": job.num_gpus > 1}
        if partner is None:
            if job.num_gpus == 1:
                c = self.col[gpu_type]
                rates = self._alone_rates.setdefault((job.job_type, c), [])
                rates.append(rate)
                self._measured.setdefault(job.job_type, {})[c] = _geomean(rates)
                self._measured_version += 1
            if job.num_gpus > 1:
                self._gang_seen.setdefault((job.job_type, job.num_gpus, gpu_type), []).append(rate)
        else:
            if job.num_gpus == 1 and partner.num_gpus == 1:
                self._pair_seen.setdefault((job.job_type, partner.job_type, gpu_type), []).append(rate)
            if partner.job_type in self._layout_partners:
                row["partner"] = partner.job_type
            else:
                r = float(self.ratio(job.job_type, partner.job_type)[self.col[gpu_type]])
                if not r > 0:
                    return
                row["throughput"] = single / r
                row["implied"] = True
        self._obs.setdefault(job.job_type, []).append(row)
        self._dirty.add(job.job_type)


def middle_types(gpu_types: Sequence[str]) -> tuple[str, ...]:
    """The fleet's middle GPU type by FP32 peak (of V100, P100, K80: the P100): a first
    measurement there sits between the others, the parameter-free choice of issue 13's item 4."""
    from gogh_flows.catalog import get_gpu_type

    ranked = sorted(dict.fromkeys(gpu_types), key=lambda g: (get_gpu_type(g).fp32_tflops, g))
    return (ranked[len(ranked) // 2],) if ranked else ()


def _geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


__all__ = ["LearnedThroughputs", "Predictors", "gang_scaling", "middle_types"]

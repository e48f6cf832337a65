"""P2 averaged with a baseline that needs no training, in log space, by weights chosen on unseen families.

Why the product does not predict with P2 alone: on Gavel's seven families
(docs/predictors.md) P2 with one observation beats the ratio baseline on only 4 of 7
families and the partner-mean slowdown on 2 of 7, and with nothing observed P1 is worse
than the per-type geometric mean on 4 of 7. Their average is better than either where
P2's errors and the baseline's are not the same errors. Where a learned model does not beat
the simple baselines, the product uses the better method; this module is that method, the
same as the evaluation's ``ensemble`` (:func:`gogh_flows.predict.evaluate.build_methods`).

The baseline depends on what is known of the job:

* **nothing measured**: the training jobs' geometric mean on each GPU type (a pair entry:
  times their mean slowdown next to that partner on that type), the prior P1 must beat;
* **at least one entry measured**: the roofline ratio, the job's roofline throughput on
  each type (``max(FLOPs / peak, bytes / bandwidth)`` per layer) shifted to its
  measurements: a cross-type ratio with no parameter fitted to other jobs; or, where the inner
  split chose it for the case (``baselines``), the row of the nothing-measured case shifted
  to the measurements (the ratio baseline; in pairs the training jobs' slowdowns).

P2's weight for each of the four cases (isolated or co-located, nothing or something
measured) is chosen on the inner split when the refiner is trained (every training family
predicted by models fitted without it), never on data it is then scored on, and stored with
P2 (``trained_on["ensemble"]``, JSON). A weight of 1 is P2 alone.

With each weight the inner split also chooses a *reach*: a job farther than it from every
training job in P1's own input space (:class:`Domain`) is predicted by the baseline alone.
A learned model extrapolates worst where it has seen nothing alike: on Gavel the two families
P1 is several times off for (A3C, Recommendation) are the two farthest from the others, and
there the per-type mean is the better guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gogh_flows import catalog
from gogh_flows.predict.baselines import Domain, PriorRow
from gogh_flows.predict.encoding import job_summary, roofline
from gogh_flows.predict.layout import Layout
from gogh_flows.workloads.features import WorkloadFeatures

#: P2's weight is chosen per case: isolated or co-located entries, of a job with nothing
#: measured or with at least one entry measured (the interval cases)
CASES = ("isolated", "colocated", "isolated_1obs", "colocated_1obs")
#: the baselines P2 is averaged with: the per-type mean (pairs: times the partner-mean slowdown),
#: and the roofline ratio (only once the job has a measurement to shift it to)
BASELINES = ("partner_mean", "roofline")
#: each case's baseline where ``Ensemble.baselines`` does not name one (and before it existed)
DEFAULT_BASELINE = {"isolated": "partner_mean", "colocated": "partner_mean", "isolated_1obs": "roofline",
                    "colocated_1obs": "roofline"}
#: the P2 weights each case chooses from
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the reaches each weight may come with (:class:`Domain` distance; ``inf``: every job)
REACHES = (3.0, 4.0, 5.0, math.inf)
#: every (weight, reach) the inner split scores: a weight of 0 is the baseline at any reach
SETTINGS = tuple((w, r) for r in REACHES for w in WEIGHTS if w > 0 or math.isinf(r))


def setting_name(weight: float, reach: float) -> str:
    """``0.75`` (every job), ``0.75<4`` (jobs within reach 4 of the training jobs)."""
    return f"{weight:g}" if math.isinf(reach) else f"{weight:g}<{reach:g}"


def roofline_log(features: WorkloadFeatures, gpu: str) -> float:
    """Log roofline throughput (1 / kernel time, steps/s) of a job on a catalog GPU type."""
    return -float(roofline(features, catalog.get_gpu_type(gpu))[0])


@dataclass(frozen=True)
class BaselineRows:
    """What the no-training baselines know of the training jobs, enough to build their rows
    for any job: the per-type geometric means and the mean slowdowns next to each partner."""

    gpus: tuple[str, ...]
    type_mean: tuple[float, ...]  # log steps/s per GPU type
    slowdown: Mapping[str, tuple[float, ...]]  # partner -> log(pair / alone) per GPU type
    slowdown_per_type: tuple[float, ...]  # the mean over partners, for a partner never measured

    @classmethod
    def fit(cls, layout: Layout, known_log: np.ndarray) -> BaselineRows:
        """From the training jobs' log layout vectors ``[J, size]`` (NaN: not measured), by the
        formulas of the evaluation's baselines (:class:`~gogh_flows.predict.baselines.PriorRow`)."""
        known = np.asarray(known_log, dtype=float)
        g = len(layout.gpus)
        iso = PriorRow.partner_mean(known, 1, g).rows[0][:g]
        if not np.isfinite(iso).all():
            missing = [gp for gp, v in zip(layout.gpus, iso) if not math.isfinite(v)]
            raise ValueError(f"no training job was measured alone on {missing}: the per-type mean needs one")
        slow, per_type = PriorRow.slowdown_table(known, g)
        return cls(tuple(layout.gpus), tuple(float(v) for v in iso),
                   {p: tuple(float(v) for v in slow[k]) for k, p in enumerate(layout.partners)},
                   tuple(float(v) for v in per_type))

    def slow(self, partner: str, gpu: str) -> float:
        """Log slowdown next to ``partner`` on ``gpu`` (the per-type mean for a partner never
        measured, the mean over types for a type no training job ran on)."""
        if gpu not in self.gpus:
            return float(np.mean(self.slowdown_per_type))
        c = self.gpus.index(gpu)
        row = self.slowdown.get(partner)
        return row[c] if row is not None else self.slowdown_per_type[c]

    def prior(self, gpu: str) -> float:
        """Log per-type mean of the training jobs alone on ``gpu`` (NaN: none ran there)."""
        return self.type_mean[self.gpus.index(gpu)] if gpu in self.gpus else math.nan

    def to_dict(self) -> dict:
        return {"gpus": list(self.gpus), "type_mean": list(self.type_mean),
                "slowdown": {p: list(v) for p, v in self.slowdown.items()},
                "slowdown_per_type": list(self.slowdown_per_type)}

    @classmethod
    def from_dict(cls, d: Mapping) -> BaselineRows:
        gpus = tuple(str(g) for g in d["gpus"])
        rows = cls(gpus, tuple(float(v) for v in d["type_mean"]),
                   {str(p): tuple(float(x) for x in v) for p, v in d["slowdown"].items()},
                   tuple(float(v) for v in d["slowdown_per_type"]))
        bad = [k for k, v in (("type_mean", rows.type_mean), ("slowdown_per_type", rows.slowdown_per_type),
                              *rows.slowdown.items()) if len(v) != len(gpus) or not all(map(math.isfinite, v))]
        if bad:
            raise ValueError(f"ensemble baseline rows: {bad} do not have one finite value per GPU type {list(gpus)}")
        return rows


@dataclass(frozen=True)
class Ensemble:
    """P2's weight per case and the baseline rows it is averaged with."""

    weights: Mapping[str, float]
    rows: BaselineRows
    calibration: str = ""
    #: case -> candidate setting (:func:`setting_name`) -> inner-split error that chose it (for the record)
    errors: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: case -> reach (a case not named: every job); a job farther from the training jobs gets weight 0
    reaches: Mapping[str, float] = field(default_factory=dict)
    domain: Domain | None = None
    #: case -> the baseline of :data:`BASELINES` P2 is averaged with (a case not named: :data:`DEFAULT_BASELINE`,
    #: filled in when made)
    baselines: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [c for c in CASES if c not in self.weights]
        bad = {c: w for c, w in self.weights.items() if not 0.0 <= float(w) <= 1.0}
        if missing or bad:
            raise ValueError(f"ensemble weights need P2's weight in [0, 1] for each of {CASES}; "
                             f"missing {missing}, out of range {bad}")
        reach = {c: r for c, r in self.reaches.items() if c not in CASES or not float(r) > 0}
        if reach:
            raise ValueError(f"ensemble reaches need a distance > 0 (inf: every job) per case of {CASES}; got {reach}")
        if self.domain is None and any(math.isfinite(float(r)) for r in self.reaches.values()):
            raise ValueError("an ensemble with a finite reach needs the training jobs' domain to measure it from")
        bad_base = {c: b for c, b in self.baselines.items()
                    if c not in CASES or b not in BASELINES or (b == "roofline" and not c.endswith("_1obs"))}
        if bad_base:
            raise ValueError(f"ensemble baselines name one of {BASELINES} per case of {CASES} (the roofline ratio "
                             f"only for a measured job's cases, *_1obs); got {bad_base}")
        # every case named, so an ensemble equals itself read back whichever way it was made
        object.__setattr__(self, "baselines", {c: self.baselines.get(c, DEFAULT_BASELINE[c]) for c in CASES})

    def baseline(self, case: str) -> str:
        """The baseline P2 is averaged with in ``case``."""
        return self.baselines[case]

    def weight(self, colocated: bool, measured: bool, distance: float = 0.0) -> float:
        """P2's weight for a job ``distance`` from the training jobs (0 beyond the case's reach)."""
        case = ("colocated" if colocated else "isolated") + ("_1obs" if measured else "")
        return 0.0 if distance > float(self.reaches.get(case, math.inf)) else float(self.weights[case])

    def distance(self, features: WorkloadFeatures) -> float:
        """How far a job is from the training jobs (0 without a domain: every job within reach)."""
        return self.domain.distance(job_summary(features)) if self.domain is not None else 0.0

    def blend(self, names: Sequence[str], features: Mapping[str, WorkloadFeatures], gpus: Sequence[str],
              observed: Mapping[tuple[str, str | None, str], float], iso: np.ndarray, pair: np.ndarray) -> None:
        """Average ``iso [J, G]`` and ``pair [J, J, G]`` (steps/s, P2's) with the baseline rows,
        in place. ``observed``: (job, partner or None, GPU type) -> mean log throughput; a job
        with any finite entry there is "measured". Zeros (does not fit) stay zeros; measured
        entries are the caller's to restore."""
        memo: dict[tuple[str, str], float] = {}

        def roof(job: str, gpu: str) -> float:
            """The job's roofline on ``gpu``, once per call (a job is often observed there with
            several partners, and its row needs it again)."""
            if (job, gpu) not in memo:
                memo[(job, gpu)] = roofline_log(features[job], gpu)
            return memo[(job, gpu)]

        alone: dict[str, Callable[[str, str], float]] = {"roofline": roof,
                                                          "partner_mean": lambda j, g: self.rows.prior(g)}
        shifts = {b: self._shifts(names, alone[b], observed) for b in BASELINES}
        measured = np.array([j in shifts["roofline"] or j in shifts["partner_mean"] for j in names], dtype=bool)
        before_iso, before_pair = iso.copy(), pair.copy()
        prior = np.array([self.rows.prior(g) for g in gpus], dtype=float)

        def target(case: str) -> np.ndarray:
            """``[J, G]`` log rows of the case's baseline, alone on each type. A measured job whose
            measurements are all on types without a per-type mean gets that mean unshifted (as
            the evaluation's :func:`~gogh_flows.predict.baselines.shifted` does with nothing usable),
            not P2 alone."""
            b = self.baseline(case)
            out = np.empty((len(names), len(gpus)))
            for i, j in enumerate(names):
                out[i] = (prior if not measured[i]
                          else [alone[b](j, g) + shifts[b].get(j, 0.0) for g in gpus])
            return out

        t_iso, t_co = target("isolated_1obs"), target("colocated_1obs")
        slow = np.array([[self.rows.slow(p, g) for g in gpus] for p in names]).reshape(len(names), len(gpus))
        far = [self.distance(features[j]) for j in names]
        w_iso = np.array([self.weight(False, m, d) for m, d in zip(measured, far)])[:, None]
        w_pair = np.array([self.weight(True, m, d) for m, d in zip(measured, far)])[:, None, None]
        iso[...] = _mix(iso, t_iso, w_iso)
        pair[...] = _mix(pair, t_co[:, None, :] + slow[None, :, :], w_pair)
        # A GPU type no training job ran on has no per-type mean: it keeps P2's ratio to the
        # types that have one, moved as they were (else the blend would change the ratios
        # between types that only P2 knows anything about)
        iso[...] = _carry(before_iso, iso, np.isfinite(t_iso))
        pair[...] = _carry(before_pair, pair, np.isfinite(t_co)[:, None, :])

    def _shifts(self, names: Sequence[str], alone: Callable[[str, str], float],
                observed: Mapping[tuple[str, str | None, str], float]) -> dict[str, float]:
        """Per measured job: the mean log offset of its measurements from a baseline's rows
        (``alone(job, gpu)``: the baseline's log throughput of the job alone there; a pair adds
        the partner-mean slowdown). Measurements on a type the baseline has nothing for are left out."""
        wanted = set(names)
        offsets: dict[str, list[float]] = {}
        for (j, p, g), v in observed.items():
            if j in wanted and math.isfinite(v):
                try:
                    base = alone(j, g) + (self.rows.slow(p, g) if p is not None else 0.0)
                except catalog.UnknownGpuTypeError:  # a logged type this install has no figures for
                    continue
                if math.isfinite(base):
                    offsets.setdefault(j, []).append(v - base)
        return {j: float(np.mean(v)) for j, v in offsets.items()}

    def to_dict(self) -> dict:
        # JSON has no infinity: a reach over every job is written as null
        return {"weights": {c: float(self.weights[c]) for c in CASES}, "rows": self.rows.to_dict(),
                "calibration": self.calibration,
                "errors": {c: dict(v) for c, v in self.errors.items()},
                "reaches": {c: (float(r) if math.isfinite(float(r)) else None) for c, r in self.reaches.items()},
                "baselines": dict(self.baselines),
                **({"domain": self.domain.to_dict()} if self.domain is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> Ensemble:
        """An ensemble stored before reaches (or baselines) existed predicts as it did: every job
        within reach, each case with its :data:`DEFAULT_BASELINE`."""
        return cls({str(c): float(w) for c, w in d["weights"].items()}, BaselineRows.from_dict(d["rows"]),
                   str(d.get("calibration", "")),
                   {str(c): {str(k): float(x) for k, x in v.items()} for c, v in d.get("errors", {}).items()},
                   {str(c): (math.inf if r is None else float(r)) for c, r in (d.get("reaches") or {}).items()},
                   Domain.from_dict(d["domain"]) if d.get("domain") is not None else None,
                   {str(c): str(b) for c, b in (d.get("baselines") or {}).items()})


def _carry(before: np.ndarray, after: np.ndarray, covered: np.ndarray) -> np.ndarray:
    """Entries not ``covered`` (along the last axis, GPU types) moved by the mean log change of
    the covered ones of the same row; rows with none covered as they are."""
    moved = covered & (before > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        change = np.where(moved, np.log(np.where(moved, after, 1.0)) - np.log(np.where(moved, before, 1.0)), 0.0)
    n = moved.sum(axis=-1, keepdims=True)
    mean = change.sum(axis=-1, keepdims=True) / np.maximum(n, 1)
    return np.where(~covered & (before > 0) & (n > 0), before * np.exp(mean), after)


def _mix(values: np.ndarray, target_log: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``exp(w log v + (1 - w) target)``; a zero (does not fit), a NaN target or a weight of 1
    keeps ``v`` exactly."""
    ok = (values > 0) & np.isfinite(target_log) & (w < 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mixed = np.exp(w * np.log(np.where(ok, values, 1.0)) + (1.0 - w) * np.where(ok, target_log, 0.0))
    return np.where(ok, mixed, values)


__all__ = ["BASELINES", "CASES", "DEFAULT_BASELINE", "REACHES", "SETTINGS", "WEIGHTS", "BaselineRows", "Domain", "Ensemble", "roofline_log",
           "setting_name"]

"""P2 averaged with a baseline that needs no training, in log space, by weights chosen on unseen families.

Why the product does not predict with P2 alone: on Gavel's seven families
(docs/predictors.md) P2 with one observation beats the ratio baseline on only 4 of 7
families and the partner-mean slowdown on 2 of 7, and with nothing observed P1 is worse
than the per-type geometric mean on 4 of 7. Their average is better than either where
P2's errors and the baseline's are not the same errors. The issue's rule is that the
product then uses the better method; this module is that method, the same as the
evaluation's ``ensemble`` (:func:`gogh_flows.predict.evaluate.build_methods`).

Three rows are averaged, P2's and two baselines': the **roofline** row (the job's roofline
throughput on each type, ``max(FLOPs / peak, bytes / bandwidth)`` per layer, times one
efficiency fitted on the training jobs) and the **per-type mean** row (the training jobs'
geometric mean on each type); a pair entry of either is its isolated entry times the training
jobs' mean slowdown next to that partner on that type. Once the job has measurements, each
baseline row is shifted to them (its mean log offset from them), which makes the roofline row a
parameter-free cross-type ratio and the per-type mean the ratio baseline.

The weights of the three, for each of four cases (isolated or co-located entries, of a job with
nothing or something measured), are chosen on the inner split when the refiner is trained
(every training family predicted by models fitted without it), never on data they are then
scored on, and stored with P2 (``trained_on["ensemble"]``, JSON). Weights (1, 0, 0) are P2
alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gogh_flows import catalog
from gogh_flows.predict.baselines import PriorRow
from gogh_flows.predict.encoding import roofline
from gogh_flows.predict.layout import Layout
from gogh_flows.workloads.features import WorkloadFeatures

#: the weights are chosen per case: isolated or co-located entries, of a job with nothing
#: measured or with at least one entry measured (the interval cases)
CASES = ("isolated", "colocated", "isolated_1obs", "colocated_1obs")
#: the rows averaged, in the order of a weight triple
COMPONENTS = ("p2", "roofline", "type_mean")
#: each weight's steps; the candidates are every (P2, roofline) pair of them summing to at most
#: 1, the per-type mean taking the rest
STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
GRID: tuple[tuple[float, float, float], ...] = tuple(
    (a, b, 1.0 - a - b) for a in STEPS for b in STEPS if a + b <= 1.0 + 1e-9)


def weights_name(w: Sequence[float]) -> str:
    """A weight triple as the report and the stored errors name it: P2/roofline/per-type mean."""
    return "/".join(f"{x:g}" for x in w)


def roofline_log(features: WorkloadFeatures, gpu: str) -> float:
    """Log roofline throughput (1 / kernel time, steps/s) of a job on a catalog GPU type."""
    return -float(roofline(features, catalog.get_gpu_type(gpu))[0])


@dataclass(frozen=True)
class BaselineRows:
    """What the no-training baselines know of the training jobs, enough to build their rows
    for any job: the per-type geometric means, the roofline's efficiency, and the mean
    slowdowns next to each partner."""

    gpus: tuple[str, ...]
    type_mean: tuple[float, ...]  # log steps/s per GPU type
    slowdown: Mapping[str, tuple[float, ...]]  # partner -> log(pair / alone) per GPU type
    slowdown_per_type: tuple[float, ...]  # the mean over partners, for a partner never measured
    efficiency: float = 0.0  # mean log(measured / roofline) of the training jobs alone

    @classmethod
    def fit(cls, layout: Layout, known_log: np.ndarray, roof_log: np.ndarray) -> BaselineRows:
        """From the training jobs' log layout vectors ``[J, size]`` (NaN: not measured) and their
        log roofline throughputs ``[J, G]``, by the formulas of the evaluation's baselines
        (:class:`~gogh_flows.predict.baselines.PriorRow`)."""
        known = np.asarray(known_log, dtype=float)
        g = len(layout.gpus)
        iso = PriorRow.partner_mean(known, 1, g).rows[0][:g]
        if not np.isfinite(iso).all():
            missing = [gp for gp, v in zip(layout.gpus, iso) if not math.isfinite(v)]
            raise ValueError(f"no training job was measured alone on {missing}: the per-type mean needs one")
        slow, per_type = PriorRow.slowdown_table(known, g)
        return cls(tuple(layout.gpus), tuple(float(v) for v in iso),
                   {p: tuple(float(v) for v in slow[k]) for k, p in enumerate(layout.partners)},
                   tuple(float(v) for v in per_type), PriorRow.efficiency(known, roof_log, g))

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
                "slowdown_per_type": list(self.slowdown_per_type), "efficiency": self.efficiency}

    @classmethod
    def from_dict(cls, d: Mapping) -> BaselineRows:
        gpus = tuple(str(g) for g in d["gpus"])
        rows = cls(gpus, tuple(float(v) for v in d["type_mean"]),
                   {str(p): tuple(float(x) for x in v) for p, v in d["slowdown"].items()},
                   tuple(float(v) for v in d["slowdown_per_type"]), float(d["efficiency"]))
        bad = [k for k, v in (("type_mean", rows.type_mean), ("slowdown_per_type", rows.slowdown_per_type),
                              *rows.slowdown.items()) if len(v) != len(gpus)]
        if bad:
            raise ValueError(f"ensemble baseline rows: {bad} do not have one value per GPU type {list(gpus)}")
        return rows


@dataclass(frozen=True)
class Ensemble:
    """The weights of P2, the roofline row and the per-type mean row per case, and what the
    baseline rows are built from."""

    weights: Mapping[str, tuple[float, float, float]]
    rows: BaselineRows
    calibration: str = ""
    #: case -> candidate (:func:`weights_name`) -> inner-split error that chose it (for the record)
    errors: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [c for c in CASES if c not in self.weights]
        bad = {c: w for c, w in self.weights.items()
               if len(w) != 3 or not all(0.0 <= float(x) <= 1.0 for x in w) or abs(sum(w) - 1.0) > 1e-6}
        if missing or bad:
            raise ValueError(f"ensemble weights need, for each of {CASES}, three weights in [0, 1] summing to 1 "
                             f"({', '.join(COMPONENTS)}); missing {missing}, invalid {bad}")

    def weight(self, colocated: bool, measured: bool) -> tuple[float, float, float]:
        return tuple(self.weights[("colocated" if colocated else "isolated") + ("_1obs" if measured else "")])

    def blend(self, names: Sequence[str], features: Mapping[str, WorkloadFeatures], gpus: Sequence[str],
              observed: Mapping[tuple[str, str | None, str], float], iso: np.ndarray, pair: np.ndarray) -> None:
        """Average ``iso [J, G]`` and ``pair [J, J, G]`` (steps/s, P2's) with the baseline rows,
        in place. ``observed``: (job, partner or None, GPU type) -> mean log throughput; a job
        with any finite entry there is "measured". Zeros (does not fit) stay zeros; measured
        entries are the caller's to restore."""
        J, G = len(names), len(gpus)
        roof_shift, mean_shift = self._shifts(names, features, observed)
        measured = np.array([j in roof_shift for j in names], dtype=bool)
        roof = np.array([[roofline_log(features[j], g) for g in gpus] for j in names]).reshape(J, G)
        roof += np.array([roof_shift.get(j, self.rows.efficiency) for j in names])[:, None]
        mean = np.array([[self.rows.prior(g) for g in gpus]] * J).reshape(J, G)
        mean += np.array([mean_shift.get(j, math.nan) if measured[i] else 0.0 for i, j in enumerate(names)])[:, None]
        slow = np.array([[self.rows.slow(p, g) for g in gpus] for p in names]).reshape(J, G)
        w_iso = np.array([self.weight(False, bool(m)) for m in measured])[:, None, :]  # [J, 1, 3]
        w_pair = np.array([self.weight(True, bool(m)) for m in measured])[:, None, None, :]  # [J, 1, 1, 3]
        iso[...] = mix(iso, roof, mean, w_iso)
        pair[...] = mix(pair, roof[:, None, :] + slow[None], mean[:, None, :] + slow[None], w_pair)

    def _shifts(self, names: Sequence[str], features: Mapping[str, WorkloadFeatures],
                observed: Mapping[tuple[str, str | None, str], float]) -> tuple[dict[str, float], dict[str, float]]:
        """Per measured job: the mean log offset of its measurements from its roofline rows, and
        from its per-type mean rows (measurements on types no training job ran on left out)."""
        wanted = set(names)
        to_roof: dict[str, list[float]] = {}
        to_mean: dict[str, list[float]] = {}
        for (j, p, g), v in observed.items():
            if j in wanted and math.isfinite(v):
                slow = self.rows.slow(p, g) if p is not None else 0.0
                try:
                    to_roof.setdefault(j, []).append(v - roofline_log(features[j], g) - slow)
                except catalog.UnknownGpuTypeError:  # a logged type this install has no figures for
                    continue
                if math.isfinite(self.rows.prior(g)):
                    to_mean.setdefault(j, []).append(v - self.rows.prior(g) - slow)
        return ({j: float(np.mean(v)) for j, v in to_roof.items()},
                {j: float(np.mean(v)) for j, v in to_mean.items()})

    def to_dict(self) -> dict:
        return {"components": list(COMPONENTS),
                "weights": {c: [float(x) for x in self.weights[c]] for c in CASES}, "rows": self.rows.to_dict(),
                "calibration": self.calibration, "errors": {c: dict(v) for c, v in self.errors.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Ensemble:
        if list(d.get("components", ())) != list(COMPONENTS):
            raise ValueError(f"ensemble components {d.get('components')!r}, expected {list(COMPONENTS)}")
        return cls({str(c): tuple(float(x) for x in w) for c, w in d["weights"].items()},
                   BaselineRows.from_dict(d["rows"]), str(d.get("calibration", "")),
                   {str(c): {str(k): float(x) for k, x in v.items()} for c, v in d.get("errors", {}).items()})


def mix(p2: np.ndarray, roof_log: np.ndarray, mean_log: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``exp(a log p2 + b roof + c mean)`` for weights ``w[..., (a, b, c)]`` (broadcast against the
    values); a baseline that is NaN there gives its weight to the others; a zero of P2 (does not
    fit) stays, and so does P2's value where no component with weight is left."""
    w = np.asarray(w, dtype=float)
    a, b, c = w[..., 0], w[..., 1], w[..., 2]
    ok_roof, ok_mean = np.isfinite(roof_log), np.isfinite(mean_log)
    b, c = np.where(ok_roof, b, 0.0), np.where(ok_mean, c, 0.0)
    a = np.broadcast_to(a, np.broadcast_shapes(np.shape(a), np.shape(b), np.shape(p2)))
    total = a + b + c
    fit = p2 > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        mixed = (a * np.log(np.where(fit, p2, 1.0)) + b * np.where(ok_roof, roof_log, 0.0)
                 + c * np.where(ok_mean, mean_log, 0.0)) / np.where(total > 0, total, 1.0)
        return np.where(fit & (total > 0), np.exp(mixed), p2)


__all__ = ["CASES", "COMPONENTS", "GRID", "STEPS", "BaselineRows", "Ensemble", "mix", "roofline_log", "weights_name"]

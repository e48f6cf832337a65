"""How far a prediction can be trusted: split-conformal half-widths, calibrated on unseen families.

A placement that meets a requirement by the point prediction fails whenever the prediction
is a little high, and for a job no predictor has seen it often is (docs/predictors.md: a
factor 1.6 median error after one observation on Gavel's data). With a risk level ``r``
(``PlacementPolicy.risk_level``) the placement plans with the lower end of the ``r``
interval instead: ``prediction / exp(h)``, where ``h`` is the ``r`` quantile of the
refiner's absolute log errors on families it was not trained on. The interval is wide for a
job with nothing measured and narrower once it has been measured on one GPU type; an entry
measured itself is planned at its measurement.

The errors come from the same inner split as the evaluation (each family of the training
data predicted by a P1 trained without it and a P2 trained on the others), so a family is
never calibrated on itself. Stored in P2's ``trained_on["intervals"]`` (JSON, with the model).

A conformal quantile promises its level for a new *entry* exchangeable with the calibration
entries; a new model family is not that (it is wrong as a whole: docs/predictors.md has a
family a factor 6 off on every entry), and on Gavel's families the pooled 90% quantile covered
82-91% of each calibration family in turn. So the quantile's level is itself calibrated on the
calibration families (:func:`adjusted_level`): each family in turn is covered by the interval
the others calibrate, and the level asked of the pooled errors is raised until that nested
coverage reaches the level promised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: the risk levels calibrated (an ``r`` between two is interpolated)
LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
#: isolated / co-located entries, of a job with nothing measured / at least one entry measured
CASES = ("isolated", "isolated_1obs", "colocated", "colocated_1obs")
#: the quantile levels :func:`adjusted_level` tries above the one promised (steps of 0.01)
LEVEL_STEP = 0.01


class NoIntervalsError(ValueError):
    """A risk level was asked of a predictor whose refiner carries no calibrated intervals."""


@dataclass(frozen=True)
class Intervals:
    levels: tuple[float, ...]
    halfwidths: Mapping[str, tuple[float, ...]]  # case -> log half-width per level
    calibration: str = ""
    #: case -> the quantile level of the calibration errors each level's half-width is (above the
    #: level where the nested coverage asked for it; 1: the largest error); empty: not adjusted
    quantile_levels: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        levels = [float(x) for x in self.levels]
        if not levels or not all(0.0 < x < 1.0 for x in levels) or any(b <= a for a, b in zip(levels, levels[1:])):
            raise ValueError(f"intervals need increasing risk levels between 0 and 1; got {list(self.levels)!r}")
        for case in CASES:
            widths = self.halfwidths.get(case)
            if widths is None or len(widths) != len(self.levels):
                raise ValueError(f"intervals need a half-width per level for {case!r}; got {widths!r}")
            if not all(math.isfinite(float(w)) and float(w) >= 0 for w in widths):
                raise ValueError(f"intervals' half-widths must be finite numbers >= 0 (log factors); {case!r} has "
                                 f"{list(widths)!r}")
        for case, qs in self.quantile_levels.items():
            if case not in CASES or len(qs) != len(self.levels):
                raise ValueError(f"intervals' quantile levels need one per level for a case of {CASES}; "
                                 f"got {case!r}: {qs!r}")

    def halfwidth(self, case: str, risk: float) -> float:
        """The log half-width at ``risk`` for ``case`` (linear between calibrated levels)."""
        if case not in CASES:
            raise ValueError(f"unknown interval case {case!r}; expected one of {CASES}")
        lo, hi = self.levels[0], self.levels[-1]
        if not lo <= risk <= hi:
            raise ValueError(f"risk level {risk!r} is outside the calibrated {lo:g}-{hi:g}")
        widths = np.asarray(self.halfwidths[case], dtype=float)
        return float(np.interp(risk, self.levels, widths))

    def to_dict(self) -> dict:
        return {"levels": list(self.levels), "halfwidths": {k: list(v) for k, v in self.halfwidths.items()},
                "calibration": self.calibration,
                "quantile_levels": {k: list(v) for k, v in self.quantile_levels.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Intervals:
        return cls(tuple(float(x) for x in d["levels"]),
                   {k: tuple(float(x) for x in v) for k, v in d["halfwidths"].items()},
                   str(d.get("calibration", "")),
                   {k: tuple(float(x) for x in v) for k, v in d.get("quantile_levels", {}).items()})


#: per calibration family: (the other families' errors, each as it would be calibrated without
#: this family, and this family's own errors)
Fold = tuple[Sequence[np.ndarray], np.ndarray]


def leave_one_out_folds(parts: Sequence[np.ndarray]) -> list[Fold]:
    """Folds of a method with no choice to make: each family against the others' errors as they are."""
    return [([p for j, p in enumerate(parts) if j != k], np.asarray(parts[k], dtype=float))
            for k in range(len(parts))]


def _pooled(parts: Sequence[np.ndarray]) -> np.ndarray:
    kept = [np.asarray(p, dtype=float).ravel() for p in parts]
    return np.concatenate(kept) if kept else np.empty(0)


def capped_halfwidth(errs: np.ndarray, quantile: float, conformal: Callable[[np.ndarray, float], float]) -> float:
    """``conformal(errs, quantile)``, a quantile beyond the errors (infinite) kept at their
    largest finite one: a plan needs a number, and the evaluation scores what is stored."""
    half = conformal(errs, quantile)
    finite = errs[np.isfinite(errs)]
    return float(finite.max()) if math.isinf(half) and finite.size else half


def nested_coverage(folds: Sequence[Fold], quantile: float,
                    conformal: Callable[[np.ndarray, float], float]) -> float:
    """Share of every calibration family's entries inside the interval the other families'
    pooled errors give at ``quantile`` (entries pooled, as the evaluation reports coverage; a
    miss is never inside); NaN when no fold has both. A quantile beyond the errors is their
    largest finite one, as :func:`from_errors` stores it."""
    n_in = n = 0
    for others, own in folds:
        own = np.asarray(own, dtype=float).ravel()
        half = capped_halfwidth(_pooled(others), quantile, conformal)
        if not own.size or math.isnan(half):
            continue
        n_in += int(np.sum(np.isfinite(own) & (own <= half)))
        n += own.size
    return n_in / n if n else math.nan


def adjusted_level(folds: Sequence[Fold], level: float,
                   conformal: Callable[[np.ndarray, float], float]) -> tuple[float, float]:
    """The quantile level to ask of the pooled errors so that the interval covers ``level`` of a
    new family's entries: the smallest of ``level``, ``level + 0.01``, ... up to 0.99 whose nested
    coverage (:func:`nested_coverage`) reaches ``level``, or 1 (the largest error) if none does;
    ``level`` itself when the folds cannot tell (fewer than two families). Returns (that quantile
    level, its nested coverage)."""
    steps = int(round((0.99 - level) / LEVEL_STEP))
    tried = [round(level + k * LEVEL_STEP, 4) for k in range(max(steps, 0) + 1)]
    cover = math.nan
    for q in tried:
        cover = nested_coverage(folds, q, conformal)
        if math.isnan(cover):
            return level, cover
        if cover >= level - 1e-12:
            return q, cover
    return 1.0, nested_coverage(folds, 1.0, conformal)


def from_errors(errors: Mapping[str, Sequence[np.ndarray]], calibration: str,
                conformal: Callable[[np.ndarray, float], float],
                folds: Mapping[str, Sequence[Fold]] | None = None) -> Intervals:
    """Half-widths from each case's calibration errors (one array per family), each level's at
    the quantile level its case's ``folds`` ask for (:func:`adjusted_level`; the level itself
    without folds). A miss (an infinite error: "does not fit" on a measured entry) stays among
    the errors, as the nested coverage and the evaluation count it, so the stored half-width is
    the one evaluated; an infinite half-width (the quantile falls on a miss, or beyond the
    errors) is the largest finite error (:func:`capped_halfwidth`). NaN (nothing to score) is
    left out."""
    widths, quantiles = {}, {}
    for case in CASES:
        errs = _pooled(errors[case])
        errs = errs[~np.isnan(errs)]
        if not np.isfinite(errs).any():
            raise ValueError(f"no calibration errors for {case!r}: the data has too few families or entries")
        qs = tuple(adjusted_level(folds[case], lv, conformal)[0] if folds else lv for lv in LEVELS)
        quantiles[case] = qs
        widths[case] = tuple(capped_halfwidth(errs, q, conformal) for q in qs)
    return Intervals(LEVELS, widths, calibration, quantiles if folds else {})


__all__ = ["CASES", "LEVELS", "Fold", "Intervals", "NoIntervalsError", "adjusted_level", "capped_halfwidth", "from_errors",
           "leave_one_out_folds", "nested_coverage"]

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

What is exchangeable here is less the entry than the family: a new model family is wrong as a
whole (docs/predictors.md: a family unlike the training ones is a factor 6 off on every entry),
and a quantile of every entry pooled lets the families with many job types speak for it. So
the half-width comes from one of two rules (:data:`RULES`), chosen per case on the
calibration families themselves (:func:`choose_rule`): each family in turn is covered by the
interval the others calibrate, and the rule whose coverage comes closest to the levels wins.
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
#: how calibration errors make a half-width: ``entries``, the split-conformal quantile of every
#: entry pooled (finite-sample corrected); ``families``, the quantile of the families' error
#: distributions averaged, each family weighing the same however many entries it has (no
#: finite-sample correction: counted in families, five or six of them, the correction would ask
#: a 90% interval for more than the largest error seen)
RULES = ("entries", "families")
#: the levels :func:`choose_rule` judges a rule's coverage at (those the evaluation reports)
RULE_LEVELS = (0.8, 0.9)


class NoIntervalsError(ValueError):
    """A risk level was asked of a predictor whose refiner carries no calibrated intervals."""


@dataclass(frozen=True)
class Intervals:
    levels: tuple[float, ...]
    halfwidths: Mapping[str, tuple[float, ...]]  # case -> log half-width per level
    calibration: str = ""
    #: case -> the rule (:data:`RULES`) its half-widths came from; empty: before rules were chosen
    rules: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for case in CASES:
            widths = self.halfwidths.get(case)
            if widths is None or len(widths) != len(self.levels):
                raise ValueError(f"intervals need a half-width per level for {case!r}; got {widths!r}")
        unknown = {c: r for c, r in self.rules.items() if r not in RULES or c not in CASES}
        if unknown:
            raise ValueError(f"interval rules must map cases {CASES} to one of {RULES}; got {unknown}")

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
                "calibration": self.calibration, "rules": dict(self.rules)}

    @classmethod
    def from_dict(cls, d: Mapping) -> Intervals:
        return cls(tuple(float(x) for x in d["levels"]),
                   {k: tuple(float(x) for x in v) for k, v in d["halfwidths"].items()},
                   str(d.get("calibration", "")), {str(k): str(v) for k, v in d.get("rules", {}).items()})


def family_weighted_quantile(parts: Sequence[np.ndarray], level: float) -> float:
    """The ``level`` quantile of the families' error distributions averaged: the smallest error
    ``e`` with ``mean over families of (share of the family's errors <= e) >= level``. Families
    with no errors take no part; NaN with none at all; infinite errors (misses) count, at the top."""
    kept = [np.asarray(p, dtype=float).ravel() for p in parts]
    kept = [p for p in kept if p.size]
    if not kept:
        return math.nan
    errs = np.concatenate(kept)
    weights = np.concatenate([np.full(p.size, 1.0 / (len(kept) * p.size)) for p in kept])
    order = np.argsort(errs, kind="stable")
    cum = np.cumsum(weights[order])
    k = int(np.searchsorted(cum, level - 1e-12))  # the first place the cumulated weight reaches level
    return float(errs[order][min(k, errs.size - 1)])


def rule_halfwidth(parts: Sequence[np.ndarray], level: float, rule: str,
                   conformal: Callable[[np.ndarray, float], float]) -> float:
    """The log half-width at ``level`` by ``rule`` from per-family calibration errors ``parts``
    (``conformal``: the split-conformal quantile of pooled errors, for ``entries``)."""
    if rule == "entries":
        kept = [np.asarray(p, dtype=float).ravel() for p in parts]
        return conformal(np.concatenate(kept) if kept else np.empty(0), level)
    if rule == "families":
        return family_weighted_quantile(parts, level)
    raise ValueError(f"unknown interval rule {rule!r}; expected one of {RULES}")


#: per calibration family: (the other families' errors, each as the family would be calibrated
#: without it, and this family's own errors)
Fold = tuple[Sequence[np.ndarray], np.ndarray]


def nested_coverage(folds: Sequence[Fold], level: float, rule: str,
                    conformal: Callable[[np.ndarray, float], float]) -> float:
    """Share of every calibration family's entries inside the interval the other families
    calibrate by ``rule`` (entries pooled, as the evaluation reports coverage; a miss is never
    inside); NaN when no fold has both."""
    n_in = n = 0
    for others, own in folds:
        own = np.asarray(own, dtype=float).ravel()
        half = rule_halfwidth(others, level, rule, conformal)
        if not own.size or math.isnan(half):
            continue
        n_in += int(np.sum(np.isfinite(own) & (own <= half)))
        n += own.size
    return n_in / n if n else math.nan


def choose_rule(folds: Sequence[Fold], conformal: Callable[[np.ndarray, float], float],
                levels: Sequence[float] = RULE_LEVELS) -> tuple[str, dict[str, dict[str, float]]]:
    """The rule (:data:`RULES`) whose nested coverage (:func:`nested_coverage`) is closest to
    ``levels`` (mean absolute gap; a tie, or no fold to judge by, goes to ``entries``), and each
    rule's nested coverage per level (keyed ``"80"``, ``"90"``)."""
    cover = {r: {f"{round(100 * lv)}": nested_coverage(folds, lv, r, conformal) for lv in levels} for r in RULES}

    def gap(rule: str) -> float:
        g = [abs(cover[rule][f"{round(100 * lv)}"] - lv) for lv in levels]
        return float(np.mean(g)) if all(math.isfinite(x) for x in g) else math.inf

    return min(RULES, key=lambda r: (gap(r), RULES.index(r))), cover


def leave_one_out_folds(parts: Sequence[np.ndarray]) -> list[Fold]:
    """Folds of a method with no choice to make: each family against the others' errors as they are."""
    return [([p for j, p in enumerate(parts) if j != k], np.asarray(parts[k], dtype=float))
            for k in range(len(parts))]


def from_errors(errors: Mapping[str, Sequence[np.ndarray]], calibration: str,
                conformal: Callable[[np.ndarray, float], float],
                rules: Mapping[str, str] | None = None) -> Intervals:
    """Half-widths from each case's calibration errors, one array per family, by the case's rule
    (``rules``; ``entries`` where not named). Non-finite errors are left out (a plan needs a
    number), and an infinite half-width, when too few errors for a level, is kept finite at the
    largest error seen."""
    widths = {}
    rules = {case: (rules or {}).get(case, "entries") for case in CASES}
    for case in CASES:
        parts = [np.asarray(e, dtype=float).ravel() for e in errors[case]]
        parts = [p[np.isfinite(p)] for p in parts]
        if not any(p.size for p in parts):
            raise ValueError(f"no calibration errors for {case!r}: the data has too few families or entries")
        top = float(max(p.max() for p in parts if p.size))
        widths[case] = tuple(min(rule_halfwidth(parts, lv, rules[case], conformal), top) for lv in LEVELS)
    return Intervals(LEVELS, widths, calibration, rules)


__all__ = ["CASES", "LEVELS", "RULES", "Intervals", "NoIntervalsError", "choose_rule", "family_weighted_quantile",
           "from_errors", "leave_one_out_folds", "nested_coverage", "rule_halfwidth"]

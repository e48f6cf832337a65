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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

#: the risk levels calibrated (an ``r`` between two is interpolated)
LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
#: isolated / co-located entries, of a job with nothing measured / at least one entry measured
CASES = ("isolated", "isolated_1obs", "colocated", "colocated_1obs")


class NoIntervalsError(ValueError):
    """A risk level was asked of a predictor whose refiner carries no calibrated intervals."""


@dataclass(frozen=True)
class Intervals:
    levels: tuple[float, ...]
    halfwidths: Mapping[str, tuple[float, ...]]  # case -> log half-width per level
    calibration: str = ""

    def __post_init__(self) -> None:
        for case in CASES:
            widths = self.halfwidths.get(case)
            if widths is None or len(widths) != len(self.levels):
                raise ValueError(f"intervals need a half-width per level for {case!r}; got {widths!r}")

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
                "calibration": self.calibration}

    @classmethod
    def from_dict(cls, d: Mapping) -> Intervals:
        return cls(tuple(float(x) for x in d["levels"]),
                   {k: tuple(float(x) for x in v) for k, v in d["halfwidths"].items()},
                   str(d.get("calibration", "")))


def from_errors(errors: Mapping[str, np.ndarray], calibration: str, conformal: Callable[[np.ndarray, float], float]
                ) -> Intervals:
    """Half-widths from each case's calibration errors (an infinite one, when too few errors for
    a level, is kept finite at the largest error seen: a plan needs a number)."""
    widths = {}
    for case in CASES:
        errs = np.asarray(errors[case], dtype=float)
        errs = errs[np.isfinite(errs)]
        if errs.size == 0:
            raise ValueError(f"no calibration errors for {case!r}: the data has too few families or entries")
        top = float(errs.max())
        widths[case] = tuple(min(conformal(errs, lv), top) for lv in LEVELS)  # inf (too few errors): the top
    return Intervals(LEVELS, widths, calibration)


__all__ = ["CASES", "LEVELS", "Intervals", "NoIntervalsError", "from_errors"]

"""How this fleet's boards differ from the world the predictors were trained in, per GPU type.

A shipped prior learned its GPU types from a benchmark or from the synthetic fleet; a site's
boards of the same type name can run slower or faster (PCIe rather than SXM boards, other
clocks, cooling, drivers, a slower host). The refiner corrects a job from that job's own
measurements, so it cannot carry such a difference to a job with nothing measured, nor to a
type where a measured job has not run yet. A per-type log offset, learned from every job this
fleet measured, can: it is the mean, over the fleet's isolated measurements on that type, of
how far each was from what the predictor said with nothing measured for its job, shrunk
toward 0 by :data:`SHRINK` measurements' worth of "no difference".

Applied to a job's predictions it is anchored on what was measured of that job: a job
measured on type a already carries a's offset in its measurement, so its prediction on type b
moves by ``offset(b) - offset(a)``; a job with nothing measured moves by ``offset(b)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

#: measurements' worth of "this type runs as predicted" that each offset is shrunk toward
SHRINK = 2.0


@dataclass(frozen=True)
class SiteOffsets:
    """GPU type -> log offset of this fleet's boards from the predictor's world."""

    log_offsets: Mapping[str, float] = field(default_factory=dict)
    measurements: Mapping[str, int] = field(default_factory=dict)
    shrink: float = SHRINK

    @classmethod
    def fit(cls, residuals: Iterable[tuple[str, float]], shrink: float = SHRINK) -> SiteOffsets:
        """From ``(gpu type, log(measured / predicted with nothing measured of the job))`` pairs."""
        if not shrink >= 0:
            raise ValueError(f"shrink must be >= 0, got {shrink!r}")
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for gpu, r in residuals:
            if math.isfinite(r):
                sums[gpu] = sums.get(gpu, 0.0) + r
                counts[gpu] = counts.get(gpu, 0) + 1
        return cls({g: sums[g] / (counts[g] + shrink) for g in sums}, counts, shrink)

    def __bool__(self) -> bool:
        return any(v != 0.0 for v in self.log_offsets.values())

    def factors(self, gpus: Iterable[str], anchored_on: Iterable[str] = ()) -> np.ndarray:
        """Multipliers for a job's predictions on ``gpus``, given the types it was measured on
        (each measurement once: a type measured twice weighs twice)."""
        off = np.array([self.log_offsets.get(g, 0.0) for g in gpus], dtype=float)
        seen = [self.log_offsets.get(g, 0.0) for g in anchored_on]
        return np.exp(off - (float(np.mean(seen)) if seen else 0.0))

    def to_dict(self) -> dict:
        return {"log_offsets": dict(self.log_offsets), "measurements": dict(self.measurements), "shrink": self.shrink}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> SiteOffsets:
        if not d:
            return cls()
        return cls({str(k): float(v) for k, v in d.get("log_offsets", {}).items()},
                   {str(k): int(v) for k, v in d.get("measurements", {}).items()}, float(d.get("shrink", SHRINK)))


__all__ = ["SHRINK", "SiteOffsets"]

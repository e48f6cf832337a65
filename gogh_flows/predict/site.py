"""How this fleet's boards differ from the world the predictors were trained in, per GPU type.

A shipped prior learned its GPU types from a benchmark or from the synthetic fleet; a site's
boards of the same type name can run slower or faster (PCIe rather than SXM boards, other
clocks, cooling, drivers, a slower host). The refiner corrects a job from that job's own
measurements, so it cannot carry such a difference to a job with nothing measured. A per-type
log offset learned from every job this fleet measured can: the mean, over the fleet's
isolated measurements on that type, of how far each was from what the predictor said with
nothing of its job measured, shrunk toward 0 by :data:`SHRINK` measurements' worth of "no
difference". The refiner's corrections play no part in that prediction (they need a
measurement of the job; its ensemble's prior does, as in a placement), so a refiner fitted on the
same runs does not flatter it. A job whose measured siblings (the
same model at other batch sizes) moved it carries the site's difference through them already:
the offsets leave it alone, and are learned from predictions made without siblings.

A job measured on some types carries their offsets in its measurements. Whether its other
types should then move by the difference (``offset(b) - mean offset of its measured types``:
``anchored``) depends on the refiner: one trained on the prior's world has not learned this
fleet's cross-type pattern and needs it, one trained on this fleet's runs has and would count
it twice. The retraining flow chooses on data the promotion does not see. A job's entries on
a type it was measured on are left alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("gogh_flows")

#: measurements' worth of "this type runs as predicted" that each offset is shrunk toward
SHRINK = 2.0
#: the largest log offset applied (a factor of 10 either way): a fleet's boards differ from the
#: prior's world by tens of percent; a larger offset, fitted or read back, is kept at it (said),
#: so a damaged or tampered record cannot send every job to the type it inflates by more
MAX_OFFSET = math.log(10.0)


@dataclass(frozen=True)
class SiteOffsets:
    """GPU type -> log offset of this fleet's boards from the predictor's world."""

    unmeasured: Mapping[str, float] = field(default_factory=dict)
    anchored: bool = False
    measurements: Mapping[str, int] = field(default_factory=dict)
    shrink: float = SHRINK

    def __post_init__(self) -> None:
        bad = {g: v for g, v in self.unmeasured.items() if not math.isfinite(float(v))}
        if bad:
            raise ValueError(f"site offsets must be finite log factors; got {bad}")
        beyond = {g: float(v) for g, v in self.unmeasured.items() if abs(float(v)) > MAX_OFFSET}
        if beyond:
            # kept at a factor of 10 (a refiner fitted before the cap may hold more): said, not refused,
            # so such a champion still loads
            log.warning("gogh: site offsets beyond a factor of 10 are kept at it: %s",
                        {g: round(v, 3) for g, v in beyond.items()})
            object.__setattr__(self, "unmeasured", {g: max(-MAX_OFFSET, min(MAX_OFFSET, float(v)))
                                                    for g, v in self.unmeasured.items()})
        if not (math.isfinite(float(self.shrink)) and self.shrink >= 0):
            raise ValueError(f"site offsets' shrink must be a finite number >= 0, got {self.shrink!r}")

    @classmethod
    def fit(cls, residuals: Iterable[tuple[str, float]], shrink: float = SHRINK) -> SiteOffsets:
        """From ``(gpu type, log(measured / predicted with nothing of the job measured))`` pairs."""
        if not shrink >= 0:
            raise ValueError(f"shrink must be >= 0, got {shrink!r}")
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for gpu, r in residuals:
            if math.isfinite(r):
                sums[gpu] = sums.get(gpu, 0.0) + r
                counts[gpu] = counts.get(gpu, 0) + 1
        # a fit beyond a factor of 10 is kept at it, said (MAX_OFFSET)
        return cls({g: sums[g] / (counts[g] + shrink) for g in sums}, False, counts, shrink)

    def __bool__(self) -> bool:
        return any(v != 0.0 for v in self.unmeasured.values())

    def factors(self, gpus: Iterable[str], measured_on: Iterable[str] = ()) -> np.ndarray:
        """Multipliers for a job's predictions on ``gpus``, given the types it was measured on
        (a type measured twice weighs twice in the anchor)."""
        gpus = list(gpus)
        off = np.array([self.unmeasured.get(g, 0.0) for g in gpus], dtype=float)
        seen = list(measured_on)
        if not seen:
            return np.exp(off)
        if not self.anchored:
            return np.ones(len(gpus))
        anchor = float(np.mean([self.unmeasured.get(g, 0.0) for g in seen]))
        return np.where(np.isin(gpus, seen), 1.0, np.exp(off - anchor))

    def to_dict(self) -> dict:
        return {"unmeasured": dict(self.unmeasured), "anchored": self.anchored,
                "measurements": dict(self.measurements), "shrink": self.shrink}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> SiteOffsets:
        if not d:
            return cls()
        return cls({str(k): float(v) for k, v in (d.get("unmeasured") or {}).items()}, bool(d.get("anchored", False)),
                   {str(k): int(v) for k, v in (d.get("measurements") or {}).items()}, float(d.get("shrink", SHRINK)))


__all__ = ["MAX_OFFSET", "SHRINK", "SiteOffsets"]

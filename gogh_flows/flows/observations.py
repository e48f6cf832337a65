"""Logged measurements as P2's observations: what refines the predictions of the next placement."""

from __future__ import annotations

import polars as pl

from gogh_flows.predict.service import observations_frame
from gogh_flows.tracking.measurements import MeasurementLog


class ObservationCache:
    """Logged measurements as P2 observations, re-read only when the table changed."""

    def __init__(self, log: MeasurementLog) -> None:
        self.log = log
        self._stamp: object = None
        self._frame = observations_from_measurements(pl.DataFrame())

    def get(self) -> pl.DataFrame:
        stamp = self.log.table.version()
        if stamp != self._stamp:
            self._frame = observations_from_measurements(self.log.read())
            self._stamp = stamp
        return self._frame


def observations_from_measurements(frame: pl.DataFrame) -> pl.DataFrame:
    """Measurements -> (job_type, gpu_type, partner, throughput): alone, or next to one partner.

    A run that saw two different partners over its life measured neither pair cleanly,
    so it is left out of the observations (it stays in the measurement table). So is a run
    measured over its whole life rather than its steady state (a body that reported too
    little): its throughput includes start-up, and learning it taught the refiner that a
    fresh worker's GPU is 2.5x slower than it is. On an emulated fleet only emulated time
    (``advance()``) is the emulated GPU's: a body there that only reported was timed by the
    CPU it ran on. Rows from before the window was recorded are kept only when emulated.
    A run slowed by its board's power limit is learned at full power (its throughput times
    the slowdown the emulator recorded), since predictions are of the maximum limit.
    """
    if frame.is_empty() or "throughput" not in frame.columns:
        return observations_frame()
    window = pl.col("window") if "window" in frame.columns else pl.lit(None, dtype=pl.String)
    emulated = pl.col("telemetry") == "emulated"
    # an emulated GPU's figure is its truth only in emulated time (advance()); a body that only
    # reported on an emulated fleet was timed by the CPU it ran on, not by the GPU it stood for
    steady = ((window == "steady") & ~emulated) | (window == "emulated") | (window.is_null() & emulated)
    rows = []
    for r in frame.filter((pl.col("throughput") > 0) & (pl.col("steps") > 0) & steady).iter_rows(named=True):
        partners = [p for p in (r.get("partners") or []) if p]
        if len(set(partners)) > 1:
            continue
        rows.append({"job_type": r["job_type"], "gpu_type": r["gpu_type"],
                     "partner": partners[0] if partners else None,
                     "throughput": float(r["throughput"]) * _limit_slowdown(r.get("extra"))})
    return observations_frame(rows)


def _limit_slowdown(extra: object) -> float:
    """How much a board limit slowed the run (the emulator records it): predictions are of full power."""
    if isinstance(extra, str):
        import json

        try:
            extra = json.loads(extra)
        except ValueError:
            return 1.0
    try:
        value = float((extra or {}).get("limit_slowdown") or 1.0)  # type: ignore[union-attr]
    except (TypeError, ValueError, AttributeError):
        return 1.0
    return value if value >= 1.0 else 1.0


__all__ = ["ObservationCache", "observations_from_measurements"]

"""Logged measurements as P2's observations: what refines the predictions of the next placement."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping

import polars as pl

from gogh_flows.placement.problem import LimitEvidence
from gogh_flows.predict.service import observations_frame
from gogh_flows.tracking.measurements import PARTNERS_CHANGED, MeasurementLog


class ObservationCache:
    """Logged measurements as P2 observations and limit evidence, re-read only when the table changed.

    ``emulated_by_type`` (the pool's :meth:`~gogh_flows.runtime.pool.GpuPool.emulated_by_type`)
    keeps a pool's placements to runs measured on boards of its own kind: a table (or a shared
    MLflow store) can hold a demo's or a test's runs on emulated GPUs beside runs on real ones,
    and an emulated run's rate is the emulator's truth. Taken as a real board's, it was an
    observation that outranks every prediction, averaged with the real runs of the type for good.
    """

    def __init__(self, log: MeasurementLog,
                 emulated_by_type: Callable[[], Mapping[str, bool | None]] | None = None) -> None:
        self.log = log
        self._kinds = emulated_by_type
        self._stamp: object = None
        self._frame = observations_from_measurements(pl.DataFrame())
        self._evidence: LimitEvidence = {}

    def _refresh(self) -> None:
        kinds = dict(self._kinds()) if self._kinds is not None else {}
        stamp = (self.log.table.version(), tuple(sorted(kinds.items())))
        if stamp != self._stamp:
            rows = of_board_kind(_steady_rows(self.log.read()), kinds)  # once for both: the table can be long
            self._frame = _observations(rows)
            self._evidence = _limit_evidence(rows)
            self._stamp = stamp

    def get(self) -> pl.DataFrame:
        self._refresh()
        return self._frame

    def limit_evidence(self) -> LimitEvidence:
        self._refresh()
        return self._evidence


def observations_from_measurements(frame: pl.DataFrame, *, keys: bool = False) -> pl.DataFrame:
    """Measurements -> (job_type, gpu_type, partner, throughput): alone, or next to one partner.

    ``keys``: add each observation's measurement ``key`` (run and GPU), for a reader that must
    know which runs it holds (the retraining, which never scores a champion on runs it learned).

    A run that saw two different partners over its life measured neither pair cleanly,
    so it is left out of the observations (it stays in the measurement table). So is a run
    whose company changed while it ran (``partners_changed``: placed alone and joined, or a
    partner that left before it ended): its rate mixes its alone and its pair figure, and
    learned as the pair's it made sharing look up to 45% faster than it is. So is a run
    measured over its whole life rather than its steady state (a body that reported too
    little): its throughput includes start-up, and learning it taught the refiner that a
    fresh worker's GPU is 2.5x slower than it is. On an emulated fleet only emulated time
    (``advance()``) is the emulated GPU's: a body there that only reported was timed by the
    CPU it ran on. Rows from before the window was recorded are kept only when emulated.
    A run slowed by its board's power limit is learned at full power (its throughput times
    the slowdown the emulator recorded), since predictions are of the maximum limit. A run
    that failed is learned from by what it did before it failed, when that was a steady
    window: its rate was the GPU's all the same (one that did no step, such as a run given up
    on a silent scheduler until its worker's record replaces it, has nothing to learn).
    """
    return _observations(_steady_rows(frame), keys=keys)


def _observations(steady: list[dict], *, keys: bool = False) -> pl.DataFrame:
    rows = []
    for r in steady:
        partners = [p for p in (r.get("partners") or []) if p]
        # two partners, or one for part of the run only: the rate is neither an alone nor a pair figure
        if len(set(partners)) > 1 or PARTNERS_CHANGED in r["extra"]:
            continue
        slowdown = _extra_float(r.get("extra"), "limit_slowdown") or 1.0
        rows.append({"job_type": r["job_type"], "gpu_type": r["gpu_type"],
                     "partner": partners[0] if partners else None,
                     "throughput": float(r["throughput"]) * max(slowdown, 1.0), "key": r.get("key")})
    obs = observations_frame(rows)
    return obs.with_columns(key=pl.Series([r["key"] for r in rows], dtype=pl.String)) if keys else obs


def limit_evidence_from_measurements(frame: pl.DataFrame) -> LimitEvidence:
    """Measurements -> what runs alone at a lowered limit showed: (job type, GPU type) -> ((limit W, steps/s[,
    board W]), ...).

    The placement's ``limit_evidence`` (``PlacementProblem.rate_bound``): a run short of its
    requirement under a limit gave the rate the worker's guard measured there before lifting
    it; a run that kept its limit, its measured rate at it. Only runs alone (a partner slows a
    run for its own reasons) and measured as the refiner's observations are (the steady window).
    Runs at one limit count by their median: the least of many noisy runs would drift ever lower.
    The board power they drew there (their median ``mean_power_w``, where measured) lets the
    placement weigh the limit by what it cost and try the level below it
    (``PlacementProblem.probe_limit``); a lifted run's draw at the limit it left is not known.
    """
    return _limit_evidence(_steady_rows(frame))


def _limit_evidence(steady: list[dict]) -> LimitEvidence:
    out: dict[tuple[str, str], dict[float, tuple[list[float], list[float]]]] = {}
    for r in steady:
        if any(p for p in (r.get("partners") or [])):
            continue
        extra = r.get("extra")
        lifted = _extra_float(extra, "limit_lifted_from_w")
        watts = None
        if lifted is not None:  # the board's draw at the limit it left was not measured apart
            point = (lifted, _extra_float(extra, "limit_lifted_rate"))
        else:
            point = (_extra_float(extra, "power_limit_w"), float(r["throughput"]))
            power = r.get("mean_power_w")
            watts = float(power) if isinstance(power, int | float) and math.isfinite(power) and power > 0 else None
        if point[0] is not None and point[1] is not None:
            rates, powers = out.setdefault((r["job_type"], r["gpu_type"]), {}).setdefault(round(point[0], 1), ([], []))
            rates.append(point[1])
            if watts is not None:
                powers.append(watts)
    # runs at one limit count by their median; the board power too, where runs measured it
    return {k: tuple((w, statistics.median(rates), *((statistics.median(powers),) if powers else ()))
                     for w, (rates, powers) in sorted(v.items())) for k, v in out.items()}


def of_board_kind(rows: list[dict], emulated_by_type: Mapping[str, bool | None]) -> list[dict]:
    """The rows measured on boards of the kind the pool has for their GPU type (emulated or
    real, ``emulated_by_type``; None: both, every row kept); for a type the pool lacks, of the
    pool's one kind when it has one (a refiner moves every type's prediction from any type's
    run), else every row."""
    if not emulated_by_type:
        return rows
    kinds = set(emulated_by_type.values())
    default = next(iter(kinds)) if len(kinds) == 1 else None
    out = []
    for r in rows:
        want = emulated_by_type.get(r["gpu_type"], default)
        if want is None or (r.get("telemetry") == "emulated") == want:
            out.append(r)
    return out


def _steady_rows(frame: pl.DataFrame) -> list[dict]:
    """Rows whose throughput is the run's steady rate on its GPU (see observations_from_measurements)."""
    if frame.is_empty() or "throughput" not in frame.columns:
        return []
    window = pl.col("window") if "window" in frame.columns else pl.lit(None, dtype=pl.String)
    emulated = pl.col("telemetry") == "emulated"
    # an emulated GPU's figure is its truth only in emulated time (advance()); a body that only
    # reported on an emulated fleet was timed by the CPU it ran on, not by the GPU it stood for
    steady = ((window == "steady") & ~emulated) | (window == "emulated") | (window.is_null() & emulated)
    rows = list(frame.filter((pl.col("throughput") > 0) & (pl.col("steps") > 0) & steady).iter_rows(named=True))
    for r in rows:  # the extras parsed once per row, for every reader of them
        r["extra"] = _parsed(r.get("extra"))
    return rows


def _parsed(extra: object) -> Mapping:
    """A row's ``extra`` (JSON text as stored, or a mapping) as a mapping; empty when unreadable."""
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return {}
    return extra if isinstance(extra, Mapping) else {}


def _extra_float(extra: Mapping, name: str) -> float | None:
    """A number the run's parsed ``extra`` recorded; None when absent or not a number > 0."""
    try:
        value = float(extra.get(name) or "nan")
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


__all__ = ["ObservationCache", "limit_evidence_from_measurements", "observations_from_measurements", "of_board_kind"]

"""Logged measurements as P2's observations: what refines the predictions of the next placement."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping

import polars as pl

from gogh_flows.placement.problem import LimitEvidence
from gogh_flows.predict.service import observations_frame
from gogh_flows.tracking.measurements import PARTNERS_CHANGED, MeasurementLog
from gogh_flows.tracking.table import DamagedTableFile

log = logging.getLogger("gogh_flows")


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
        self._lock = threading.Lock()
        self._frame = observations_from_measurements(pl.DataFrame())
        self._evidence: LimitEvidence = {}

    def _refresh(self) -> None:
        kinds = dict(self._kinds()) if self._kinds is not None else {}
        stamp = (self.log.table.version(), tuple(sorted(kinds.items())))
        if stamp == self._stamp:
            return
        with self._lock:  # placements started together parse a changed table once, not once each
            if stamp != self._stamp:
                try:
                    table = self.log.read()
                except DamagedTableFile as exc:
                    # placements go on with what was read before (nothing, in a new process), and
                    # say why, once; read again when the table changes (not at every decision)
                    log.warning("gogh: placing without the measurements read since: %s", exc)
                else:
                    rows = of_board_kind(_steady_rows(table), kinds)  # once for both: the table can be long
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


def _observations(steady: pl.DataFrame, *, keys: bool = False) -> pl.DataFrame:
    # two partners, or one for part of the run only: the rate is neither an alone nor a pair figure
    rows = steady.filter((pl.col("_partners").list.unique().list.len() <= 1) & pl.col("_partners_changed").is_null())
    rows = rows.with_columns(
        partner=pl.col("_partners").list.first(),
        throughput=pl.col("throughput").cast(pl.Float64)
        * pl.max_horizontal(pl.col("_limit_slowdown").fill_null(1.0), pl.lit(1.0)))
    obs = observations_frame(rows.select("job_type", "gpu_type", "partner", "throughput"))
    return obs.with_columns(key=rows.get_column("key").cast(pl.String)) if keys else obs


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


def _limit_evidence(steady: pl.DataFrame) -> LimitEvidence:
    alone = steady.filter(pl.col("_partners").list.len() == 0)
    lifted = pl.col("_limit_lifted_from_w").is_not_null()
    power = pl.col("mean_power_w").cast(pl.Float64) if "mean_power_w" in alone.columns else pl.lit(None, pl.Float64)
    points = alone.select(
        "job_type", "gpu_type",
        # the board's draw at the limit a lifted run left was not measured apart
        limit=pl.when(lifted).then(pl.col("_limit_lifted_from_w")).otherwise(pl.col("_power_limit_w")),
        rate=pl.when(lifted).then(pl.col("_limit_lifted_rate")).otherwise(pl.col("throughput").cast(pl.Float64)),
        watts=pl.when(~lifted & power.is_finite() & (power > 0)).then(power),
    ).drop_nulls(["limit", "rate"])
    # runs at one limit count by their median; the board power too, where runs measured it
    grouped = (points.with_columns(pl.col("limit").round(1))
               .group_by("job_type", "gpu_type", "limit")
               .agg(pl.col("rate").median(), pl.col("watts").median())
               .sort("job_type", "gpu_type", "limit"))
    out: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    for job_type, gpu_type, limit, rate, watts in grouped.iter_rows():
        out.setdefault((job_type, gpu_type), []).append((limit, rate) if watts is None else (limit, rate, watts))
    return {k: tuple(v) for k, v in out.items()}


def of_board_kind(rows: pl.DataFrame, emulated_by_type: Mapping[str, bool | None]) -> pl.DataFrame:
    """The rows measured on boards of the kind the pool has for their GPU type (emulated or
    real, ``emulated_by_type``; None: both, every row kept); for a type the pool lacks, of the
    pool's one kind when it has one (a refiner moves every type's prediction from any type's
    run), else every row."""
    if not emulated_by_type or rows.is_empty():
        return rows
    kinds = set(emulated_by_type.values())
    default = next(iter(kinds)) if len(kinds) == 1 else None
    want = pl.col("gpu_type").replace_strict(dict(emulated_by_type), default=default, return_dtype=pl.Boolean)
    return rows.filter(want.is_null() | ((pl.col("telemetry") == "emulated") == want))


#: the numbers a row's ``extra`` records that these readers use, as columns ``_<name>``
_EXTRA_NUMBERS = ("limit_slowdown", "limit_lifted_from_w", "limit_lifted_rate", "power_limit_w")
_EXTRA_READ = pl.Struct({name: pl.String for name in (*_EXTRA_NUMBERS, PARTNERS_CHANGED)})
#: what :func:`_read_extras` gives per distinct ``extra`` text (its columns of ``_steady_rows``)
_EXTRAS_SCHEMA = {"_extra_text": pl.String, "_partners_changed": pl.String,
                  **{f"_{name}": pl.Float64 for name in _EXTRA_NUMBERS}}


def _steady_rows(frame: pl.DataFrame) -> pl.DataFrame:
    """Rows whose throughput is the run's steady rate on its GPU (see observations_from_measurements),
    with what the readers need from ``extra`` as columns: the numbers of ``_EXTRA_NUMBERS`` (null
    when absent or not a number > 0), ``_partners_changed``, and ``_partners`` (the named partners,
    empty names dropped).

    In polars, each distinct ``extra`` parsed once: every placement reads the table again after
    each run, and reading it row by row in Python cost a second at 50,000 rows (a soak review,
    2026-12-07; ``benchmarks/observation_scaling.py``).
    """
    if frame.is_empty() or "throughput" not in frame.columns:
        return _EMPTY_STEADY
    window = pl.col("window") if "window" in frame.columns else pl.lit(None, dtype=pl.String)
    emulated = pl.col("telemetry") == "emulated"
    # an emulated GPU's figure is its truth only in emulated time (advance()); a body that only
    # reported on an emulated fleet was timed by the CPU it ran on, not by the GPU it stood for
    steady = ((window == "steady") & ~emulated) | (window == "emulated") | (window.is_null() & emulated)
    # NaN > 0 holds in polars: a row written by anything but MeasurementLog (which refuses them)
    # with a NaN rate failed every placement's observations
    finite = pl.col("throughput").is_finite() & pl.col("steps").is_finite()
    rows = frame.filter((pl.col("throughput") > 0) & (pl.col("steps") > 0) & steady & finite)
    partners = (pl.col("partners").cast(pl.List(pl.String)).list.eval(pl.element().filter(pl.element() != ""))
                if "partners" in rows.columns else pl.lit([], dtype=pl.List(pl.String)))
    rows = rows.with_columns(_extra_text=_extra_text(rows), _partners=partners.fill_null([]))
    if "key" not in rows.columns:
        rows = rows.with_columns(key=pl.lit(None, dtype=pl.String))
    extras = _read_extras(rows.get_column("_extra_text").drop_nulls().unique())
    return rows.join(extras, on="_extra_text", how="left")


def _read_extras(texts: pl.Series) -> pl.DataFrame:
    """The readers' columns for each distinct ``extra`` text (JSON), parsed once by polars; a
    text polars cannot parse is read as Python's ``json`` does (an unreadable one as empty)."""
    frame = pl.DataFrame({"_extra_text": texts})
    try:
        fields = frame.select(pl.col("_extra_text").str.json_decode(dtype=_EXTRA_READ).alias("_f")).unnest("_f")
    except pl.exceptions.PolarsError:
        fields = pl.DataFrame([_python_fields(t) for t in texts], schema=dict.fromkeys(_EXTRA_READ.to_schema(),
                                                                                          pl.String))
    return pl.concat([frame, fields], how="horizontal").select(
        "_extra_text", pl.col(PARTNERS_CHANGED).alias("_partners_changed"),
        *(_positive(pl.col(name)).alias(f"_{name}") for name in _EXTRA_NUMBERS)).cast(_EXTRAS_SCHEMA)


def _python_fields(text: str) -> dict[str, str | None]:
    try:
        extra = json.loads(text)
    except ValueError:
        extra = {}
    extra = extra if isinstance(extra, Mapping) else {}
    return {name: None if extra.get(name) is None else str(extra[name]) for name in _EXTRA_READ.to_schema()}


def _extra_text(rows: pl.DataFrame) -> pl.Expr:
    """``extra`` as JSON text: the table stores text; a frame built from dicts holds a struct."""
    if "extra" not in rows.columns:
        return pl.lit(None, dtype=pl.String)
    dtype = rows.schema["extra"]
    if dtype == pl.String:
        return pl.col("extra")
    if isinstance(dtype, pl.Struct):
        return pl.col("extra").struct.json_encode()
    return pl.col("extra").map_elements(lambda e: json.dumps(dict(e)) if isinstance(e, Mapping) else None,
                                        return_dtype=pl.String)


def _positive(text: pl.Expr) -> pl.Expr:
    """A recorded number as a float; null when absent, unreadable, or not finite and > 0."""
    value = text.cast(pl.Float64, strict=False)
    return pl.when(value.is_finite() & (value > 0)).then(value)


_EMPTY_STEADY = pl.DataFrame(schema={
    "job_type": pl.String, "gpu_type": pl.String, "throughput": pl.Float64, "telemetry": pl.String,
    "mean_power_w": pl.Float64, "key": pl.String, "_partners": pl.List(pl.String), **_EXTRAS_SCHEMA})


__all__ = ["ObservationCache", "limit_evidence_from_measurements", "observations_from_measurements", "of_board_kind"]

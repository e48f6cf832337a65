"""Power limits: a job's time and power at any GPU power limit, from one run at the maximum.

Why: lowering a GPU's power limit (NVML, ``nvidia-smi -pl``) trades a little speed for a
lot less energy on many training jobs; Zeus (NSDI'23) measured 11-16% less energy per epoch
on average at the least-energy limit that keeps 90% of full speed. The best limit differs
per GPU and per job, so no fixed fraction of the range carries over between GPUs. This
module predicts, from one measurement of the job at the GPU's maximum (full-power) limit and
the catalog's figures, the job's time and power at every limit, and picks the limit of
least predicted energy that keeps a required share of full-speed throughput
(:func:`choose_limit`). See docs/energy.md, "Power limits".

Physics (form ``"dvfs"``, the default). The power-management unit holds the board's mean
power at or below the limit by lowering the SM clock ``f`` (and with it the voltage):

* the board draws ``P0`` at full power. Part of that does not scale with the SM clock:
  idle (catalog ``idle_w``) plus a share ``s`` of the job's draw above idle (memory, fans,
  leakage): ``P_s = idle + s * (P0 - idle)``. The rest scales as ``x ** gamma`` with the
  relative clock ``x = f / f0`` (``gamma`` is 3 where voltage follows the clock, towards 1
  where voltage sits at its floor);
* a limit ``L`` binds when ``eta * L < P0``: the controller keeps the mean a little under
  the limit (``eta`` <= 1, the power-tracking efficiency). Then
  ``x = ((eta * L - P_s) / (P0 - P_s)) ** (1 / gamma)``, floored at ``x_min``, and the board
  draws ``max(eta * L, P_s + (P0 - P_s) * x_min ** gamma)`` (a board cannot clock below
  its floor, so at the lowest limits it may draw more than the limit, as Zeus's A40 does);
* only the clock-bound part ``beta`` of a step slows down:
  ``t(L) = t0 * (beta / x + 1 - beta)``.

Parameters ``eta, s, gamma, beta`` (``x_min`` is fixed at 0.15, about the lowest
sustained SM clock over the boost clock of these boards) are fitted on the measured curves
of GPUs other than the one predicted. A second, empirical form (``"powerlaw"``,
``t = t0 * (1 + k * max(0, P0 - eta * L) / P0) ** alpha``, ``P = min(P0, eta * L)``) is a
candidate too. Both are fitted by least squares on log time and log power ratios, an
underpredicted time weighted by ``w`` in (1, 4, 16) (a violated requirement costs more than a
smaller saving); the form and ``w`` a prediction uses are chosen by leave-one-GPU-out among
the training GPUs only (:func:`fit_power_limit_model`).

``gogh power evaluate --data DIR --test-gpu NAME`` scores it on Zeus's traces
(``summary_power_<gpu>.csv``) with NAME held out. A trace whose maximum limit differs from
the catalog's TDP (Zeus's V100 and P100 are 250 W PCIe boards; the catalog describes the
300 W SXM2 parts) uses the trace's own limits: its maximum is "full power" and its range is
the trace's lowest to highest limit.

Imports numpy, polars, the standard library and :mod:`gogh_flows.catalog` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gogh_flows import catalog
from gogh_flows.catalog import GpuType

__all__ = [
    "DEFAULT_MODEL_FILE", "FORMS", "REQUIREMENTS", "UNDER_WEIGHTS", "LimitMeasurement", "PowerLimitModel", "TraceSet", "add_parser",
    "choose_limit", "cmd_power_evaluate", "cmd_power_fit", "default_limit_model", "evaluate_held_out",
    "SAME_LIMIT_W", "evidence_bound", "informed_rate", "measured_watts", "probe_limit",
    "fit_all", "fit_power_limit_model",
    "read_traces",
]

REQUIREMENTS = (0.8, 0.9, 0.95)
#: runs of each configuration ``gogh power evaluate`` scores: the first from one full-power
#: measurement (the issue's protocol), the later ones also from the runs before (evidence_bound,
#: probe_limit), as a flow on a schedule runs again and again
EVIDENCE_RUNS = 6
#: two limits closer than this are the same level (the measurement table keeps 0.1 W)
SAME_LIMIT_W = 0.06
KEYS = ("dataset", "network", "batch_size", "optimizer")
COLUMNS = (*KEYS, "power_limit", "time_per_epoch", "average_power")
TRACE_FILE = re.compile(r"^summary_power_(?P<gpu>[A-Za-z0-9_-]+)\.csv$")
X_MIN = 0.15
#: candidate weights of an underpredicted time in the fit's loss (chosen by leave-one-GPU-out)
UNDER_WEIGHTS = (1.0, 4.0, 16.0)

# name -> (parameter names, start values, bounds). Bounds keep the physics meaningful:
# eta a tracking efficiency, s a share, gamma between linear and cubic-plus, beta a share.
FORMS: Mapping[str, tuple[tuple[str, ...], tuple[float, ...], tuple[tuple[float, float], ...]]] = {
    "dvfs": (("eta", "s", "gamma", "beta"), (0.95, 0.3, 2.0, 0.8),
             ((0.7, 1.0), (0.0, 0.95), (0.5, 4.0), (0.0, 1.0))),
    "powerlaw": (("eta", "k", "alpha"), (0.95, 1.0, 1.5),
                 ((0.7, 1.0), (0.01, 20.0), (0.2, 5.0))),
}


# -- the model ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LimitMeasurement:
    """A job measured at full power: time per step (or epoch) and mean board power.

    ``limit_w`` is the limit it ran at (the board's full-power limit); None means the
    catalog's maximum for the GPU type.
    """

    time_s: float
    power_w: float
    limit_w: float | None = None

    def __post_init__(self) -> None:
        for name in ("time_s", "power_w") + (("limit_w",) if self.limit_w is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"LimitMeasurement.{name} must be a finite number > 0, got {v!r}")


def limit_range(gpu: GpuType, measurement: LimitMeasurement | None = None) -> tuple[float, float]:
    """(min, full-power) limit: the catalog's range, its top replaced by the measurement's limit."""
    if gpu.power_limit_range_w is None:
        raise ValueError(f"GPU type {gpu.name!r} has no power_limit_range_w in the catalog; register it with one")
    lo, hi = gpu.power_limit_range_w
    if measurement is not None and measurement.limit_w is not None:
        hi = float(measurement.limit_w)
        if hi <= lo:
            raise ValueError(f"the measurement's limit {hi:g} W is not above {gpu.name}'s minimum limit {lo:g} W")
    return lo, hi


def _predict_arrays(form: str, params: Mapping[str, float], t0: np.ndarray, p0: np.ndarray,
                    idle: np.ndarray, limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised (time, power) at ``limit`` for jobs measured at (t0, p0) on boards idling at ``idle``."""
    budget = params["eta"] * limit
    if form == "powerlaw":
        short = np.maximum(0.0, p0 - budget) / p0
        return t0 * (1.0 + params["k"] * short) ** params["alpha"], np.minimum(p0, budget)
    if form != "dvfs":
        raise ValueError(f"unknown power-limit model form {form!r}; known: {', '.join(FORMS)}")
    idle = np.minimum(idle, 0.95 * p0)  # a job drawing about idle: nothing left to scale
    ps = idle + params["s"] * (p0 - idle)
    dyn = np.maximum(p0 - ps, 1e-9)
    frac = np.clip((budget - ps) / dyn, X_MIN ** params["gamma"], 1.0)
    x = np.where(budget >= p0, 1.0, frac ** (1.0 / params["gamma"]))
    floor = ps + dyn * X_MIN ** params["gamma"]
    power = np.where(budget >= p0, p0, np.maximum(budget, floor))
    time = t0 * (params["beta"] / x + 1.0 - params["beta"])
    return time, np.minimum(power, p0)


@dataclass(frozen=True)
class PowerLimitModel:
    """A fitted form and its parameters; :meth:`predict` gives time and power at limits."""

    form: str = "dvfs"
    params: Mapping[str, float] = field(default_factory=lambda: dict(zip(FORMS["dvfs"][0], FORMS["dvfs"][1])))
    trained_on: tuple[str, ...] = ()
    selection: Mapping[str, float] = field(default_factory=dict)  # candidate -> inner leave-one-GPU-out score
    under_weight: float = 1.0  # the fit's weight on underpredicted time (recorded, not used to predict)

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"unknown power-limit model form {self.form!r}; known: {', '.join(FORMS)}")
        missing = [n for n in FORMS[self.form][0] if n not in self.params]
        if missing:
            raise ValueError(f"form {self.form!r} needs parameter(s) {', '.join(missing)}")

    def predict(self, measurement: LimitMeasurement, gpu: GpuType,
                limits: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (time per step, mean power W) at each limit, for the job measured at full power."""
        lim = np.asarray(limits, dtype=float)
        n = lim.shape
        return _predict_arrays(self.form, self.params, np.full(n, measurement.time_s),
                               np.full(n, measurement.power_w), np.full(n, gpu.idle_w), lim)

    def responses(self, p0_w: np.ndarray, idle_w: np.ndarray, limit_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`response` over arrays (broadcast together): for bounds over many boards and
        limits at once (``sim.bound``), where one call per element would dominate."""
        p0, idle, limit = np.broadcast_arrays(np.asarray(p0_w, float), np.asarray(idle_w, float),
                                              np.asarray(limit_w, float))
        return _predict_arrays(self.form, self.params, np.ones(p0.shape), p0, idle, limit)

    def response(self, p0_w: float, idle_w: float, limit_w: float) -> tuple[float, float]:
        """(slowdown ``t(L) / t0``, board power W at ``L``) for a board drawing ``p0_w`` at full power.

        The scalar twin of :meth:`predict`, for the optimiser's hot path (one call per option
        and level; numpy's per-call overhead would dominate).
        """
        q = self.params
        budget = q["eta"] * limit_w
        if budget >= p0_w:
            return 1.0, p0_w
        if self.form == "powerlaw":
            return (1.0 + q["k"] * (p0_w - budget) / p0_w) ** q["alpha"], budget
        idle = min(idle_w, 0.95 * p0_w)
        ps = idle + q["s"] * (p0_w - idle)
        dyn = max(p0_w - ps, 1e-9)
        gamma = q["gamma"]
        frac = min(max((budget - ps) / dyn, X_MIN ** gamma), 1.0)
        x = frac ** (1.0 / gamma)
        power = min(max(budget, ps + dyn * X_MIN ** gamma), p0_w)
        return q["beta"] / x + 1.0 - q["beta"], power

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PowerLimitModel:
        try:
            return cls(form=data["form"], params={k: float(v) for k, v in data["params"].items()},
                       trained_on=tuple(data.get("trained_on", ())), selection=dict(data.get("selection", {})),
                       under_weight=float(data.get("under_weight", 1.0)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a power-limit model (need 'form' and 'params'): {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {"form": self.form, "params": {k: round(float(v), 4) for k, v in self.params.items()},
                "under_weight": self.under_weight,
                "trained_on": list(self.trained_on),
                "selection": {k: round(float(v), 4) for k, v in self.selection.items()}}


def _choose(t_pred: np.ndarray, e_pred: np.ndarray, t0: float, r: float) -> int:
    """Index of least predicted energy among limits with t0 / t >= r; ties go to the faster limit."""
    ok = t0 / t_pred >= r - 1e-12
    if not ok.any():
        return int(np.argmin(t_pred))
    cand = np.flatnonzero(ok)
    best = e_pred[cand].min()
    near = cand[e_pred[cand] <= best * (1 + 1e-12)]
    return int(near[np.argmin(t_pred[near])])


def choose_limit(model: PowerLimitModel, measurement: LimitMeasurement, gpu: GpuType | str,
                 requirement_r: float, levels: Sequence[float] | None = None) -> float:
    """The limit of least predicted energy whose predicted throughput is >= r of full speed.

    Full speed is the measurement's (taken at the full-power limit). ``levels`` are the limits
    to choose from (default: 5% steps of the range); each must lie in the GPU's range, whose
    top is the measurement's ``limit_w`` when given. The full-power limit is always a
    candidate, so a choice always exists.
    """
    gpu = catalog.get_gpu_type(gpu) if isinstance(gpu, str) else gpu
    if not 0 < requirement_r <= 1:
        raise ValueError(f"requirement_r must be a share of full-speed throughput in (0, 1], got {requirement_r!r}")
    lo, hi = limit_range(gpu, measurement)
    if levels is None:
        grid = np.linspace(lo, hi, 21)
    else:
        grid = np.asarray(sorted({float(v) for v in levels}), dtype=float)
        outside = [v for v in grid if v < lo - 1e-9 or v > hi + 1e-9]
        if outside:
            raise ValueError(f"limit(s) {', '.join(f'{v:g}' for v in outside)} W outside {gpu.name}'s range "
                             f"{lo:g}-{hi:g} W")
        if grid.size == 0 or grid[-1] < hi - 1e-9:
            grid = np.append(grid, hi)
    t, p = model.predict(measurement, gpu, grid)
    return float(grid[_choose(t, t * p, measurement.time_s, requirement_r)])


def evidence_bound(points: Sequence[tuple[float, float]], limit_w: float) -> float:
    """The most a job can run at under ``limit_w`` by its runs measured at ``points`` ((limit W,
    rate), ...): a board's throughput does not rise as its limit falls, so the least rate
    measured at this limit or above (inf: none measured there). What the placement learns from
    runs at limits (``PlacementProblem.rate_bound``), and what ``gogh power evaluate`` scores
    over repeated runs."""
    return min((p[1] for p in points if p[0] >= limit_w - SAME_LIMIT_W), default=math.inf)


def _measured_at(points: Sequence[tuple[float, ...]], limit_w: float) -> bool:
    return any(abs(p[0] - limit_w) <= SAME_LIMIT_W for p in points)


def measured_watts(points: Sequence[tuple[float, ...]], limit_w: float) -> float | None:
    """The board power runs measured at ``limit_w`` (a point's optional third figure), if any."""
    watts = [p[2] for p in points if len(p) > 2 and abs(p[0] - limit_w) <= SAME_LIMIT_W]
    return float(np.median(watts)) if watts else None


def probe_limit(levels: Sequence[float], points: Sequence[tuple[float, ...]], required: float,
                board_w: Callable[[float], float], full_limit_w: float, full_rate: float,
                unpaid_w: float = 0.0) -> float | None:
    """The one lowered limit worth trying next for a job type whose runs measured ``points``.

    One full-power measurement cannot tell jobs that draw alike but slow down differently under
    a limit apart (docs/energy.md: even tuned with hindsight it leaves over 3% regret in 6 of 9 cases), so the
    model's first choice is often a level or two above the job's best. What its runs measured
    can: of the limits measured to meet ``required`` (and the full limit, at ``full_rate``), the
    one of least energy per step (board power / rate; the power the run measured, a point's
    optional third figure, else the model's ``board_w(L)``, less ``unpaid_w``: idle power an
    always-on account treats as paid anyway) is the best known; the level just below
    it (among ``levels``, W), not yet measured, is worth one run. If that run falls short, its
    measurement rules the level out (the worker's guard lifts the limit mid-run); if it costs
    more energy per step, the level above stays the best and nothing lower is tried. None:
    nothing measured, or nothing below the best left to try.
    """
    if not points:
        return None
    known = [((board_w(full_limit_w) - unpaid_w) / full_rate, full_limit_w)] if full_rate >= required > 0 else []
    for w in sorted({p[0] for p in points}):
        rate = evidence_bound(points, w)
        if rate >= required and rate > 0 and w < full_limit_w - SAME_LIMIT_W:
            watts = measured_watts(points, w)
            known.append((((board_w(w) if watts is None else watts) - unpaid_w) / rate, w))
    if not known:
        return None
    best_w = min(known)[1]
    if best_w >= full_limit_w - SAME_LIMIT_W:
        return None  # no lowered limit measured better than none: the model chooses among them
    below = [w for w in levels if w < best_w - SAME_LIMIT_W]
    if not below:
        return None
    probe = max(below)
    if _measured_at(points, probe) or evidence_bound(points, probe) < required:
        return None
    return probe


def informed_rate(points: Sequence[tuple[float, ...]], limit_w: float, model_rate: float,
                  probe_w: float | None = None) -> float:
    """A job's rate at ``limit_w`` from the model and from what its runs measured at ``points``.

    Where a run measured this limit, the measurement (bounded by those at higher limits), not
    the model; at the probe (:func:`probe_limit`), the least rate measured above it: the hope that
    the job slows no further, which one run then checks; elsewhere the model's rate bounded by
    :func:`evidence_bound`.
    """
    bound = evidence_bound(points, limit_w)
    if _measured_at(points, limit_w) or (probe_w is not None and abs(limit_w - probe_w) <= SAME_LIMIT_W):
        return bound
    return min(model_rate, bound)


# -- measured curves ------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSet:
    """One GPU's measured curves: rows per (configuration, limit), with the full-power figures."""

    gpu: GpuType  # the catalog entry, its range replaced by the trace's (lowest, highest) limit
    frame: pl.DataFrame  # KEYS, power_limit, time, power, t0, p0, config (int id)
    skipped: int = 0  # configurations without a measurement at the trace's highest limit

    @property
    def full_limit(self) -> float:
        return self.gpu.power_limit_range_w[1]  # type: ignore[index]


def _catalog_gpu(name: str) -> GpuType:
    try:
        return catalog.get_gpu_type(name)
    except catalog.UnknownGpuTypeError:
        raise ValueError(f"GPU {name!r} is not in the catalog (known types: "
                         f"{', '.join(g.name for g in catalog.gpu_types())}); add it with "
                         "gogh_flows.catalog.register_gpu_type") from None


def read_trace(path: Path, gpu_name: str) -> TraceSet:
    """One ``summary_power_<gpu>.csv``; errors name the file and what is missing."""
    try:
        gpu = _catalog_gpu(gpu_name)
    except ValueError as exc:  # the name came from a file in a folder: say which, and the way out
        raise ValueError(f"{path}: {exc}, with its allowed power-limit range. Every summary_power_<gpu>.csv in "
                         f"{path.parent} is read; to leave this one out, move it out of the folder") from None
    if not path.is_file():
        raise FileNotFoundError(f"power trace {path} not found (expected summary_power_{gpu_name}.csv)")
    try:
        df = pl.read_csv(path)
    except pl.exceptions.NoDataError:
        raise ValueError(f"{path} is empty; expected Zeus's columns {', '.join(COLUMNS)} and one row per run") from None
    except pl.exceptions.ComputeError as exc:
        raise ValueError(f"{path} could not be read as CSV ({str(exc).splitlines()[0]})") from None
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (need {', '.join(COLUMNS)})")
    try:
        df = df.select(COLUMNS).with_columns(
            pl.col("power_limit").cast(pl.Float64), time=pl.col("time_per_epoch").cast(pl.Float64),
            power=pl.col("average_power").cast(pl.Float64))
    except pl.exceptions.InvalidOperationError as exc:
        raise ValueError(f"{path}: power_limit, time_per_epoch and average_power must be numbers "
                         f"({str(exc).splitlines()[0]})") from None
    rows = df.height
    df = (df
          .drop("time_per_epoch", "average_power")
          .filter(pl.col("time").is_finite() & (pl.col("time") > 0) & pl.col("power").is_finite()
                  & (pl.col("power") > 0) & pl.col("power_limit").is_finite() & (pl.col("power_limit") > 0)))
    if df.height == 0:
        raise ValueError(f"{path}: no rows with positive time, power and limit")
    if df.height < rows:  # a row cut short (a truncated copy) reads as empty fields: say so, not silently
        warnings.warn(f"{path}: left out {rows - df.height} of {rows} rows without a finite, positive "
                      "power_limit, time_per_epoch and average_power (empty, infinite, NaN or non-positive "
                      "fields; a truncated or hand-edited file?)", stacklevel=2)
    lo, hi = float(df["power_limit"].min()), float(df["power_limit"].max())  # type: ignore[arg-type]
    if not lo < hi:
        raise ValueError(f"{path}: every row is at one power limit ({hi:g} W); need a curve")
    configs = df.select(KEYS).unique().height
    top = df.filter(pl.col("power_limit") == hi).group_by(KEYS).agg(t0=pl.col("time").mean(),
                                                                      p0=pl.col("power").mean())
    frame = (df.join(top, on=list(KEYS), how="inner")
             .group_by(*KEYS, "power_limit").agg(pl.col("time", "power", "t0", "p0").mean())
             .sort(*KEYS, "power_limit")
             .with_columns(config=pl.struct(KEYS).rank("dense").cast(pl.Int64) - 1))
    board = dataclasses.replace(gpu, power_limit_range_w=(lo, hi))
    return TraceSet(board, frame, skipped=configs - top.height)


def read_traces(data: str | Path) -> dict[str, TraceSet]:
    """Every ``summary_power_<gpu>.csv`` in ``data``, by GPU name."""
    root = Path(data)
    if root.is_file():
        raise ValueError(f"--data {str(root)!r} is a file; give the folder that holds it and the other "
                         f"summary_power_<gpu>.csv files ({root.parent})")
    if not root.is_dir():
        raise FileNotFoundError(f"power-trace folder {root} not found: give --data, the folder of Zeus's "
                                "summary_power_<gpu>.csv files (or set GOGH_DATA_DIR to the folder holding zeus/)")
    found = {m["gpu"].lower(): root / p.name for p in sorted(root.iterdir()) if (m := TRACE_FILE.match(p.name))}
    if not found:
        raise FileNotFoundError(f"no summary_power_<gpu>.csv file in {root}")
    return {g: read_trace(p, g) for g, p in found.items()}


# -- fitting --------------------------------------------------------------------------------
def _to_params(form: str, z: np.ndarray) -> dict[str, float]:
    names, _, bounds = FORMS[form]
    return {n: lo + (hi - lo) / (1.0 + math.exp(-float(v))) for n, v, (lo, hi) in zip(names, z, bounds)}


def _from_params(form: str, values: Sequence[float]) -> np.ndarray:
    _, _, bounds = FORMS[form]
    out = []
    for v, (lo, hi) in zip(values, bounds):
        u = min(max((v - lo) / (hi - lo), 1e-4), 1 - 1e-4)
        out.append(math.log(u / (1 - u)))
    return np.array(out)


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iters: int = 400, step: float = 0.8) -> np.ndarray:
    """Plain Nelder-Mead (deterministic); the parameters are few and the loss is cheap."""
    n = x0.size
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
        if max(values) - min(values) < 1e-10:
            break
    return simplex[int(np.argmin(values))]


def _stack(traces: Sequence[TraceSet]) -> dict[str, np.ndarray]:
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("t0", "p0", "idle", "limit", "time", "power", "w")}
    for tr in traces:
        f = tr.frame
        cols["t0"].append(f["t0"].to_numpy())
        cols["p0"].append(f["p0"].to_numpy())
        cols["idle"].append(np.full(f.height, tr.gpu.idle_w))
        cols["limit"].append(f["power_limit"].to_numpy())
        cols["time"].append(f["time"].to_numpy())
        cols["power"].append(f["power"].to_numpy())
        cols["w"].append(np.full(f.height, 1.0 / f.height))  # each GPU weighs the same
    return {k: np.concatenate(v) for k, v in cols.items()}


def _fit_form(form: str, traces: Sequence[TraceSet], under_weight: float = 1.0) -> dict[str, float]:
    """Least squares on log time and log power ratios, each training GPU weighted equally.

    ``under_weight`` multiplies the squared error of a time predicted *shorter* than measured
    (an underpredicted slowdown is a violated requirement; an overpredicted one only a
    smaller saving).
    """
    d = _stack(traces)
    lt, lp = np.log(d["time"] / d["t0"]), np.log(d["power"] / d["p0"])
    root = math.sqrt(under_weight)

    def loss(z: np.ndarray) -> float:
        t, p = _predict_arrays(form, _to_params(form, z), d["t0"], d["p0"], d["idle"], d["limit"])
        et = np.log(t / d["t0"]) - lt
        et = np.where(et < 0, root * et, et)
        return float(np.sum(d["w"] * (et ** 2 + (np.log(p / d["p0"]) - lp) ** 2)))

    start = FORMS[form][1]
    best = None
    # a few deterministic starts around the physical guesses: the loss has kinks (max/min)
    for shift in (0.0, 1.0, -1.0):
        z = _nelder_mead(loss, _from_params(form, start) + shift)
        z = _nelder_mead(loss, z, step=0.3)
        if best is None or loss(z) < loss(best):
            best = z
    return _to_params(form, best)  # type: ignore[arg-type]


def _decision_score(model: PowerLimitModel, trace: TraceSet) -> float:
    """Inner selection score: mean over the requirements of mean regret + violation rate."""
    res = _score_model(model, trace)
    return float(np.mean([v["violation_rate"] + v["regret_mean"] for v in res.values()]))


def fit_power_limit_model(traces: Sequence[TraceSet], forms: Sequence[str] = tuple(FORMS),
                          under_weights: Sequence[float] = UNDER_WEIGHTS) -> PowerLimitModel:
    """Fit each (form, under-weight) on ``traces``; pick one by leave-one-GPU-out among these
    traces only (score: mean over r of mean regret + violation rate on the inner held-out GPU).

    With one training GPU there is nothing to hold out: the first candidate (``dvfs``, 1) is used.
    """
    if not traces:
        raise ValueError("need at least one GPU's measured curves to fit on")
    names = tuple(t.gpu.name for t in traces)
    candidates = [(f, w) for f in forms for w in under_weights]
    scores: dict[str, float] = {}
    if len(traces) > 1 and len(candidates) > 1:
        for form, w in candidates:
            inner = []
            for i, held in enumerate(traces):
                rest = [t for j, t in enumerate(traces) if j != i]
                inner.append(_decision_score(PowerLimitModel(form, _fit_form(form, rest, w)), held))
            scores[f"{form}/w{w:g}"] = float(np.mean(inner))
        form, w = min(candidates, key=lambda c: (scores[f"{c[0]}/w{c[1]:g}"], candidates.index(c)))
    else:
        form, w = candidates[0]
    return PowerLimitModel(form, _fit_form(form, traces, w), trained_on=names, selection=scores, under_weight=w)


# -- scoring on measured curves -------------------------------------------------------------
def _configs(trace: TraceSet):
    for _, g in trace.frame.group_by("config", maintain_order=True):
        yield (g["power_limit"].to_numpy(), g["time"].to_numpy(), g["power"].to_numpy(),
               float(g["t0"][0]), float(g["p0"][0]))


def _summary(chosen_e: list[float], best_e: list[float], max_e: list[float], violated: list[bool]) -> dict[str, float]:
    ce, be, me = np.array(chosen_e), np.array(best_e), np.array(max_e)
    regret = ce / be - 1.0
    return {"violation_rate": float(np.mean(violated)), "regret_mean": float(regret.mean()),
            "regret_max": float(regret.max()), "saving_vs_max": float(np.mean(1.0 - ce / me))}


def _measured_best(lim: np.ndarray, t: np.ndarray, p: np.ndarray, t0: float, r: float) -> int:
    return _choose(t, t * p, t0, r)  # the same rule, on the measured figures


def _score_runs(model: PowerLimitModel, trace: TraceSet, requirements: Sequence[float] = REQUIREMENTS,
                runs: int = 1) -> dict[float, list[dict[str, float]]]:
    """Per requirement, the summary of each of ``runs`` runs of every configuration: the first
    chosen from its full-power measurement alone, each later one also from what the runs before
    it measured at their limits, by the rule placements use (:func:`informed_rate` at the
    :func:`probe_limit`; energy per step the board power measured at a limit, else the model's,
    over that rate)."""
    out = {}
    for r in requirements:
        per_run: list[tuple[list, list, list, list]] = [([], [], [], []) for _ in range(runs)]
        trials: list[list[bool]] = [[] for _ in range(runs)]  # per run: whether each configuration tried
        for lim, t, p, t0, p0 in _configs(trace):
            tp, pp = model.predict(LimitMeasurement(t0, p0, trace.full_limit), trace.gpu, lim)
            b = _measured_best(lim, t, p, t0, r)
            top = int(np.argmax(lim))
            power = dict(zip(lim.tolist(), pp.tolist()))
            seen: list[tuple[float, ...]] = []  # (limit W, rate, board W) of the runs at lowered limits
            for (chosen_e, best_e, max_e, violated), tried in zip(per_run, trials):
                probe = probe_limit([float(w) for w in lim if w < lim[top]], seen, r / t0,
                                    power.__getitem__, float(lim[top]), 1.0 / t0)
                rate = np.array([1.0 / t0 if i == top else informed_rate(seen, float(w), 1.0 / tp[i], probe)
                                 for i, w in enumerate(lim)])
                ok = t0 * rate >= r - 1e-12
                # none predicted to meet r (a model whose tracking loss slows even the maximum):
                # the fastest predicted, as from one measurement
                watts = np.array([w if (w := measured_watts(seen, float(x))) is not None else q
                                  for x, q in zip(lim, pp)])
                i = _choose(np.where(ok, 1.0 / rate, np.inf), watts / rate, t0, r) if ok.any() else int(np.argmin(tp))
                chosen_e.append(t[i] * p[i]); best_e.append(t[b] * p[b]); max_e.append(t[top] * p[top])
                violated.append(bool(t0 / t[i] < r - 1e-12))
                tried.append(probe is not None and abs(float(lim[i]) - probe) <= SAME_LIMIT_W)
                if i != top:
                    seen.append((float(lim[i]), 1.0 / t[i], float(p[i])))
        # the share of configurations whose run was a trial (probe_limit), and of those that fell short
        out[r] = [{**_summary(*x), "trial_rate": float(np.mean(tried)),
                   "trial_violation_rate": float(np.mean(np.array(tried) & np.array(x[3])))}
                  for x, tried in zip(per_run, trials)]
    return out


def _score_model(model: PowerLimitModel, trace: TraceSet,
                 requirements: Sequence[float] = REQUIREMENTS) -> dict[float, dict[str, float]]:
    return {r: by_run[0] for r, by_run in _score_runs(model, trace, requirements).items()}


def _fraction_of(trace: TraceSet, limit: float) -> float:
    lo, hi = trace.gpu.power_limit_range_w  # type: ignore[misc]
    return (limit - lo) / (hi - lo)


def median_optimal_fraction(traces: Sequence[TraceSet], r: float) -> float:
    """Median over every configuration of ``traces`` of its best measured feasible limit's
    fraction of its GPU's range (0 = lowest limit, 1 = full power)."""
    fractions = []
    for tr in traces:
        for lim, t, p, t0, _ in _configs(tr):
            fractions.append(_fraction_of(tr, float(lim[_measured_best(lim, t, p, t0, r)])))
    return float(np.median(fractions))


def _score_rule(trace: TraceSet, pick: Callable[[np.ndarray], int], r: float) -> dict[str, float]:
    ce, be, me, vio = [], [], [], []
    for lim, t, p, t0, _ in _configs(trace):
        i = pick(lim)
        b = _measured_best(lim, t, p, t0, r)
        top = int(np.argmax(lim))
        ce.append(t[i] * p[i]); be.append(t[b] * p[b]); me.append(t[top] * p[top])
        vio.append(bool(t0 / t[i] < r - 1e-12))
    return _summary(ce, be, me, vio)


def evaluate_held_out(traces: Mapping[str, TraceSet], test_gpu: str,
                      requirements: Sequence[float] = REQUIREMENTS) -> dict[str, Any]:
    """Fit on every GPU but ``test_gpu``; score the model and both baselines on ``test_gpu``."""
    test_gpu = test_gpu.strip().lower()
    _catalog_gpu(test_gpu)
    if test_gpu not in traces:
        raise FileNotFoundError(f"no summary_power_{test_gpu}.csv among the traces (found: {', '.join(sorted(traces))})")
    train = [traces[g] for g in sorted(traces) if g != test_gpu]
    if not train:
        raise ValueError(f"need the curves of at least one GPU other than {test_gpu} to fit on")
    test = traces[test_gpu]
    model = fit_power_limit_model(train)
    scored = _score_runs(model, test, requirements, EVIDENCE_RUNS)
    result: dict[str, Any] = {
        "test_gpu": test_gpu, "train_gpus": [t.gpu.name for t in train],
        "configurations": test.frame["config"].n_unique(), "skipped_configurations": test.skipped,
        "full_power_limit_w": test.full_limit, "catalog_tdp_w": catalog.get_gpu_type(test_gpu).tdp_w,
        "limit_range_w": list(test.gpu.power_limit_range_w),  # type: ignore[arg-type]
        "model": model.to_json(), "requirements": {},
    }
    for r in requirements:
        frac = median_optimal_fraction(train, r)
        lo, hi = test.gpu.power_limit_range_w  # type: ignore[misc]
        target = lo + frac * (hi - lo)

        def nearest(lim: np.ndarray, target: float = target) -> int:  # ties go to the higher limit
            return int(min(range(lim.size), key=lambda i: (abs(lim[i] - target), -lim[i])))

        result["requirements"][f"{r:g}"] = {
            "model": scored[r][0],
            "model_runs": scored[r],
            "max": _score_rule(test, lambda lim: int(np.argmax(lim)), r),
            "median_fraction": {**_score_rule(test, nearest, r), "fraction": frac},
        }
    return result


# -- the shipped model ----------------------------------------------------------------------
#: Fitted on every GPU of Zeus's traces by ``gogh power fit --data ../shared/data/zeus``; the
#: model placements plan limits with (docs/energy.md, "Power limits in the decision").
DEFAULT_MODEL_FILE = Path(__file__).with_name("power_limit_model.json")


@functools.cache
def default_limit_model() -> PowerLimitModel:
    """The shipped model (JSON, read once); regenerate it with ``gogh power fit``."""
    return PowerLimitModel.from_json(json.loads(DEFAULT_MODEL_FILE.read_text()))


def _log_error(model: PowerLimitModel, trace: TraceSet) -> float:
    """Root mean square of log(predicted / measured) over time and power on one GPU."""
    d = _stack([trace])
    t, p = _predict_arrays(model.form, model.params, d["t0"], d["p0"], d["idle"], d["limit"])
    return float(np.sqrt(np.mean(np.log(t / d["time"]) ** 2 + np.log(p / d["power"]) ** 2)))


#: the command that regenerates the packaged model (its provenance)
REGENERATE = "gogh power fit --data ../shared/data/zeus --out gogh_flows/power_limit_model.json"


def fit_all(traces: Mapping[str, TraceSet], command: str = REGENERATE) -> dict[str, Any]:
    """The model placements plan with: fitted on every GPU, as JSON.

    Unlike :func:`fit_power_limit_model`, which aims at one decision from one measurement and
    so leans towards predicting too much slowdown, this model describes the curves as they
    are (unweighted least squares): the simulator charges energy with it and the optimiser
    weighs limits against GPUs and partners with it; a margin for uncertainty belongs to the
    requirement, not to the physics. The form is the one of least leave-one-GPU-out log error.
    """
    names = sorted(traces)
    scores: dict[str, float] = {}
    for form in FORMS:
        if len(names) > 1:
            scores[form] = float(np.mean([
                _log_error(PowerLimitModel(form, _fit_form(form, [traces[g] for g in names if g != h])), traces[h])
                for h in names]))
    form = min(scores, key=scores.__getitem__) if scores else "dvfs"
    model = PowerLimitModel(form, _fit_form(form, [traces[g] for g in names]), trained_on=tuple(names),
                            selection={f"{f} (leave-one-GPU-out RMS log error)": v for f, v in scores.items()})
    return {**model.to_json(), "source": "Zeus NSDI'23 power traces (summary_power_<gpu>.csv)",
            "command": command,
            "configurations": {g: int(traces[g].frame["config"].n_unique()) for g in names}}


# -- the command ----------------------------------------------------------------------------
def print_evaluation(result: Mapping[str, Any], console: Any = None) -> None:
    from rich.table import Table

    from gogh_flows.progress import report_console

    m = result["model"]
    table = Table(title=f"Power limits on {result['test_gpu']} held out (fit on {', '.join(result['train_gpus'])}; "
                  f"{result['configurations']} configurations)")
    for col, just in (("r", "right"), ("policy", "left"), ("violations", "right"), ("regret mean", "right"),
                      ("regret max", "right"), ("saving vs max", "right"), ("trials (short)", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r, by in result["requirements"].items():
        rows = [("model", by["model"])]
        rows += [(f"model, run {n}", s) for n, s in enumerate(by.get("model_runs", [])[1:], start=2)]
        rows += [("max", by["max"]),
                 (f"median-fraction ({by['median_fraction']['fraction']:.2f})", by["median_fraction"])]
        for name, s in rows:
            table.add_row(r, name, f"{100 * s['violation_rate']:.1f}%", f"{100 * s['regret_mean']:.1f}%",
                          f"{100 * s['regret_max']:.1f}%", f"{100 * s['saving_vs_max']:.1f}%",
                          f"{100 * s['trial_rate']:.1f}% ({100 * s['trial_violation_rate']:.1f}%)"
                          if s.get("trial_rate") else "")
    console = console or report_console()
    console.print(table)
    params = ", ".join(f"{k} = {v:g}" for k, v in m["params"].items())
    sel = "; ".join(f"{k} {v:.4f}" for k, v in m["selection"].items()) or "one training GPU: dvfs"
    console.print(f"model: {m['form']} ({params}), fitted with under-weight {m['under_weight']:g}; chosen by "
                  f"leave-one-GPU-out on the training GPUs (mean regret + violation rate: {sel}). Full power: the trace's {result['full_power_limit_w']:g} W "
                  f"(catalog TDP {result['catalog_tdp_w']:g} W); range {result['limit_range_w'][0]:g}-"
                  f"{result['limit_range_w'][1]:g} W. 'model, run n': the n-th run of each configuration, chosen "
                  "as placements learn from runs at limits: a limit an earlier run measured counts as measured "
                  "(one measured below r rules out every limit at or below it), and the level just below the "
                  "best measured is tried; 'trials (short)': the configurations whose run was such a trial "
                  "(and fell short).", soft_wrap=True, highlight=False)


def zeus_data(data: str | None) -> Path:
    """``--data``, else Zeus's traces under ``$GOGH_DATA_DIR`` (``zeus/``), else ``../shared/data/zeus``
    from the working directory or beside the checkout, as the other measured data are found."""
    if data is not None:
        return Path(data)
    from gogh_flows.power_model import data_dir

    return data_dir() / "zeus"


def cmd_power_evaluate(args: argparse.Namespace) -> int:
    name = args.test_gpu.strip().lower()
    _catalog_gpu(name)  # an unknown GPU is named before any file is read
    result = evaluate_held_out(read_traces(zeus_data(args.data)), name)
    print_evaluation(result)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cmd_power_fit(args: argparse.Namespace) -> int:
    # the provenance is the command that was run, not the one that made the packaged file
    data = zeus_data(args.data)
    command = f"gogh power fit --data {data}" + (f" --out {args.out}" if args.out else "")
    fitted = fit_all(read_traces(data), command=command)
    text = json.dumps(fitted, indent=2) + "\n"
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text, end="")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("power", help="GPU power limits: model and evaluation on measured curves")
    psub = p.add_subparsers(dest="power", required=True)
    ev = psub.add_parser(
        "evaluate", help="fit the power-limit model on every GPU's curves but one, score it on that one",
        description="Reads every summary_power_<gpu>.csv in --data (Zeus's traces), fits the power-limit "
        "model on all GPUs but --test-gpu, and for each configuration of --test-gpu, given only its "
        "measurement at the maximum limit and the catalog's figures, chooses the limit of least predicted "
        "energy keeping r of full-speed throughput (r = 0.8, 0.9, 0.95); then scores five more runs of each "
        "configuration, each also using what the runs before it measured at their limits, as placements do. "
        "Reports violation rate, energy regret against the best measured feasible limit and saving against the "
        "maximum limit, for the model (first run and runs 2-6) and the 'max' and 'median-fraction' baselines.")
    data_help = ("folder with summary_power_<gpu>.csv files (default: zeus/ under $GOGH_DATA_DIR, else "
                 "../shared/data/zeus from here or beside the checkout)")
    ev.add_argument("--data", help=data_help)
    ev.add_argument("--test-gpu", required=True, help="the GPU held out, e.g. v100 (a catalog type)")
    ev.add_argument("--json", help="also write the figures to this file")
    ev.set_defaults(func=cmd_power_evaluate)
    fit = psub.add_parser(
        "fit", help="fit the power-limit model on every GPU's curves (the model placements plan limits with)",
        description="Reads every summary_power_<gpu>.csv in --data and fits the power-limit model on all of "
        "them by unweighted least squares (the form of least leave-one-GPU-out log error). Prints the JSON; --out also writes it "
        "(gogh_flows/power_limit_model.json is the shipped model).")
    fit.add_argument("--data", help=data_help)
    fit.add_argument("--out", help="write the model's JSON to this file")
    fit.set_defaults(func=cmd_power_fit, out_is_file=True)

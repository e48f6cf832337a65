"""A job's GPU power, fitted to boards that were measured (docs/energy.md, "Fitted power model").

Why: the spec-based activity, ``busy * (0.55 + 0.45 * compute_share)`` from the roofline,
was 38% off (median) and up to 2.5x off on a measured H100: the roofline says an H100 is
busy whenever a job has work, but in eager PyTorch a small kernel finishes before the host
has launched the next one, so the board idles between kernels and draws far less. The
energy the optimiser minimises is only as good as this number.

Form (three coefficients, fitted by least squares on ``logit(activity)``)::

    activity = clip(sigmoid(c0 + c1 * log10(kernel_s / launches) + c2 * log10(step_s)), 0.02, 1)

* ``kernel_s / launches``: the roofline's kernel time of one step over the kernels it
  launches (forward + backward per layer), i.e. how long the average kernel keeps the GPU
  busy *on this GPU type*. A GPU whose kernels end faster than the host launches them waits;
  a busy fraction ``K / (K + overhead)`` is a sigmoid of ``log K - log overhead``, hence the
  logit-linear form.
* ``step_s``: the predicted step time. Each step also pays fixed costs (host hand-off,
  optimiser, synchronisation) that a bigger step amortises.

Both come from the roofline (``truth.synthetic.step_profile``), so they exist for any zoo
model at any batch size and any user model with features. Compute share, FLOPs, bytes and
batch size were tried as well (leave-one-family-out) and did not help or made the worst
family worse.

Where it applies: the GPU types it was fitted on, at fp32 (the measured precision). Other
types keep the spec-based formula: applied to Zeus's V100 and P100 ResNet-50 traces the
H100 fit is no better than the spec formula (``python -m gogh_flows.power_model evaluate``),
so it is not assumed to transfer. The idle power stays the catalog's: the H100 board idled
at 70.7 W against the catalog's 70 W, which moves no prediction by more than 0.5%.

Data are read from where the user keeps them (``$GOGH_DATA_DIR``, default
``../shared/data``; ``<data>/<gpu type>/alone.csv``) and from the measurement table of
placed runs; the repository keeps only the fitted coefficients (``power_model.json``), with
the command that regenerates them. Imports no Prefect, Dask, MLflow or NVML.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gogh_flows import catalog
from gogh_flows.datapaths import default_data
from gogh_flows.workloads import WorkloadFeatures, parse_job_kind, zoo_features

log = logging.getLogger("gogh_flows")

FORMAT = "gogh-power-model/1"
FEATURES = ("log10_kernel_s_per_launch", "log10_step_s")
ACTIVITY_MIN, ACTIVITY_MAX = 0.02, 1.0
#: logit targets are taken of activities clipped to this range: a board measured at (or
#: above) its TDP or at idle would otherwise give an infinite target
_TARGET_RANGE = (0.02, 0.98)
PACKAGED = Path(__file__).with_name("power_model.json")
REGENERATE = "python -m gogh_flows.power_model fit --data ../shared/data --out gogh_flows/power_model.json"
BOARD_FILE = "alone.csv"
BOARD_COLUMNS = ("job_type", "mean_power_w")
MEASUREMENT_COLUMNS = ("job_type", "gpu_type", "partners", "status", "telemetry", "mean_power_w")


# -- features -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ActivityInputs:
    """What the fitted activity depends on, for one job on one GPU type (from the roofline)."""

    kernel_s_per_launch: float
    step_s: float

    def vector(self) -> np.ndarray:
        return np.array([1.0, math.log10(self.kernel_s_per_launch), math.log10(self.step_s)])


def activity_inputs(features: WorkloadFeatures, kernel_s: float, step_s: float) -> ActivityInputs:
    """The fit's inputs from a step's roofline kernel time; launches as the roofline counts them."""
    launches = max(1, features.passes * len(features.layers))
    return ActivityInputs(kernel_s_per_launch=max(kernel_s, 1e-9) / launches, step_s=max(step_s, 1e-9))


def spec_activity(busy: float, compute_share: float) -> float:
    """The spec-based activity: the fallback where no fitted model applies, and the 'before'."""
    return min(1.0, max(0.05, busy * (0.55 + 0.45 * compute_share)))


def zoo_profile(job_type: str, gpu_type: str, precision: str = "fp32"):
    """(features, roofline profile) of a zoo job type; ValueError when it is not one."""
    # imported here: truth.synthetic imports this module for its activity
    from gogh_flows.truth.synthetic import step_profile

    family, batch_size, kind = parse_job_kind(job_type)
    features = zoo_features(family, batch_size, kind)
    return features, step_profile(features, catalog.get_gpu_type(gpu_type), precision)


# -- measured points ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """One job measured alone on one board: its mean power and the board's levels.

    ``idle_w``/``tdp_w`` default to the catalog's; a board run at another power limit
    (Zeus's traces) gives its own ``tdp_w``.
    """

    job_type: str
    gpu_type: str
    power_w: float
    source: str
    idle_w: float | None = None
    tdp_w: float | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        gpu = catalog.get_gpu_type(self.gpu_type)  # unknown -> error naming it
        if not (isinstance(self.power_w, int | float) and math.isfinite(self.power_w) and self.power_w > 0):
            raise ValueError(f"{self.source}: {self.job_type!r} on {self.gpu_type}: power_w must be a "
                             f"finite number of watts > 0, got {self.power_w!r}")
        object.__setattr__(self, "power_w", float(self.power_w))
        object.__setattr__(self, "gpu_type", gpu.name)

    @property
    def family(self) -> str:
        """The model family, the unit left out in leave-one-family-out checks."""
        return self.job_type.split(" (batch size")[0].strip()

    @property
    def levels(self) -> tuple[float, float]:
        """(idle W, TDP W) of the board."""
        gpu = catalog.get_gpu_type(self.gpu_type)
        return (self.idle_w if self.idle_w is not None else gpu.idle_w,
                self.tdp_w if self.tdp_w is not None else gpu.tdp_w)

    @property
    def activity(self) -> float:
        """The measured fraction of the board's dynamic range (unclipped)."""
        idle, tdp = self.levels
        return (self.power_w - idle) / (tdp - idle)

    def power(self, activity: float) -> float:
        idle, tdp = self.levels
        return idle + activity * (tdp - idle)


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where measured data live: the argument, else ``$GOGH_DATA_DIR``, else ``../shared/data`` from the
    working directory or beside the checkout (:func:`gogh_flows.datapaths.default_data`)."""
    if path is not None:
        return Path(path)
    env = os.environ.get("GOGH_DATA_DIR")
    return Path(env) if env else default_data()


def _require(frame: pl.DataFrame, columns: Sequence[str], where: str, hint: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{where}: missing column(s) {', '.join(map(repr, missing))}; {hint} "
                         f"(found: {', '.join(frame.columns) or 'none'})")


def read_board_file(path: str | os.PathLike[str], gpu_type: str) -> list[MeasuredPoint]:
    """A board's ``alone.csv`` (one job alone per row, ``job_type`` and ``mean_power_w``)."""
    path = Path(path)
    frame = pl.read_csv(path)
    _require(frame, BOARD_COLUMNS, str(path), "a board file needs one row per job type measured "
             "alone, with its mean board power in watts (see ../shared/data/h100/README.md)")
    source = f"{path.parent.name}/{path.name}"
    points = []
    for i, r in enumerate(frame.iter_rows(named=True), start=2):  # line 1 is the header
        try:
            parse_job_kind(r["job_type"])
        except ValueError as exc:
            raise ValueError(f"{path}, line {i}: job_type {r['job_type']!r} is not a zoo job type, so the fit "
                             f"has no features for it ({exc})") from None
        if r["mean_power_w"] is None:
            raise ValueError(f"{path}, line {i}: mean_power_w is empty for {r['job_type']!r}")
        points.append(MeasuredPoint(job_type=r["job_type"], gpu_type=gpu_type, power_w=r["mean_power_w"],
                                    source=source))
    return points


def measurement_points(measurements: pl.DataFrame | str | os.PathLike[str]) -> list[MeasuredPoint]:
    """Points from the measurement table of placed runs (``tracking.measurements``).

    Only what a board said about a job alone in its steady state counts: NVML telemetry, no
    partners, completed, a mean power, ``window`` "steady" (a whole-run figure includes the
    start-up, which draws little; rows from before the window was recorded are kept). Repeated runs of a job type on a GPU type become one point (their median),
    so a job measured a hundred times does not outweigh the others. Rows that are not zoo job
    types are skipped: the table holds no layers to compute the fit's inputs from.
    """
    if not isinstance(measurements, pl.DataFrame):
        from gogh_flows.tracking.measurements import read_measurements

        measurements, where = read_measurements(measurements), str(measurements)
    else:
        where = "measurement table"
    _require(measurements, MEASUREMENT_COLUMNS, where, "expected the table of gogh_flows.tracking.measurements")
    alone = measurements.filter(
        (pl.col("telemetry") == "nvml") & (pl.col("status") == "completed")
        & pl.col("mean_power_w").is_not_null() & (pl.col("mean_power_w") > 0)
        & (pl.col("partners").is_null() | (pl.col("partners").list.len() == 0))
        & ((pl.col("window") == "steady") | pl.col("window").is_null() if "window" in measurements.columns
           else pl.lit(True))
    )
    if measurements.height and alone.height < measurements.height:
        # emulated runs, failed ones, shared boards and whole-run windows say nothing of a board's draw
        log.warning("power model: %d of %d measured runs in %s are usable (a job alone on a board, completed, "
                    "with NVML telemetry and a steady window, or none recorded); the rest are left out",
                    alone.height, measurements.height, where)
    grouped = alone.group_by("job_type", "gpu_type").agg(pl.col("mean_power_w").median(), pl.len().alias("runs"))
    points, skipped = [], []
    for r in grouped.sort("job_type", "gpu_type").iter_rows(named=True):
        try:
            parse_job_kind(r["job_type"])
            catalog.get_gpu_type(r["gpu_type"])
        except ValueError as exc:
            skipped.append(f"{r['job_type']!r} on {r['gpu_type']!r} ({exc})")
            continue
        points.append(MeasuredPoint(job_type=r["job_type"], gpu_type=r["gpu_type"], power_w=r["mean_power_w"],
                                    source="measurements"))
    if skipped:
        log.info("power model: %d measured job type(s) skipped: %s", len(skipped), "; ".join(skipped))
    return points


def load_measured_points(
    data: str | os.PathLike[str] | None = None,
    measurements: pl.DataFrame | str | os.PathLike[str] | None = None,
) -> list[MeasuredPoint]:
    """Every board file ``<data>/<gpu type>/alone.csv`` (today: h100), plus logged measurements."""
    root = data_dir(data)
    points: list[MeasuredPoint] = []
    for gpu in catalog.gpu_types():
        board = root / gpu.name / BOARD_FILE
        if board.exists():
            points += read_board_file(board, gpu.name)
    if measurements is not None:
        points += measurement_points(measurements)
    return points


def zeus_points(data: str | os.PathLike[str] | None = None) -> list[MeasuredPoint]:
    """Zeus's ResNet-50/ImageNet traces at each board's top power limit: a transfer check only.

    Only ResNet-50 on ImageNet is a zoo model; the V100 and P100 traces are used (the A40's,
    added to the catalog later, is not, so the published check stays as it was). The boards are 250 W PCIe parts, so the limit is their TDP; their idle was not
    measured (catalog estimates); the runs read real data with Adadelta. Too many unknowns to
    fit on, enough to ask whether the H100 fit transfers to other types.
    """
    root = data_dir(data) / "zeus"
    points = []
    for gpu in ("v100", "p100"):
        path = root / f"summary_power_{gpu}.csv"
        if not path.exists():
            continue
        frame = pl.read_csv(path)
        _require(frame, ("network", "dataset", "batch_size", "power_limit", "average_power"), str(path),
                 "expected Zeus's summary_power_<gpu>.csv (see ../shared/data/zeus/README.md)")
        r50 = frame.filter((pl.col("network") == "resnet50") & (pl.col("dataset") == "imagenet"))
        top = r50.filter(pl.col("power_limit") == pl.col("power_limit").max())
        points += [MeasuredPoint(job_type=f"ResNet-50 (batch size {r['batch_size']})", gpu_type=gpu,
                                 power_w=r["average_power"], tdp_w=float(r["power_limit"]), source=f"zeus/{path.name}")
                   for r in top.sort("batch_size").iter_rows(named=True)]
    return points


# -- the model ------------------------------------------------------------------------------
def _activity(z: np.ndarray | float) -> np.ndarray:
    """sigmoid(z), clipped: no job draws nothing at all, none more than the whole range."""
    z = np.clip(np.asarray(z, dtype=float), -50.0, 50.0)  # exp() stays finite; the clip below decides
    return np.clip(1.0 / (1.0 + np.exp(-z)), ACTIVITY_MIN, ACTIVITY_MAX)


@dataclass(frozen=True)
class PowerModel:
    """Fitted activity (fraction of a GPU type's dynamic range drawn by a job alone)."""

    coefficients: tuple[float, float, float]  # intercept, then one per FEATURES
    gpu_types: tuple[str, ...]  # where it applies; other types keep the spec formula
    precision: str = "fp32"
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        coef = tuple(float(c) for c in self.coefficients)
        if len(coef) != 1 + len(FEATURES) or not all(math.isfinite(c) for c in coef):
            raise ValueError(f"PowerModel needs {1 + len(FEATURES)} finite coefficients (intercept, "
                             f"{', '.join(FEATURES)}), got {self.coefficients!r}")
        object.__setattr__(self, "coefficients", coef)
        object.__setattr__(self, "gpu_types", tuple(sorted(catalog.get_gpu_type(g).name for g in self.gpu_types)))

    def applies(self, gpu_type: str, precision: str = "fp32") -> bool:
        return precision == self.precision and gpu_type in self.gpu_types

    def predict(self, inputs: ActivityInputs) -> float:
        """The fitted activity, wherever it is asked for (callers check :meth:`applies`)."""
        return float(_activity(np.dot(self.coefficients, inputs.vector())))

    def activity(self, job_type: str, gpu_type: str, precision: str = "fp32") -> float:
        """A zoo job type's activity: fitted where this model applies, spec-based elsewhere."""
        features, prof = zoo_profile(job_type, gpu_type, precision)
        if not self.applies(catalog.get_gpu_type(gpu_type).name, precision):
            return spec_activity(prof.busy, prof.compute_share)
        return self.predict(activity_inputs(features, prof.busy * prof.step_s, prof.step_s))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "form": "activity = clip(sigmoid(c0 + c1*log10_kernel_s_per_launch + c2*log10_step_s), 0.02, 1)",
            "features": list(FEATURES),
            "coefficients": dict(zip(("intercept", *FEATURES), self.coefficients, strict=True)),
            "gpu_types": list(self.gpu_types),
            "precision": self.precision,
            "provenance": dict(self.provenance),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PowerModel:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a power model: format {d.get('format')!r}, expected {FORMAT!r}")
        coef = d["coefficients"]
        missing = [k for k in ("intercept", *FEATURES) if k not in coef]
        if missing:
            raise ValueError(f"power model lacks coefficient(s) {', '.join(missing)}; regenerate it with: {REGENERATE}")
        return cls(coefficients=tuple(coef[k] for k in ("intercept", *FEATURES)),
                   gpu_types=tuple(d["gpu_types"]), precision=d.get("precision", "fp32"),
                   provenance=d.get("provenance", {}))

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PowerModel:
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the power model {path}: {exc}; regenerate it with: {REGENERATE}") from exc


@lru_cache(maxsize=1)
def default_power_model() -> PowerModel | None:
    """The shipped fit (``gogh_flows/power_model.json``), read once per process.

    Absent (deleted to refit from scratch: the fit itself runs the roofline, which asks for
    this model), the spec formula applies everywhere, with a warning; unreadable, an error.
    """
    if not PACKAGED.exists():
        log.warning("power model %s is missing: spec-based activity on every GPU type; regenerate it with: %s",
                    PACKAGED, REGENERATE)
        return None
    return PowerModel.load(PACKAGED)


def fitted_activity(gpu_type: str, precision: str, inputs: ActivityInputs) -> float | None:
    """The shipped fit's activity, or None where it does not apply (use the spec formula)."""
    model = default_power_model()
    return model.predict(inputs) if model is not None and model.applies(gpu_type, precision) else None


def _design(points: Sequence[MeasuredPoint]) -> np.ndarray:
    rows = []
    for p in points:
        features, prof = zoo_profile(p.job_type, p.gpu_type, p.precision)
        rows.append(activity_inputs(features, prof.busy * prof.step_s, prof.step_s).vector())
    return np.vstack(rows)


def _solve(x: np.ndarray, points: Sequence[MeasuredPoint]) -> np.ndarray:
    a = np.clip([p.activity for p in points], *_TARGET_RANGE)
    coef, *_ = np.linalg.lstsq(x, np.log(a / (1 - a)), rcond=None)
    return coef


def fit_power_model(points: Iterable[MeasuredPoint], provenance: Mapping[str, Any] | None = None) -> PowerModel:
    """Least squares on logit(measured activity); applies to the GPU types in ``points``."""
    points = list(points)
    if len(points) < 1 + len(FEATURES):
        raise ValueError(f"fitting {1 + len(FEATURES)} coefficients needs at least {1 + len(FEATURES)} "
                         f"measured points, got {len(points)}; measure more job types alone (NVML)")
    precisions = {p.precision for p in points}
    if len(precisions) != 1:
        raise ValueError(f"points mix precisions {sorted(precisions)}; fit one precision at a time")
    coef = _solve(_design(points), points)
    return PowerModel(coefficients=tuple(coef), gpu_types=tuple({p.gpu_type for p in points}),
                      precision=precisions.pop(), provenance=dict(provenance or {}))


# -- checks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LofoResult:
    """Board power predicted for each family by a fit that never saw it, and by the spec formula."""

    table: pl.DataFrame  # job_type, family, gpu_type, measured_w, fitted_w, spec_w, fitted_err, spec_err

    def summary(self) -> dict[str, float]:
        t = self.table
        return {"points": t.height, "families": t["family"].n_unique(),
                "fitted_median": float(t["fitted_err"].median()), "fitted_worst": float(t["fitted_err"].max()),
                "spec_median": float(t["spec_err"].median()), "spec_worst": float(t["spec_err"].max())}


def _spec_power(p: MeasuredPoint) -> float:
    _, prof = zoo_profile(p.job_type, p.gpu_type, p.precision)
    return p.power(spec_activity(prof.busy, prof.compute_share))


def leave_one_family_out(points: Sequence[MeasuredPoint]) -> LofoResult:
    """Each family's board power from a fit on the other families only (relative errors)."""
    points = list(points)
    families = sorted({p.family for p in points})
    if len(families) < 2:
        raise ValueError(f"leave-one-family-out needs points of 2+ families, got {families}")
    x = _design(points)
    fitted = np.empty(len(points))
    for fam in families:
        test = np.array([p.family == fam for p in points])
        train = [p for p, t in zip(points, test, strict=True) if not t]
        if len(train) < x.shape[1]:
            raise ValueError(f"leaving out {fam!r} leaves {len(train)} points for {x.shape[1]} coefficients")
        coef = _solve(x[~test], train)
        fitted[test] = _activity(x[test] @ coef)
    rows = []
    for p, a in zip(points, fitted, strict=True):
        fw, sw = p.power(float(a)), _spec_power(p)
        rows.append({"job_type": p.job_type, "family": p.family, "gpu_type": p.gpu_type, "source": p.source,
                     "measured_w": p.power_w, "fitted_w": fw, "spec_w": sw,
                     "fitted_err": abs(fw / p.power_w - 1), "spec_err": abs(sw / p.power_w - 1)})
    return LofoResult(pl.DataFrame(rows))


def transfer_check(model: PowerModel, points: Sequence[MeasuredPoint]) -> pl.DataFrame:
    """``model``'s fitted activity applied to boards it was not fitted on, against the spec formula."""
    rows = []
    for p in points:
        features, prof = zoo_profile(p.job_type, p.gpu_type, p.precision)
        fw = p.power(model.predict(activity_inputs(features, prof.busy * prof.step_s, prof.step_s)))
        sw = p.power(spec_activity(prof.busy, prof.compute_share))
        rows.append({"job_type": p.job_type, "gpu_type": p.gpu_type, "measured_w": p.power_w, "fitted_w": fw,
                     "spec_w": sw, "fitted_err": abs(fw / p.power_w - 1), "spec_err": abs(sw / p.power_w - 1)})
    return pl.DataFrame(rows)


def throughput_factors(data: str | os.PathLike[str] | None = None, gpu_type: str = "h100") -> pl.DataFrame:
    """The synthetic fleet's isolated throughput against a board file's (factor >= 1 either way)."""
    from gogh_flows.truth.synthetic import SyntheticFleet

    path = data_dir(data) / gpu_type / BOARD_FILE
    frame = pl.read_csv(path)
    _require(frame, ("job_type", "throughput_steps_per_s"), str(path), "a board file with measured throughputs")
    jobs = {jt: zoo_features(*parse_job_kind(jt)) for jt in frame["job_type"]}
    table = SyntheticFleet(gpu_types=(gpu_type,), jobs=jobs, scale_factors=(1,)).table()
    return frame.select("job_type", pl.col("throughput_steps_per_s").alias("measured")).with_columns(
        synthetic=pl.Series([table.isolated(j, gpu_type) for j in frame["job_type"]], dtype=pl.Float64),
    ).with_columns(factor=pl.max_horizontal(pl.col("synthetic") / pl.col("measured"),
                                            pl.col("measured") / pl.col("synthetic")))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- command line ---------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gogh_flows.power_model", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("fit", "fit on measured points and write the JSON"),
                       ("evaluate", "leave-one-family-out, transfer and throughput checks")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--data", default=None, help="measured data folder (default $GOGH_DATA_DIR or ../shared/data)")
        cmd.add_argument("--measurements", default=None, help="measurement table (parquet file or its folder)")
        if name == "fit":
            cmd.add_argument("--out", default=str(PACKAGED), help="where to write the fitted model (JSON)")
    args = parser.parse_args(argv)
    try:
        points = load_measured_points(args.data, args.measurements)
    except (OSError, ValueError) as exc:  # a missing or foreign table: say so, as for every other input
        parser.error(str(exc))
    if not points:
        parser.error(f"no measured points under {data_dir(args.data)} (expected <gpu type>/{BOARD_FILE})")
    lofo = leave_one_family_out(points)
    s = lofo.summary()
    print(f"{s['points']} points, {s['families']} families: leave-one-family-out relative error of board power")
    print(f"  fitted: median {s['fitted_median']:.1%}, worst {s['fitted_worst']:.1%}")
    print(f"  spec formula (before): median {s['spec_median']:.1%}, worst {s['spec_worst']:.1%}")
    if args.command == "fit":
        root = data_dir(args.data)
        files = sorted({p.source for p in points if p.source != "measurements"})
        given = list(argv) if argv is not None else sys.argv[1:]
        provenance = {"command": " ".join(["python -m gogh_flows.power_model", *given]),
                      "points": len(points), "sources": {f: _sha256(root / f) for f in files},
                      "measurement_points": sum(p.source == "measurements" for p in points),
                      "leave_one_family_out": {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}}
        model = fit_power_model(points, provenance)
        coef = dict(zip(("intercept", *FEATURES), (round(c, 4) for c in model.coefficients), strict=True))
        print(f"coefficients {coef} for {', '.join(model.gpu_types)}; written to {model.save(args.out)}")
        return 0
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=200, float_precision=3):
        print(lofo.table.drop("source"))
        model = fit_power_model(points)
        zeus = zeus_points(args.data)
        if zeus:
            t = transfer_check(model, zeus)
            print(f"transfer check, fit of {', '.join(model.gpu_types)} applied to Zeus ResNet-50 ({t.height} points): "
                  f"fitted median {t['fitted_err'].median():.1%} worst {t['fitted_err'].max():.1%}; "
                  f"spec median {t['spec_err'].median():.1%} worst {t['spec_err'].max():.1%}")
            print(t)
        for gpu in model.gpu_types:
            if (data_dir(args.data) / gpu / BOARD_FILE).exists():
                f = throughput_factors(args.data, gpu)
                print(f"synthetic fleet throughput vs {gpu} board: median factor {f['factor'].median():.2f}, "
                      f"worst {f['factor'].max():.2f}")
                print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

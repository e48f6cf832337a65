"""Job streams for the simulator: Gavel's traces, the MSR/Philly traces, generated arrivals.

Why: a placement policy is only as convincing as the workload it is judged on.
Reading the traces the Gavel authors used (their physical-cluster experiments and
the Microsoft Philly virtual-cluster traces) lets the simulator replay published
workloads; the generators draw fresh, seeded streams from the Philly job
distribution when a sweep needs more or different arrivals.

Formats (one job per line, fields separated by tabs, blank lines ignored):

* **Gavel current format**, 10 fields (``traces/physical_cluster/*.trace``)::

    job_type, command, working_directory, num_steps_arg, needs_data_dir (0/1),
    total_steps, scale_factor, priority_weight, SLO (-1 = none), arrival_time_seconds

* **Older MSR/Philly format**, 7 fields (``traces/msr/seed=N/<vc>.trace``)::

    job_type, command, num_steps_arg, needs_data_dir (0/1), total_steps,
    arrival_time_seconds, scale_factor

The format is chosen per file from the field count of its first non-empty line,
and every other line must match it. ``command`` and ``working_directory`` are
kept out of :class:`TraceJob`: they are launch strings, data here, never run.

* ``traces/philly_job_distribution.csv``: header ``duration_s,num_gpus``, one
  Philly job per row; :func:`generate_arrivals` draws from it.

Throughput requirements are not part of any trace; :func:`assign_requirements`
adds them by the rule in its docstring.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import polars as pl

from gogh_flows.datapaths import where_looked

__all__ = [
    "TraceFormatError",
    "TraceJob",
    "assign_requirements",
    "generate_arrivals",
    "list_traces",
    "load_philly_distribution",
    "read_trace",
]

# Field positions per format: (name, field count, index of each field we use).
_CURRENT = "Gavel current format"
_MSR = "MSR/Philly format"
_LAYOUTS: dict[int, tuple[str, dict[str, int]]] = {
    10: (_CURRENT, {"job_type": 0, "needs_data_dir": 4, "total_steps": 5, "scale_factor": 6,
                    "priority": 7, "slo": 8, "arrival": 9}),
    7: (_MSR, {"job_type": 0, "needs_data_dir": 3, "total_steps": 4, "arrival": 5,
               "scale_factor": 6}),
}
_DIST_COLUMNS = {"duration_s": pl.Float64, "num_gpus": pl.Int64}


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a stream; fits the simulator's ``SimJob`` protocol."""

    id: str  # "j0", "j1", ... : position in the file (or in generation order)
    job_type: str  # Gavel job type, e.g. "ResNet-50 (batch size 64)"
    total_steps: float  # > 0
    num_gpus: int  # scale factor; traces may hold values above 8 (no throughput data)
    arrival_s: float  # >= 0
    priority: float = 1.0
    slo_s: float | None = None  # from the 10-field format's SLO column; negative -> None
    required_throughput: float | None = None  # steps/s; set by assign_requirements
    duration_s: float | None = None  # generated jobs: the drawn duration


class TraceFormatError(ValueError):
    """A trace line that cannot be a job; the message reads ``path:line: what was wrong``."""


# --------------------------------------------------------------------------- reading


def list_traces(directory: str | Path) -> list[Path]:
    """Every ``*.trace`` file under ``directory`` (recursively), sorted, so runs are repeatable."""
    root = Path(directory)
    if not root.is_dir():
        raise NotADirectoryError(f"trace folder {root} does not exist or is not a folder")
    return sorted(p for p in root.rglob("*.trace") if p.is_file())


def read_trace(path: str | Path, *, max_gpus: int | None = None) -> list[TraceJob]:
    """Jobs of one Gavel or MSR trace file, sorted by arrival (file order for ties).

    Ids are ``j<index in file order>``, so they stay stable when ``max_gpus``
    drops jobs. MSR traces hold scale factors up to 64 that have no throughput
    data; they are kept unless ``max_gpus`` is given, in which case larger jobs
    are dropped and a warning names how many (never silently).
    """
    if max_gpus is not None and max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1 or None, got {max_gpus!r}")
    path = Path(path)
    jobs: list[TraceJob] = []
    layout: tuple[int, str, dict[str, int]] | None = None
    with path.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.rstrip("\r\n")
            if not line.strip():
                continue
            fields = line.split("\t")
            if layout is None:
                layout = _detect_layout(fields, path, lineno)
            jobs.append(_parse_line(fields, layout, f"j{len(jobs)}", f"{path}:{lineno}"))
    if max_gpus is not None:
        jobs = _drop_wide_jobs(jobs, max_gpus, path)
    return sorted(jobs, key=lambda j: j.arrival_s)  # sorted() is stable


def _detect_layout(fields: list[str], path: Path, lineno: int) -> tuple[int, str, dict[str, int]]:
    if len(fields) not in _LAYOUTS:
        raise TraceFormatError(
            f"{path}:{lineno}: expected 10 tab-separated fields ({_CURRENT}) or 7 ({_MSR}), "
            f"got {len(fields)}"
        )
    name, index = _LAYOUTS[len(fields)]
    return len(fields), name, index


def _parse_line(fields: list[str], layout: tuple[int, str, dict[str, int]], job_id: str,
                where: str) -> TraceJob:
    count, name, idx = layout
    if len(fields) != count:
        raise TraceFormatError(
            f"{where}: expected {count} tab-separated fields ({name}), got {len(fields)}"
        )
    job_type = fields[idx["job_type"]].strip()
    if not job_type:
        raise TraceFormatError(f"{where}: empty job_type")
    if fields[idx["needs_data_dir"]].strip() not in ("0", "1"):
        raise TraceFormatError(
            f"{where}: needs_data_dir must be 0 or 1, got {fields[idx['needs_data_dir']]!r} "
            "(are the columns shifted?)"
        )
    total_steps = _number(fields[idx["total_steps"]], "total_steps", where)
    if not total_steps > 0:
        raise TraceFormatError(f"{where}: total_steps must be > 0, got {total_steps:g}")
    arrival = _number(fields[idx["arrival"]], "arrival_time_seconds", where)
    if arrival < 0:
        raise TraceFormatError(f"{where}: arrival_time_seconds must be >= 0, got {arrival:g}")
    priority, slo = 1.0, None
    if "priority" in idx:
        priority = _number(fields[idx["priority"]], "priority_weight", where)
        if not priority > 0:
            raise TraceFormatError(f"{where}: priority_weight must be > 0, got {priority:g}")
        slo = _slo(fields[idx["slo"]], where)
    return TraceJob(id=job_id, job_type=job_type, total_steps=total_steps,
                    num_gpus=_scale_factor(fields[idx["scale_factor"]], where),
                    arrival_s=arrival, priority=priority, slo_s=slo)


def _number(text: str, what: str, where: str) -> float:
    """A finite float, or a TraceFormatError naming the field (NaN/inf are not data)."""
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(f"{where}: {what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceFormatError(f"{where}: {what} must be finite, got {text!r}")
    return value


def _scale_factor(text: str, where: str) -> int:
    """GPU count: an integer >= 1 (``"4"`` or ``"4.0"``; ``"4.5"`` is an error)."""
    value = _number(text, "scale_factor", where)
    if not value.is_integer() or value < 1:
        raise TraceFormatError(f"{where}: scale_factor must be an integer >= 1, got {text!r}")
    return int(value)


def _slo(text: str, where: str) -> float | None:
    """Gavel writes -1 for "no SLO" and treats any negative value so; 0 is meaningless."""
    value = _number(text, "SLO", where)
    if value < 0:
        return None
    if value == 0:
        raise TraceFormatError(f"{where}: SLO must be > 0 seconds or -1 for none, got {text!r}")
    return value


def _drop_wide_jobs(jobs: list[TraceJob], max_gpus: int, path: Path) -> list[TraceJob]:
    kept = [j for j in jobs if j.num_gpus <= max_gpus]
    dropped = len(jobs) - len(kept)
    if dropped:
        warnings.warn(
            f"{path}: dropped {dropped} of {len(jobs)} jobs needing more than {max_gpus} GPUs",
            stacklevel=3,
        )
    return kept


# --------------------------------------------------------------------------- generating


def load_philly_distribution(path: str | Path) -> pl.DataFrame:
    """The Philly (duration_s, num_gpus) rows that :func:`generate_arrivals` draws from."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no Philly job distribution here; generated traces (generate:N) draw durations and GPU "
            "counts from Gavel's traces/philly_job_distribution.csv: set GOGH_GAVEL_DIR to the folder holding "
            "Gavel's data (by default " + where_looked("gavel") + ")")
    try:
        frame = pl.read_csv(path)
    except pl.exceptions.PolarsError as exc:
        raise ValueError(
            f"{path}: not a readable CSV with header duration_s,num_gpus ({exc})"
        ) from exc
    try:
        return _checked_distribution(frame, str(path))
    except pl.exceptions.PolarsError as exc:
        raise ValueError(f"{path}: duration_s/num_gpus are not numeric ({exc})") from exc


def _checked_distribution(frame: pl.DataFrame, source: str) -> pl.DataFrame:
    """Columns present, typed, non-null, positive: bad rows would become bad jobs later."""
    missing = [c for c in _DIST_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {', '.join(missing)}; "
            f"expected header duration_s,num_gpus, got {', '.join(frame.columns) or 'none'}"
        )
    frame = frame.select(pl.col(c).cast(t, strict=True) for c, t in _DIST_COLUMNS.items())
    if frame.null_count().sum_horizontal().item():
        raise ValueError(f"{source}: duration_s/num_gpus contain empty values")
    if frame.height and (frame["duration_s"].min() <= 0 or frame["num_gpus"].min() < 1):
        raise ValueError(f"{source}: durations must be > 0 and num_gpus >= 1")
    return frame


def generate_arrivals(
    n: int,
    *,
    rate_per_hour: float,
    job_types: Sequence[str],
    distribution: pl.DataFrame,
    seed: int,
    throughput_of: Callable[[str, int], float] | None = None,
    max_gpus: int = 8,
) -> list[TraceJob]:
    """``n`` seeded Poisson arrivals with Philly durations and GPU counts.

    Inter-arrival times are exponential with mean ``3600 / rate_per_hour`` s
    (the first job arrives at the first draw). Each job takes a uniformly drawn
    (duration_s, num_gpus) row with ``num_gpus <= max_gpus`` and a uniformly
    drawn job type among those that run at that GPU count. ``total_steps`` is
    ``duration_s * throughput_of(job_type, num_gpus)``, the job's reference rate
    (Gavel uses isolated V100), or ``duration_s`` at 1 step/s without it.
    """
    _validate_generation(n, rate_per_hour, job_types, max_gpus)
    rows = _checked_distribution(distribution, "distribution")
    rows = rows.filter(pl.col("num_gpus") <= max_gpus)
    if rows.height == 0:
        raise ValueError(f"distribution has no rows with num_gpus <= max_gpus={max_gpus}")
    durations, gpus = rows["duration_s"].to_numpy(), rows["num_gpus"].to_numpy()
    rate = throughput_of or (lambda _t, _g: 1.0)
    valid = _runnable_types(job_types, sorted({int(g) for g in gpus}), rate)

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(3600.0 / rate_per_hour, size=n))
    picks = rng.integers(0, rows.height, size=n)
    type_draws = rng.random(size=n)  # one draw per job whatever throughput_of says
    jobs: list[TraceJob] = []
    for i in range(n):
        duration, g = float(durations[picks[i]]), int(gpus[picks[i]])
        choices = valid[g]
        job_type = choices[min(int(type_draws[i] * len(choices)), len(choices) - 1)]
        jobs.append(TraceJob(id=f"j{i}", job_type=job_type,
                             total_steps=duration * rate(job_type, g), num_gpus=g,
                             arrival_s=float(arrivals[i]), duration_s=duration))
    return jobs


def _validate_generation(n: int, rate_per_hour: float, job_types: Sequence[str],
                         max_gpus: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not (isinstance(rate_per_hour, int | float) and math.isfinite(rate_per_hour)
            and rate_per_hour > 0):
        raise ValueError(f"rate_per_hour must be a finite number > 0, got {rate_per_hour!r}")
    if isinstance(job_types, str) or len(job_types) == 0:
        raise ValueError(
            f"job_types must be a non-empty sequence of job type names, got {job_types!r}"
        )
    if max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1, got {max_gpus!r}")


def _runnable_types(job_types: Sequence[str], gpu_counts: list[int],
                    rate: Callable[[str, int], float]) -> dict[int, list[str]]:
    """Job types with a positive rate per GPU count (drawing among them = redrawing zeros)."""
    valid: dict[int, list[str]] = {}
    for g in gpu_counts:
        valid[g] = [t for t in dict.fromkeys(job_types) if rate(t, g) > 0]
        if not valid[g]:
            raise ValueError(
                f"no job type in job_types has a throughput > 0 at {g} GPU(s), but the "
                f"distribution draws {g}-GPU jobs; add such types or lower max_gpus"
            )
    return valid


# --------------------------------------------------------------------------- requirements


def assign_requirements(
    jobs: Sequence[TraceJob],
    best_throughput: Callable[[str, int], float],
    *,
    seed: int,
    q_low: float = 0.2,
    q_high: float = 0.9,
) -> list[TraceJob]:
    """Give every job a throughput requirement ``rho_j`` (steps/s), a DESIGN rule.

    ``rho_j = q_j * best``, where ``best`` is the highest isolated throughput of
    the job's type at its GPU count over the fleet's GPU types
    (``best_throughput(job_type, num_gpus)``) and ``q_j ~ U(q_low, q_high)``,
    seeded. A requirement below the best rate is always meetable on some GPU
    type, and the spread of ``q`` decides how many slower types also qualify.
    Returns new jobs; the inputs are unchanged.
    """
    if not 0 < q_low <= q_high <= 1:
        raise ValueError(f"need 0 < q_low <= q_high <= 1, got q_low={q_low!r}, q_high={q_high!r}")
    q = np.random.default_rng(seed).uniform(q_low, q_high, size=len(jobs))
    out: list[TraceJob] = []
    for job, q_j in zip(jobs, q, strict=True):
        best = best_throughput(job.job_type, job.num_gpus)
        if not best > 0:
            raise ValueError(
                f"job {job.id!r} ({job.job_type!r} on {job.num_gpus} GPU(s)) has best throughput "
                f"{best!r} on this fleet; it cannot run there, so it gets no requirement"
            )
        out.append(replace(job, required_throughput=float(q_j) * best))
    return out

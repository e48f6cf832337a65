"""One table type for every source of throughput truth.

Measured data (Gavel's JSON), the built-in synthetic fleet and, later, logged
measurements all end up as the same long polars frame, so the optimiser, the
simulator and the predictors never care where a number came from.

A row is either an *isolated* throughput (``partner`` is null) or one side of a
*co-located pair* on one GPU of ``gpu_type`` (``partner`` names the other job,
``partner_throughput`` is that job's rate while they share). Throughputs are in
steps per second; 0.0 means "does not run there" (out of memory, or a pair that
does not fit), exactly as Gavel records it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

SCHEMA: dict[str, pl.DataType] = {
    "job_type": pl.String(),
    "gpu_type": pl.String(),
    "scale_factor": pl.Int32(),
    "partner": pl.String(),
    "throughput": pl.Float64(),
    "partner_throughput": pl.Float64(),
    # Fraction of the GPU's dynamic power range (TDP - idle) a job draws when it
    # runs alone; null where the source has no power information.
    "activity": pl.Float64(),
}


class ThroughputLookupError(KeyError):
    """A (job type, GPU type) combination the table has no entry for."""

    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ThroughputTable:
    """Isolated and co-located throughputs per (job type, GPU type, scale factor).

    Build one with :func:`ThroughputTable.from_rows`, :func:`read_gavel_json`
    or :func:`synthetic_table`; look values up with :meth:`isolated` and
    :meth:`pair`, which are dictionary lookups (the frame is indexed once).
    """

    frame: pl.DataFrame
    source: str = "unknown"
    #: the synthetic fleet's settings that made this table (seed, noise, boards), so a job type an
    #: emulated worker learns later (a user's model) is computed on the same boards; None otherwise
    fleet: Mapping[str, Any] | None = field(default=None, compare=False)
    _iso: dict[tuple[str, str, int], float] = field(init=False, repr=False, compare=False)
    _pair: dict[tuple[str, str, str], tuple[float, float]] = field(
        init=False, repr=False, compare=False
    )
    _activity: dict[tuple[str, str], float] = field(init=False, repr=False, compare=False)
    _job_types: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _job_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _gpu_types: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        missing = [c for c in SCHEMA if c not in self.frame.columns]
        if missing:
            raise ValueError(
                f"throughput table is missing column(s) {missing}; expected columns {list(SCHEMA)}"
            )
        frame = self.frame.select(list(SCHEMA)).cast(SCHEMA)  # type: ignore[arg-type]
        # NaN passes a "< 0" test (in polars as in Python): a NaN or infinite rate read from a file
        # made the optimiser's figures NaN, and a job look unplaceable everywhere
        def invalid(column: str) -> pl.Expr:
            return pl.col(column).is_null() | ~pl.col(column).is_finite() | (pl.col(column) < 0)

        which = (pl.when(invalid("throughput")).then(pl.lit("throughput"))
                 .when(pl.col("partner_throughput").is_not_null() & invalid("partner_throughput"))
                 .then(pl.lit("partner_throughput")))
        bad = frame.with_columns(_which=which).filter(pl.col("_which").is_not_null())
        if bad.height:
            row = bad.row(0, named=True)
            which = row["_which"]
            raise ValueError(
                f"{which} must be a finite number >= 0, got {row[which]!r} for "
                f"job {row['job_type']!r} on {row['gpu_type']!r}"
                + (f" beside {row['partner']!r}" if row["partner"] is not None else "")
            )
        object.__setattr__(self, "frame", frame)
        iso: dict[tuple[str, str, int], float] = {}
        pair: dict[tuple[str, str, str], tuple[float, float]] = {}
        activity: dict[tuple[str, str], float] = {}
        for job, gpu, sf, partner, tput, ptput, act in frame.iter_rows():
            if partner is None:
                iso[(job, gpu, sf)] = tput
                if act is not None and sf == 1:
                    activity[(job, gpu)] = act
            elif sf == 1:
                other = ptput or 0.0
                if job == partner:
                    # Two copies of one job type are interchangeable, so a self-pair
                    # must not depend on which copy is "first": keep the lower value.
                    tput = other = min(tput, other)
                pair[(job, partner, gpu)] = (tput, other)
                pair.setdefault((partner, job, gpu), (other, tput))
        object.__setattr__(self, "_iso", iso)
        object.__setattr__(self, "_pair", pair)
        object.__setattr__(self, "_activity", activity)
        jobs = {k[0] for k in iso}
        object.__setattr__(self, "_job_types", tuple(sorted(jobs)))
        object.__setattr__(self, "_job_set", frozenset(jobs))
        object.__setattr__(self, "_gpu_types", tuple(sorted({k[1] for k in iso})))

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Iterable[dict], source: str = "rows",
                  fleet: Mapping[str, Any] | None = None) -> ThroughputTable:
        """Build from dicts with the :data:`SCHEMA` keys (missing optional keys are null)."""
        filled = [{k: r.get(k) for k in SCHEMA} for r in rows]
        return cls(pl.DataFrame(filled, schema=SCHEMA), source=source, fleet=fleet)

    @classmethod
    def read_parquet(cls, path: str | Path) -> ThroughputTable:
        return cls(pl.read_parquet(path), source=str(path))

    def write_parquet(self, path: str | Path) -> None:
        self.frame.write_parquet(path)

    def absorb(self, other: ThroughputTable) -> int:
        """Take in ``other``'s entries for job types this table does not know; returns how many
        job types were added. Entries of known job types are never changed.

        Why in place: an emulated fleet's truth is one object shared by every meter of a worker
        process, and a run of a user's own model must find its own figures there, and its
        partners must find theirs next to it, without replacing the table under running meters.
        The frame is extended too, so what is read back stays the whole table.
        """
        new = [j for j in other.job_types if j not in self._job_set]
        if not new:
            return 0
        fresh = set(new)
        add = other.frame.filter(pl.col("job_type").is_in(new) | pl.col("partner").is_in(new))
        for job, gpu, sf, partner, tput, ptput, act in add.iter_rows():
            if partner is None:
                if job in fresh:
                    self._iso[(job, gpu, sf)] = tput
                    if act is not None and sf == 1:
                        self._activity[(job, gpu)] = act
            elif sf == 1 and (job in fresh or partner in fresh) and (job in self._job_set or job in fresh) \
                    and (partner in self._job_set or partner in fresh):
                other_t = ptput or 0.0
                if job == partner:
                    tput = other_t = min(tput, other_t)
                self._pair[(job, partner, gpu)] = (tput, other_t)
                self._pair.setdefault((partner, job, gpu), (other_t, tput))
        object.__setattr__(self, "frame", pl.concat([self.frame, add.select(self.frame.columns)]))
        object.__setattr__(self, "_job_set", self._job_set | fresh)
        object.__setattr__(self, "_job_types", tuple(sorted(self._job_set)))
        return len(new)

    # -- queries ----------------------------------------------------------------------
    @property
    def job_types(self) -> tuple[str, ...]:
        return self._job_types

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return self._gpu_types

    def knows(self, job_type: str) -> bool:
        return job_type in self._job_set

    def scale_factors(self, job_type: str) -> tuple[int, ...]:
        return tuple(sorted({sf for (j, _, sf) in self._iso if j == job_type}))

    def has(self, job_type: str, gpu_type: str, scale_factor: int = 1) -> bool:
        return (job_type, gpu_type, scale_factor) in self._iso

    def isolated(self, job_type: str, gpu_type: str, scale_factor: int = 1) -> float:
        """Steps/s of ``job_type`` alone on ``scale_factor`` GPUs of ``gpu_type`` (0.0 = does not fit)."""
        try:
            return self._iso[(job_type, gpu_type, scale_factor)]
        except KeyError:
            raise ThroughputLookupError(self._missing(job_type, gpu_type, scale_factor)) from None

    def pair(self, job_type: str, partner: str, gpu_type: str) -> tuple[float, float]:
        """(job's, partner's) steps/s while both share one GPU of ``gpu_type``.

        (0.0, 0.0) when the table says the pair does not fit, or has no entry for it:
        an unmeasured pair is never assumed to be safe.
        """
        return self._pair.get((job_type, partner, gpu_type), (0.0, 0.0))

    def activity(self, job_type: str, gpu_type: str) -> float | None:
        return self._activity.get((job_type, gpu_type))

    def restrict(
        self,
        *,
        job_types: Iterable[str] | None = None,
        gpu_types: Iterable[str] | None = None,
    ) -> ThroughputTable:
        """A sub-table; pairs are kept only when both jobs are kept."""
        frame = self.frame
        if job_types is not None:
            keep = list(job_types)
            frame = frame.filter(
                pl.col("job_type").is_in(keep)
                & (pl.col("partner").is_null() | pl.col("partner").is_in(keep))
            )
        if gpu_types is not None:
            frame = frame.filter(pl.col("gpu_type").is_in(list(gpu_types)))
        return ThroughputTable(frame, source=self.source)

    def isolated_frame(self) -> pl.DataFrame:
        """One row per (job, GPU type, scale factor) alone, sorted for stable output."""
        return (
            self.frame.filter(pl.col("partner").is_null())
            .drop("partner", "partner_throughput")
            .sort("job_type", "gpu_type", "scale_factor")
        )

    def _missing(self, job_type: str, gpu_type: str, scale_factor: int) -> str:
        if job_type not in self._job_set:
            known = ", ".join(self.job_types[:8]) + (" ..." if len(self.job_types) > 8 else "")
            return (
                f"job type {job_type!r} is not in the throughput table ({self.source}); "
                f"known job types include: {known}"
            )
        if gpu_type not in self._gpu_types:
            return (
                f"GPU type {gpu_type!r} is not in the throughput table ({self.source}); "
                f"it covers: {', '.join(self.gpu_types)}"
            )
        sfs = self.scale_factors(job_type)
        return (
            f"no throughput for {job_type!r} on {scale_factor} x {gpu_type}; "
            f"scale factors available for it: {sfs}"
        )

    def __len__(self) -> int:
        return self.frame.height

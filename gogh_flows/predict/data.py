"""Measured (or synthetic) throughputs arranged for learning, split by model family.

Why split by family: GOGH is judged on models it has never seen. A held-out family must
vanish from training completely -- as a job *and* as a co-location partner -- so
:meth:`MeasuredSet.without` drops every row that mentions it, and the evaluation builds
its training sets only through that method.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import polars as pl

from gogh_flows.truth.table import ThroughputTable
from gogh_flows.workloads.features import WorkloadFeatures
from gogh_flows.workloads.zoo import family_of, parse_job_kind, zoo_features


class UnknownJobFeaturesError(KeyError, ValueError):
    def __str__(self) -> str:  # KeyError would repr-quote the message
        return str(self.args[0])


def zoo_jobs(job_types: Iterable[str]) -> dict[str, WorkloadFeatures]:
    """Features for job types named like Gavel's (``"ResNet-50 (batch size 64)"``, ``"A3C"``)."""
    out: dict[str, WorkloadFeatures] = {}
    for name in job_types:
        try:
            family, bs, kind = parse_job_kind(name)
        except (KeyError, ValueError) as exc:
            raise UnknownJobFeaturesError(
                f"no layer features for job type {name!r}: it is not a zoo model. Pass its "
                "features explicitly (gogh_flows.workloads.extract_features(model, example_inputs))."
            ) from exc
        out[name] = zoo_features(family, bs, kind)
    return out


@dataclass(frozen=True)
class MeasuredSet:
    """Single-GPU isolated and pair throughputs of named jobs, with each job's features."""

    jobs: Mapping[str, WorkloadFeatures]
    gpus: tuple[str, ...]
    iso: pl.DataFrame  # job, gpu, throughput (> 0)
    pairs: pl.DataFrame  # job, partner, gpu, throughput, partner_throughput (both > 0), both orientations
    family: Mapping[str, str]

    @classmethod
    def from_table(
        cls, table: ThroughputTable, features: Mapping[str, WorkloadFeatures] | None = None
    ) -> MeasuredSet:
        names = table.job_types
        jobs = dict(features) if features is not None else {}
        missing = [n for n in names if n not in jobs]
        jobs.update(zoo_jobs(missing))
        f = table.frame.filter(pl.col("scale_factor") == 1)
        iso = (
            f.filter(pl.col("partner").is_null() & (pl.col("throughput") > 0))
            .select(job=pl.col("job_type"), gpu=pl.col("gpu_type"), throughput=pl.col("throughput"))
            .sort("job", "gpu")
        )
        p = f.filter(pl.col("partner").is_not_null() & (pl.col("throughput") > 0)
                     & (pl.col("partner_throughput") > 0))
        fwd = p.select(job=pl.col("job_type"), partner=pl.col("partner"), gpu=pl.col("gpu_type"),
                       throughput=pl.col("throughput"), partner_throughput=pl.col("partner_throughput"))
        rev = p.select(job=pl.col("partner"), partner=pl.col("job_type"), gpu=pl.col("gpu_type"),
                       throughput=pl.col("partner_throughput"), partner_throughput=pl.col("throughput"))
        pairs = pl.concat([fwd, rev]).unique(["job", "partner", "gpu"], keep="first").sort("job", "partner", "gpu")
        return cls(
            jobs={n: jobs[n] for n in names}, gpus=table.gpu_types, iso=iso, pairs=pairs,
            family={n: _family(n) for n in names},
        )

    @cached_property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.family.values())))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.jobs)

    def family_named(self, name: str, *, what: str = "model family") -> str:
        """This data set's spelling of family ``name``, matched case-insensitively as job names are."""
        wanted = name.strip().casefold()
        for family in self.families:
            if family.casefold() == wanted:
                return family
        raise ValueError(f"unknown {what} {name!r}; this data set has {list(self.families)} "
                         "(matched case-insensitively)")

    def of_family(self, family: str) -> tuple[str, ...]:
        return tuple(n for n in self.jobs if self.family[n] == family)

    def without(self, families: Iterable[str]) -> MeasuredSet:
        """Everything except the given families: their jobs, and every pair they are part of."""
        drop = {self.family_named(f) for f in families}
        keep = [n for n in self.jobs if self.family[n] not in drop]
        return self.subset(keep)

    def subset(self, names: Iterable[str]) -> MeasuredSet:
        keep = [n for n in names if n in self.jobs]
        return MeasuredSet(
            jobs={n: self.jobs[n] for n in keep}, gpus=self.gpus,
            iso=self.iso.filter(pl.col("job").is_in(keep)),
            pairs=self.pairs.filter(pl.col("job").is_in(keep) & pl.col("partner").is_in(keep)),
            family={n: self.family[n] for n in keep},
        )

    def isolated_matrix(self, names: Iterable[str] | None = None) -> np.ndarray:
        """``[J, G]`` measured isolated throughput, NaN where unknown."""
        names = tuple(names) if names is not None else self.names
        out = np.full((len(names), len(self.gpus)), np.nan)
        ji = {n: i for i, n in enumerate(names)}
        gi = {g: i for i, g in enumerate(self.gpus)}
        for j, g, t in self.iso.iter_rows():
            if j in ji:
                out[ji[j], gi[g]] = t
        return out

    def pair_tensor(self, names: Iterable[str] | None = None, partners: Iterable[str] | None = None) -> np.ndarray:
        """``[J, P, G]`` measured throughput of job j when sharing with partner p, NaN where unknown."""
        names = tuple(names) if names is not None else self.names
        partners = tuple(partners) if partners is not None else self.names
        out = np.full((len(names), len(partners), len(self.gpus)), np.nan)
        ji = {n: i for i, n in enumerate(names)}
        pi = {n: i for i, n in enumerate(partners)}
        gi = {g: i for i, g in enumerate(self.gpus)}
        for j, p, g, t, _ in self.pairs.iter_rows():
            if j in ji and p in pi:
                out[ji[j], pi[p], gi[g]] = t
        return out


def _family(job_type: str) -> str:
    try:
        return family_of(job_type)
    except (KeyError, ValueError):
        return job_type

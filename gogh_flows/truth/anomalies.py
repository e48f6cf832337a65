"""Entries of a measured throughput table that look like measurement artifacts, found and named.

Every predictor is trained and scored against the table, so an entry that cannot be right
(a job slower on a V100 than on a K80 when every other job is 2-12x faster there; a pair
whose co-located rate is 2% of the job's isolated one) bends both. Two checks, each with
its threshold in the report:

* **cross-type ratio**: for two GPU types ``a``, ``b`` on which the median job runs at least
  ``min_median_ratio`` times faster on ``b``, a job whose own ``b / a`` ratio is more than
  ``ratio_factor`` times below that median. On Gavel's ``simulation_throughputs.json``
  this finds Recommendation (V100/K80 0.66-1.05 against a median of about 3.5).
* **pair rate**: a co-located throughput below ``min_pair_rate`` of the same job's isolated
  throughput on that type (Gavel's physical file kept the simulation file's pair values
  while changing the isolated ones).

Flagged entries are reported; excluding them is the caller's choice
(``gogh predictors evaluate --exclude-anomalies``), and the report says which was made. A
flag is not proof: on the synthetic fleet the check flags A3C, whose host-bound step gains
little from a faster GPU by construction; on Gavel's measured file it flags only the
Recommendation entries above.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from gogh_flows.truth.table import ThroughputTable


@dataclass(frozen=True)
class Anomaly:
    kind: str  # "cross-type ratio" | "pair rate"
    job_type: str
    gpu_type: str  # the entry flagged: the job on this type (alone, or with ``partner``)
    partner: str | None
    value: float  # the job's ratio, or its co-located / isolated rate
    expected: float  # the median ratio it is compared with, or the rate threshold
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def find_anomalies(table: ThroughputTable, *, ratio_factor: float = 3.0, min_median_ratio: float = 1.5,
                   min_pair_rate: float = 0.05) -> list[Anomaly]:
    """Single-GPU entries of ``table`` that look like artifacts (module docstring)."""
    f = table.frame.filter((pl.col("scale_factor") == 1) & (pl.col("throughput") > 0))
    iso = f.filter(pl.col("partner").is_null())
    rate = {(j, g): t for j, g, t in iso.select("job_type", "gpu_type", "throughput").iter_rows()}
    jobs = sorted({j for j, _ in rate})
    gpus = list(table.gpu_types)
    found: list[Anomaly] = []
    for a in gpus:
        for b in gpus:
            if a == b:
                continue
            ratios = {j: rate[(j, b)] / rate[(j, a)] for j in jobs if (j, a) in rate and (j, b) in rate}
            if len(ratios) < 3:
                continue
            median = float(np.median(list(ratios.values())))
            if median < min_median_ratio:
                continue
            for j, r in sorted(ratios.items()):
                if r * ratio_factor < median:
                    found.append(Anomaly(
                        "cross-type ratio", j, b, None, r, median,
                        f"{j} runs {r:.2f}x as fast on {b} as on {a}; the median job {median:.2f}x "
                        f"(more than {ratio_factor:g}x below it)"))
    pairs = f.filter(pl.col("partner").is_not_null())
    for j, g, p, t in pairs.select("job_type", "gpu_type", "partner", "throughput").iter_rows():
        alone = rate.get((j, g))
        if alone and t / alone < min_pair_rate:
            found.append(Anomaly(
                "pair rate", j, g, p, t / alone, min_pair_rate,
                f"{j} next to {p} on {g} runs at {t / alone:.1%} of its isolated rate "
                f"(below {min_pair_rate:.0%})"))
    return found


def without_anomalies(table: ThroughputTable, anomalies: list[Anomaly]) -> ThroughputTable:
    """``table`` without the flagged entries: a flagged isolated entry takes the job's pairs on
    that type with it (their slowdowns are relative to it); a flagged pair, both its sides."""
    iso = {(a.job_type, a.gpu_type) for a in anomalies if a.partner is None}
    pair = {(a.job_type, a.gpu_type, a.partner) for a in anomalies if a.partner is not None}
    pair |= {(p, g, j) for j, g, p in pair}
    keep = []
    for row in table.frame.iter_rows(named=True):
        j, g, p = row["job_type"], row["gpu_type"], row["partner"]
        if (j, g) in iso or (p is not None and (p, g) in iso) or (p is not None and (j, g, p) in pair):
            continue
        keep.append(row)
    return ThroughputTable.from_rows(keep, source=f"{table.source} (without {len(anomalies)} flagged entries)")


__all__ = ["Anomaly", "find_anomalies", "without_anomalies"]

"""What a placement pays to turn the measurement table into observations, as the table grows.

Every placement reads the table's observations (``flows.observations.ObservationCache``), and
the table changes after every run, so the work is redone once per run. A soak review
(2026-12-07) measured the row-by-row version at about 20 us a row: a second per placement at
50,000 rows (about a month at a run a minute). The readers now filter in polars and parse each
distinct ``extra`` text once, in polars too. This script times, side by side in one process on
the same synthetic table: the readers as the product runs them (observations and limit
evidence), and the row-by-row parse they replaced (``iter_rows`` and a ``json.loads`` of each
row's ``extra``, the part that cost the time, without the rest of the work), kept here only as
the reference. (Keeping the texts already parsed between refreshes was tried: finding the new
ones among 50,000 cost as much as parsing them.)

Writes ``benchmarks/results/observation_scaling.{json,md}``.

    .venv/bin/python benchmarks/observation_scaling.py      # about 1 min on 2 cores
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_cap import save  # noqa: E402

from gogh_flows.flows.observations import _limit_evidence, _observations, _steady_rows  # noqa: E402

SIZES = (250, 2_000, 10_000, 50_000)
REPEATS = 3


def table(n: int, seed: int = 0) -> pl.DataFrame:
    """``n`` measurement rows shaped as the table holds them (extra as JSON text)."""
    rng = random.Random(seed)
    jobs = [f"ResNet-50 (batch size {b})" for b in (16, 32, 64, 128)] + [f"LM (batch size {b})" for b in (5, 10, 20)]
    gpus = ["h100", "a100", "l4", "t4", "v100"]
    rows = []
    for i in range(n):
        limit = rng.choice([None, 150.0, 200.0, 250.0])
        extra = {"attempt": "1", "policy": "gogh", "window_steps": f"{rng.uniform(50, 500):.6g}",
                 "energy_method": "model", "power_limit_w": "" if limit is None else f"{limit:g}",
                 "limit_slowdown": f"{rng.uniform(1.0, 1.3):.6g}", "device_energy_j": f"{rng.uniform(1e3, 1e5):.6g}"}
        rows.append({"key": f"run-{i}@gpu", "job_type": rng.choice(jobs), "gpu_type": rng.choice(gpus),
                     "partners": [] if rng.random() < 0.7 else [rng.choice(jobs)],
                     "throughput": rng.uniform(1, 50), "steps": 200.0, "mean_power_w": rng.uniform(50, 600),
                     "telemetry": "emulated", "window": "emulated", "extra": json.dumps(extra)})
    return pl.DataFrame(rows)


def polars_readers(frame: pl.DataFrame) -> int:
    rows = _steady_rows(frame)
    _limit_evidence(rows)
    return _observations(rows).height


def row_by_row(frame: pl.DataFrame) -> int:
    """The reference: each steady row as a dict, its ``extra`` parsed with ``json.loads``."""
    steady = frame.filter((pl.col("throughput") > 0) & (pl.col("steps") > 0))
    rows = list(steady.iter_rows(named=True))
    for r in rows:
        r["extra"] = json.loads(r["extra"])
    return len(rows)


def best_ms(fn, frame: pl.DataFrame) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(frame)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def main() -> dict:
    out = {"repeats": REPEATS, "sizes": {}}
    for n in SIZES:
        frame = table(n)
        new, old = best_ms(polars_readers, frame), best_ms(row_by_row, frame)
        out["sizes"][str(n)] = {"polars_ms": new, "row_by_row_ms": old, "ratio": old / new}
        print(f"{n:>6} rows: polars readers {new:8.1f} ms, row by row {old:8.1f} ms ({old / new:.1f}x)", flush=True)
    return out


def report(d: dict) -> list[str]:
    lines = ["# Observations from the measurement table, by its length", "",
             f"`benchmarks/observation_scaling.py`, best of {d['repeats']} on 2 shared cores, both ways in one "
             "process on the same synthetic table (the parquet read, 3-62 ms at these sizes in the soak review, "
             "is left out: the same for both).", "",
             "| rows | polars readers, observations and limit evidence (ms) | row-by-row parse alone (ms) "
             "| ratio |", "| ---: | ---: | ---: | ---: |"]
    for n, r in d["sizes"].items():
        lines.append(f"| {int(n):,} | {r['polars_ms']:.1f} | {r['row_by_row_ms']:.1f} | {r['ratio']:.1f}x |")
    per_row = [r["polars_ms"] / int(n) * 1e3 for n, r in d["sizes"].items() if int(n) >= 10_000]
    lines += ["", f"Polars readers: {statistics.fmean(per_row):.2f} us a row of the table at 10,000 rows and more."]
    return lines


if __name__ == "__main__":
    result = main()
    save("observation_scaling", result, report(result))

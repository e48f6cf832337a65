"""What logging one measurement costs a flow run (figures for docs/tracking.md).

Times `MeasurementLog.log` end to end on a local SQLite MLflow store, and its two halves
(the parquet append, the MLflow run), for a fresh table; then the append alone, and a read
of the whole table, on tables that already hold 1k / 10k / 100k rows, beside the layout
before it (one parquet file rewritten whole per append) timed in the same run. Also times
the fall-back path (MLflow unreachable -> spool) and `flush_spool`. All state lives in a
temp dir. Prints a summary and saves benchmarks/results/tracking_overhead.json.

    .venv/bin/python benchmarks/tracking_overhead.py [--n 300] [--sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

import mlflow  # noqa: E402
import polars as pl  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

from gogh_flows.tracking.measurements import SCHEMA, Measurement, MeasurementLog  # noqa: E402
from gogh_flows.tracking.table import FANOUT, PARTS_PER_SEGMENT, MeasurementTable  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def sample(i: int, prefix: str = "bench") -> Measurement:
    return Measurement(
        run_id=f"{prefix}-{i}", flow_name="train", job_type="resnet18", family="resnet", batch_size=64,
        gpu_id=f"gpu-{i % 8}", gpu_type="V100", device="cuda:0", partners=("lm",), required_throughput=10.0,
        predicted_throughput=12.0, steps=500.0, duration_s=20.0, throughput=25.0, mean_power_w=210.0,
        energy_j=4200.0, status="completed", telemetry="emulated", started_at=1.7e9 + i,
    )


def stats_ms(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": ms[len(ms) // 2],
        "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
        "max_ms": ms[-1],
    }


def prefill(log: MeasurementLog, rows: int) -> None:
    """A table of `rows` measurements as appends would have left it: merged segments, every key claimed."""
    frame = pl.DataFrame([{**sample(i, "old").to_row(), "logged_at": 0.0} for i in range(rows)], schema=SCHEMA)
    done, level = 0, 0
    chunk = PARTS_PER_SEGMENT
    while chunk * FANOUT <= rows:
        chunk *= FANOUT
        level += 1
    while done < rows:  # the largest segments first, as levels of a merged table
        while chunk > rows - done and level > 0:
            chunk //= FANOUT
            level -= 1
        part = frame.slice(done, chunk)
        MeasurementTable._write(part, log.table.segments_dir, f"L{level:02d}-{done:020d}-prefill")
        done += part.height
    for key in frame["key"].to_list():
        log.table._claim(key)


def rewrite_whole(path: Path, m: Measurement) -> None:
    """What an append cost before: read the one file, add the row, write it all, rename over."""
    old = pl.read_parquet(path)
    new = pl.concat([old, pl.DataFrame([{**m.to_row(), "logged_at": time.time()}], schema=SCHEMA)])
    tmp = path.with_suffix(".tmp")
    new.write_parquet(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300,
                    help="measurements per case (more than one merge's worth of parts, %d)" % PARTS_PER_SEGMENT)
    ap.add_argument("--sizes", default="1000,10000,100000", help="rows already in the table, comma-separated")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gogh-tracking-bench-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    MlflowClient(uri).search_experiments()  # create the schema outside the timings

    mlog = MeasurementLog(uri, tmp / "fresh")
    mlog.log(sample(-1))  # first call creates the experiment
    results: dict[str, dict[str, float]] = {}
    results["log (parquet + MLflow), fresh table"] = stats_ms([timed(mlog.log, sample(i)) for i in range(args.n)])
    results["parquet append only, fresh table"] = stats_ms(
        [timed(mlog._append, sample(i, "append")) for i in range(args.n)]
    )
    results["MLflow run only"] = stats_ms(
        [timed(lambda m: mlog._write_mlflow(m, check_existing=False), sample(i, "mlflow")) for i in range(args.n)]
    )

    sizes = [int(x) for x in args.sizes.split(",") if x]
    for size in sizes:
        big = MeasurementLog(uri, tmp / f"big-{size}")
        prefill(big, size)
        results[f"append, table of {size} rows"] = stats_ms(
            [timed(big._append, sample(i, "append")) for i in range(args.n)])
        results[f"read whole table, {size} rows"] = stats_ms([timed(big.read) for _ in range(5)])
        one_file = tmp / f"one-file-{size}.parquet"
        pl.DataFrame([{**sample(i, "old").to_row(), "logged_at": 0.0} for i in range(size)],
                     schema=SCHEMA).write_parquet(one_file)
        results[f"rewrite whole (earlier layout), {size} rows"] = stats_ms(
            [timed(rewrite_whole, one_file, sample(i, "rewrite")) for i in range(min(args.n, 50))])

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    down = MeasurementLog(f"http://127.0.0.1:{dead_port}", tmp / "down")
    logging.getLogger("gogh_flows.tracking").setLevel(logging.ERROR)  # one "spooled" warning per measurement
    results["log with MLflow unreachable (spooled)"] = stats_ms(
        [timed(down.log, sample(i, "down")) for i in range(args.n)]
    )
    back = MeasurementLog(uri, tmp / "down")
    t0 = time.perf_counter()
    flushed = back.flush_spool()
    flush_s = time.perf_counter() - t0

    report = {
        "meta": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mlflow": mlflow.__version__,
            "polars": pl.__version__,
            "backend": "sqlite (local file)",
            "n": args.n,
            "table_sizes": sizes,
            "parts_per_segment": PARTS_PER_SEGMENT,
            "fanout": FANOUT,
        },
        "cases": results,
        "flush_spool": {"written": flushed, "total_s": flush_s, "per_measurement_ms": 1000 * flush_s / max(flushed, 1)},
    }
    for label, r in results.items():
        print(f"{label:48s} mean {r['mean_ms']:7.1f} ms  p50 {r['p50_ms']:7.1f} ms  p95 {r['p95_ms']:7.1f} ms"
              f"  max {r['max_ms']:7.1f} ms")
    print(f"{'flush_spool':48s} {flushed} written in {flush_s:.2f} s "
          f"({report['flush_spool']['per_measurement_ms']:.1f} ms each)")
    OUT.mkdir(exist_ok=True)
    (OUT / "tracking_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {OUT / 'tracking_overhead.json'}")


if __name__ == "__main__":
    main()

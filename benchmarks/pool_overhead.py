"""Round-trip cost of running a body on a warm emulated GPU pool (figures for docs/runtime.md).

Times ``pool.submit(trivial).result()``: scheduling on the pinned worker, the
worker-side wrapper (context, occupancy, emulated telemetry) and the way back,
next to a bare ``client.submit`` on the same cluster so the wrapper's share is
visible. One run at a time; threads (the default pool); synthetic truth.
Prints the figures and saves them to benchmarks/results/pool_overhead.json.

    .venv/bin/python benchmarks/pool_overhead.py [--n 500] [--warmup 50] [--fleet v100=2,t4=2,k80=2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import distributed

from gogh_flows.runtime import current_gpu, emulated_pool, parse_fleet
from gogh_flows.truth.synthetic import synthetic_table

OUT = Path(__file__).resolve().parent / "results"


def trivial() -> int:
    current_gpu().report(1)
    return 1


def bare() -> int:
    return 1


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))] * 1e3

    return {"p50_ms": q(0.50), "p90_ms": q(0.90), "p99_ms": q(0.99), "mean_ms": statistics.fmean(s) * 1e3,
            "n": len(s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--fleet", default="v100=2,t4=2,k80=2")
    args = ap.parse_args()
    t0 = time.perf_counter()
    truth = synthetic_table(sorted(parse_fleet(args.fleet)))  # built once, outside the start-up figure
    truth_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with emulated_pool(args.fleet, truth=truth) as pool:
        startup_s = time.perf_counter() - t0
        gpus = pool.gpu_ids
        for i in range(args.warmup):
            pool.submit(trivial, gpu_id=gpus[i % len(gpus)], job_type="A3C").result()
            pool.client.submit(bare, workers=[gpus[i % len(gpus)]], pure=False).result()
        wrapped, raw = [], []
        for i in range(args.n):  # interleaved, so background load hits both alike
            g = gpus[i % len(gpus)]
            t = time.perf_counter()
            pool.submit(trivial, gpu_id=g, job_type="A3C").result()
            wrapped.append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.client.submit(bare, workers=[g], allow_other_workers=False, pure=False).result()
            raw.append(time.perf_counter() - t)
    result = {
        "meta": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "distributed": distributed.__version__, "fleet": args.fleet, "mode": "emulated (threads, inproc)",
                 "n": args.n, "warmup": args.warmup,
                 "note": "machine shared with other jobs; wall-clock figures include their load"},
        "truth_build_s": truth_s,
        "pool_startup_s": startup_s,
        "pool_submit_result": _percentiles(wrapped),
        "bare_client_submit_result": _percentiles(raw),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "pool_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    w, r = result["pool_submit_result"], result["bare_client_submit_result"]
    print(f"synthetic truth: {truth_s:.2f} s; pool startup ({args.fleet}): {startup_s:.2f} s")
    print(f"pool.submit(trivial).result():   p50 {w['p50_ms']:.2f} ms  p99 {w['p99_ms']:.2f} ms  (n={w['n']})")
    print(f"client.submit(bare).result():    p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms")
    print(f"saved {OUT / 'pool_overhead.json'}")


if __name__ == "__main__":
    main()

"""Decision time of the GOGH optimiser as the fleet grows (figures for docs/performance.md).

For each fleet size G: a busy fleet (1.4 G running jobs: every GPU busy, most
shared, so arrivals can only join half-full GPUs) with 1 or 64 arrivals, and a
half-loaded fleet (0.5 G running) with 64 arrivals, where free GPUs, joins and
pairs of arrivals all compete. Synthetic fleet of all eight catalog GPU types.
Prints a markdown table and saves it with the raw JSON under benchmarks/results/.

    .venv/bin/python benchmarks/placement_scaling.py [--repeat 10] [--sizes 64,256,1024,4096]

The two target cases run twice, side by side: without power limits and with the
optimiser choosing each GPU's limit too (levels of ``sim.run.DEFAULT_LIMIT_LEVELS``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from gogh_flows.placement.bench import bench_placement
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS
from gogh_flows.truth.synthetic import synthetic_table

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--sizes", default="64,256,1024,4096")
    ap.add_argument("--time-limit", type=float, default=2.0)
    args = ap.parse_args()
    table = synthetic_table()
    limits = tuple(DEFAULT_LIMIT_LEVELS)
    cases = [("target: 1 arrival, 256 GPUs, 400 running", 256, 400, 1, ()),
             ("target: 1 arrival, 256 GPUs, 400 running, power limits", 256, 400, 1, limits),
             ("target: 64 arrivals, 1024 GPUs, 1500 running", 1024, 1500, 64, ()),
             ("target: 64 arrivals, 1024 GPUs, 1500 running, power limits", 1024, 1500, 64, limits)]
    for g in (int(s) for s in args.sizes.split(",")):
        cases += [(f"busy fleet: {g} GPUs, 1 arrival", g, int(1.4 * g), 1, ()),
                  (f"busy fleet: {g} GPUs, 64 arrivals", g, int(1.4 * g), 64, ()),
                  (f"half-loaded: {g} GPUs, 64 arrivals", g, int(0.5 * g), 64, ())]
    rows = []
    for label, g, r, a, levels in cases:
        t0 = time.perf_counter()
        res = bench_placement(table, gpus=g, running=r, arrivals=a, repeat=args.repeat,
                              seed=0, time_limit_s=args.time_limit, power_limit_levels=levels)
        res["label"] = label
        res["bench_wall_s"] = time.perf_counter() - t0
        rows.append(res)
        print(f"{label:48s} p50 {res['p50_ms']:9.1f} ms  p99 {res['p99_ms']:9.1f} ms  "
              f"max gap {res['max_gap']}  placed {res['mean_placed']:.1f}/{a}  {res['status']}")
    OUT.mkdir(exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "repeat": args.repeat, "time_limit_s": args.time_limit}
    (OUT / "placement_scaling.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| case | GPUs | running | arrivals | p50 ms | p99 ms | max gap | placed (mean) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gap = "n/a" if r["max_gap"] is None else f"{r['max_gap']:.2%}"
        lines.append(f"| {r['label']} | {r['gpus']} | {r['running']} | {r['arrivals']} | "
                     f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {gap} | {r['mean_placed']:.1f} |")
    (OUT / "placement_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

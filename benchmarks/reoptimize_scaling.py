"""Fleet-level re-optimisation time at the issue's size (docs/performance.md).

1,024 GPUs of all eight catalog types with 1,500 running jobs (synthetic fleet, seeded
problems of ``placement.generate``), re-solved together by ``placement.reoptimize`` with a
budget of 64 moves, without and with power limits chosen (levels of
``sim.run.DEFAULT_LIMIT_LEVELS``), side by side in one run. Prints a markdown table and saves
it with the raw JSON under benchmarks/results/.

    .venv/bin/python benchmarks/reoptimize_scaling.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from gogh_flows.placement.generate import random_problem
from gogh_flows.placement.reoptimize import reoptimize
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS
from gogh_flows.truth.synthetic import synthetic_table

OUT = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--running", type=int, default=1500)
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args()
    table = synthetic_table()
    rows = []
    for label, levels in (("moves only", ()), ("moves and power limits", tuple(DEFAULT_LIMIT_LEVELS))):
        ms, gaps, moves, limits, saved = [], [], [], [], []
        for seed in range(args.repeat):
            problem = random_problem(table, num_gpus=args.gpus, running=args.running, arrivals=0, seed=seed)
            problem = dataclasses.replace(problem, power_limit_levels=levels)
            t0 = time.perf_counter()
            plan = reoptimize(problem, budget=args.budget)
            ms.append((time.perf_counter() - t0) * 1e3)
            gaps.append(plan.gap)
            moves.append(len(plan.moves))
            limits.append(len(plan.limits))
            saved.append(plan.saving_j / 3.6e6)
        row = {"case": label, "gpus": args.gpus, "running": args.running, "budget": args.budget,
               "p50_ms": float(np.percentile(ms, 50)), "max_ms": float(max(ms)), "max_gap": float(max(gaps)),
               "moves_mean": float(np.mean(moves)), "limit_changes_mean": float(np.mean(limits)),
               "predicted_saving_kwh_mean": float(np.mean(saved))}
        rows.append(row)
        print(row)
    lines = ["| case | GPUs | running | budget | p50 ms | max ms | max gap | moves | limit changes | predicted saving kWh |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['gpus']} | {r['running']} | {r['budget']} | {r['p50_ms']:.0f} | "
                     f"{r['max_ms']:.0f} | {r['max_gap']:.2%} | {r['moves_mean']:.1f} | "
                     f"{r['limit_changes_mean']:.0f} | {r['predicted_saving_kwh_mean']:.1f} |")
    OUT.mkdir(exist_ok=True)
    (OUT / "reoptimize_scaling.json").write_text(json.dumps({"repeat": args.repeat, "rows": rows}, indent=2) + "\n")
    (OUT / "reoptimize_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

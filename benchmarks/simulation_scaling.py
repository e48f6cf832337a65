"""Simulator run time (figures for docs/performance.md).

* The largest MSR/Philly trace (2,000 lines; jobs needing more than 8 GPUs are dropped
  with a warning) on a 900-GPU fleet (300 V100, 300 P100, 300 K80, Gavel's heterogeneous
  Philly spec), Gavel's measured throughputs, policy ``oracle``.
* Generated Poisson streams of 100, 1,000 and 10,000 jobs (Philly durations and GPU
  counts) on the same fleet, to show how cost grows.

    .venv/bin/python benchmarks/simulation_scaling.py [--sizes 100,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from gogh_flows.sim.run import (
    best_isolated,
    parse_cluster,
    prepare_jobs,
    reference_throughput,
    run_policies,
)
from gogh_flows.sim.traces import (
    generate_arrivals,
    load_philly_distribution,
    read_trace,
)
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

OUT = Path(__file__).resolve().parent / "results"
CLUSTER = "v100=300,p100=300,k80=300"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,1000,10000")
    # 5 jobs/h keeps the 900-GPU fleet at about 55% load (Philly jobs average 100 GPU-hours).
    ap.add_argument("--rate", type=float, default=5.0, help="generated arrivals per hour")
    args = ap.parse_args()
    data = gavel_dir()
    truth = read_gavel_json(data / "simulation_throughputs.json")
    gpus = parse_cluster(CLUSTER)
    best = best_isolated(truth, gpus)

    def ready(jobs, notes: list[str]):
        """Requirements for this fleet; every warning (jobs dropped, and why) becomes a note."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = prepare_jobs(jobs, truth, gpus, seed=0)
        notes += [str(w.message) for w in caught]
        return out

    cases = []
    msr = max(sorted((data / "traces" / "msr").rglob("*.trace")), key=lambda p: p.stat().st_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raw = read_trace(msr, max_gpus=8)
    notes = [str(w.message) for w in caught]
    cases.append((f"MSR trace {msr.name}", ready(raw, notes), notes))
    dist = load_philly_distribution(data / "traces" / "philly_job_distribution.csv")
    types_ok = [j for j in truth.job_types if best(j, 1) > 0]
    for n in (int(s) for s in args.sizes.split(",")):
        gen = generate_arrivals(n, rate_per_hour=args.rate, job_types=types_ok, distribution=dist,
                                seed=0, throughput_of=reference_throughput(truth, "v100"))
        notes = []
        cases.append((f"generated {n} jobs ({args.rate:g}/h)", ready(gen, notes), notes))

    rows = []
    for label, jobs, notes in cases:
        t0 = time.perf_counter()
        res = run_policies(jobs, gpus, truth, ["oracle"])["oracle"]
        wall = time.perf_counter() - t0
        s = res.summary()
        rows.append({"case": label, "jobs": len(jobs), "wall_s": wall, "decisions": len(res.decision_ms),
                     "decision_p50_ms": s["decision_p50_ms"], "decision_p99_ms": s["decision_p99_ms"],
                     "jobs_completed": s["jobs_completed"], "notes": notes})
        print(f"{label:40s} {len(jobs):6d} jobs  {wall:7.1f} s  {len(res.decision_ms):6d} decisions  "
              f"p50 {s['decision_p50_ms']:.1f} ms  p99 {s['decision_p99_ms']:.1f} ms  {notes}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "simulation_scaling.json").write_text(json.dumps({"cluster": CLUSTER, "rows": rows}, indent=2))
    lines = ["| case | jobs | wall s | decisions | decision p50 ms | p99 ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['case']} | {r['jobs']} | {r['wall_s']:.1f} | {r['decisions']} | "
              f"{r['decision_p50_ms']:.1f} | {r['decision_p99_ms']:.1f} |" for r in rows]
    (OUT / "simulation_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

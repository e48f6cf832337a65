"""Decision time of each peer's allocation at 64 / 256 / 1,024 GPUs (docs/performance.md).

A peer decides at each allocation reset for every active job at once, so its decision
time is one ``allocate`` call on the whole fleet's state: here 1.5 active jobs per GPU
(1,536 on 1,024 GPUs, near docs/performance.md's 1,500 running), job types drawn from
Gavel's table (one GPU each, one in ten on 2 and one in twenty on 4), GPU types V100,
P100 and K80 in the testbed's 1:2:3. All peers on one state per size, in one process;
the median of ``REPEATS`` calls. Writes ``benchmarks/results/peer_scaling.{json,md}``.

    .venv/bin/python benchmarks/peer_scaling.py
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from gogh_flows.energy import EnergyModel
from gogh_flows.placement.problem import TableThroughputs
from gogh_flows.sim.rounds import AllocationState, round_order
from gogh_flows.sim.run import PEER_POLICIES, make_peer
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

OUT = Path(__file__).resolve().parent / "results"
SIZES = (64, 256, 1024)
JOBS_PER_GPU = 1.5
REPEATS = 3


def state(n_gpus: int, truth, rng: random.Random) -> AllocationState:
    types = round_order(["v100", "p100", "k80"])
    cap = {"v100": n_gpus // 6, "p100": n_gpus // 3}
    cap["k80"] = n_gpus - cap["v100"] - cap["p100"]
    job_types = list(truth.job_types)
    energy, view = EnergyModel(), TableThroughputs(truth)
    rows, watts, scale = [], [], []
    while len(rows) < int(JOBS_PER_GPU * n_gpus):
        jt = rng.choice(job_types)
        u = rng.random()
        n = 4 if u < 0.05 else 2 if u < 0.15 else 1
        rate = [truth.isolated(jt, t, n) if truth.has(jt, t, n) else 0.0 for t in types]
        if max(rate) <= 0:
            continue
        act = [view.table.activity(jt, t) or view.default_activity for t in types]
        rows.append(rate)
        watts.append([energy.power_alone(t, a) * n for t, a in zip(types, act)])
        scale.append(n)
    m = len(rows)
    rate = np.array(rows)
    return AllocationState(
        now_s=0.0, job_ids=tuple(f"j{i}" for i in range(m)), types=tuple(types), rate=rate,
        watts=np.array(watts), scale=np.array(scale, dtype=float),
        remaining=np.array([rng.uniform(1e4, 1e6) for _ in range(m)]),
        required=rate.max(axis=1) * np.array([rng.uniform(0.2, 0.9) for _ in range(m)]),
        arrival_s=np.arange(m, dtype=float), capacity=np.array([cap[t] for t in types], dtype=float))


def main() -> None:
    truth = read_gavel_json(gavel_dir() / "simulation_throughputs.json")
    out: dict[str, dict[str, float]] = {}
    for n in SIZES:
        st = state(n, truth, random.Random(n))
        for name in PEER_POLICIES:
            times = []
            for _ in range(REPEATS):
                pol = make_peer(name)
                t0 = time.perf_counter()
                pol.allocate(st)
                times.append((time.perf_counter() - t0) * 1e3)
            out.setdefault(name, {})[str(n)] = statistics.median(times)
        print(f"{n} GPUs, {len(st.job_ids)} jobs: " +
              ", ".join(f"{k} {v[str(n)]:.1f} ms" for k, v in out.items()), flush=True)
    (OUT / "peer_scaling.json").write_text(json.dumps(
        {"jobs_per_gpu": JOBS_PER_GPU, "repeats": REPEATS, "median_ms": out}, indent=2) + "\n")
    lines = ["| peer | " + " | ".join(f"{n} GPUs ({int(JOBS_PER_GPU * n)} jobs)" for n in SIZES) + " |",
             "| --- |" + " ---: |" * len(SIZES)]
    for name, row in out.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[str(n)]:.1f} ms" for n in SIZES) + " |")
    (OUT / "peer_scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

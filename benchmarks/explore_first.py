"""Choosing the observation (issue 13, item 4): does measuring a new job type first on the
fleet's middle GPU type pay, in the simulator?

Scenario (e) of docs/evaluation.md, as ``benchmarks/risk_tradeoff.py``: Gavel's physical-
cluster trace on its testbed, every job re-labelled to one model family that P1 and P2 are
trained here without (with the ensemble the product predicts with). ``gogh`` against
``gogh-explore``: the same learned policy, except that
a job type nothing was measured of is offered only the middle GPU type by FP32 peak (the
P100 here; ``sim.learned.middle_types``: parameter-free, not chosen on these runs) when it is
predicted to meet the job's requirement there; once a job of the type has been measured the
whole fleet is open again. ``oracle`` for reference; noise 0 and 0.1; energy over one common
window. Writes ``benchmarks/results/explore_first.{json,md}``.

    .venv/bin/python benchmarks/explore_first.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gogh_flows.placement import GoghOptimizer
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig, attainment_text, simulate
from gogh_flows.sim.holdout import train_holdout
from gogh_flows.sim.learned import LearnedThroughputs, middle_types
from gogh_flows.sim.run import parse_cluster, run_policies
from gogh_flows.sim.traces import read_trace
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs  # noqa: E402 - one definition

OUT = Path(__file__).resolve().parent / "results"
CLUSTER = "v100=8,p100=16,k80=24"


def main() -> None:
    t_all = time.perf_counter()
    data = gavel_dir()
    gavel = read_gavel_json(data / "simulation_throughputs.json")
    gpus = parse_cluster(CLUSTER)
    types = sorted({g.gpu_type for g in gpus})
    middle = middle_types(types)
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    rows = []
    for fam in HOLDOUTS:
        # with the ensemble and intervals, as `gogh predictors train` ships a prior (point predictions here)
        pred = train_holdout(gavel, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
        jobs = holdout_jobs(gavel, raw, fam, CLUSTER, [])
        for noise in (0.0, 0.1):
            config = SimConfig(seed=SEED, noise=noise)
            results = run_policies(jobs, gpus, gavel, ["oracle", "gogh"], config=config, predictors=pred)
            explore = LearnedThroughputs(pred, types, refine=True, explore_types=middle)
            results["gogh-explore"] = simulate(jobs, gpus, gavel, GoghOptimizer(name="gogh-explore"),
                                               planning=explore, config=config)
            accounts = energy_accounts(results, references=("oracle",))
            for name, r in results.items():
                s = r.summary()
                rows.append({"family": fam, "noise": noise, "policy": name,
                             "sla_attainment": s["sla_attainment"], "met_on_average": s["met_on_average"],
                             "parked_vs_oracle": accounts[name].parked_vs["oracle"],
                             "on_vs_oracle": accounts[name].always_on_vs["oracle"],
                             "avg_jct_h": s["avg_jct_s"] / 3600, "avg_queue_h": s["avg_queue_s"] / 3600,
                             "migrations": s["migrations"], "unfinished": s["jobs_unfinished"]})
        print(f"{fam} done ({time.perf_counter() - t_all:.0f} s)", flush=True)
    lines = [f"Middle type: {', '.join(middle)}.", "",
             "| held-out family | noise | policy | SLA attainment | energy parked vs oracle | "
             "energy always on vs oracle | avg JCT h | avg queue h | migrations | unfinished |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['noise']:g} | {r['policy']} | {attainment_text(r['sla_attainment'])} | "
                     f"{r['parked_vs_oracle']:.3f} | {r['on_vs_oracle']:.3f} | {r['avg_jct_h']:.2f} | "
                     f"{r['avg_queue_h']:.2f} | {r['migrations']} | {r['unfinished']} |")
    lines += ["", "| noise | policy | worst SLA | mean SLA | mean parked vs oracle | worst parked vs oracle | "
              "migrations (sum) |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    summary = []
    for noise in (0.0, 0.1):
        for name in ("gogh", "gogh-explore"):
            sel = [r for r in rows if r["noise"] == noise and r["policy"] == name]
            row = {"noise": noise, "policy": name, "worst_sla": min(r["sla_attainment"] for r in sel),
                   "mean_sla": sum(r["sla_attainment"] for r in sel) / len(sel),
                   "mean_parked_vs_oracle": sum(r["parked_vs_oracle"] for r in sel) / len(sel),
                   "worst_parked_vs_oracle": max(r["parked_vs_oracle"] for r in sel),
                   "migrations": sum(r["migrations"] for r in sel)}
            summary.append(row)
            lines.append(f"| {noise:g} | {name} | {attainment_text(row['worst_sla'])} | {attainment_text(row['mean_sla'])} | "
                         f"{row['mean_parked_vs_oracle']:.3f} | {row['worst_parked_vs_oracle']:.3f} | "
                         f"{row['migrations']} |")
    wall = time.perf_counter() - t_all
    (OUT / "explore_first.json").write_text(json.dumps({"middle": middle, "rows": rows, "summary": summary,
                                                        "wall_s": wall}, indent=2) + "\n")
    (OUT / "explore_first.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{wall:.0f} s")


if __name__ == "__main__":
    main()

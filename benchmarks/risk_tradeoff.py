"""Planning with margin, in the simulator: SLA attainment and energy against ``oracle``
when the learned ``gogh`` policy plans at the lower end of the refiner's interval.

Scenario (e) of docs/evaluation.md: Gavel's physical-cluster trace on its testbed, every job
re-labelled to one model family that the predictors are trained here without (P1 and P2 as
``gogh predictors train`` trains them, with P2's intervals calibrated on the remaining
families only). For each held-out family and measurement noise 0 and 0.1: ``oracle`` and
``gogh`` at risk level none (the point prediction), 0.5, 0.8 and 0.9, on the identical
jobs. Energy over one common window per (family, noise) run (``sim.account``), parked and
always on. Writes ``benchmarks/results/risk_tradeoff.{json,md}``.

    .venv/bin/python benchmarks/risk_tradeoff.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gogh_flows.progress import Progress
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig
from gogh_flows.sim.holdout import family_types, relabel_to_family, train_holdout
from gogh_flows.sim.run import parse_cluster, reference_throughput, run_policies
from gogh_flows.sim.traces import read_trace
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, P1_EPOCHS, P2_EPOCHS, SEED, _prepare  # noqa: E402 - one definition

OUT = Path(__file__).resolve().parent / "results"
CLUSTER = "v100=8,p100=16,k80=24"
RISKS = (None, 0.5, 0.8, 0.9)
NOISES = (0.0, 0.1)


def main() -> None:
    t_all = time.perf_counter()
    data = gavel_dir()
    gavel = read_gavel_json(data / "simulation_throughputs.json")
    gpus = parse_cluster(CLUSTER)
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    rows: list[dict] = []
    with Progress() as bars:
        for k, fam in enumerate(HOLDOUTS):
            bars.update("families", k, len(HOLDOUTS))
            t0 = time.perf_counter()
            pred = train_holdout(gavel, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
            train_s = time.perf_counter() - t0
            jobs = relabel_to_family(raw, family_types(gavel, fam), reference_throughput(gavel, "v100"), seed=SEED)
            jobs = _prepare(gavel, CLUSTER, jobs, [])
            for noise in NOISES:
                config = SimConfig(seed=SEED, noise=noise)
                results = run_policies(jobs, gpus, gavel, ["oracle"], config=config)
                for risk in RISKS:
                    label = "gogh" if risk is None else f"gogh@{risk:g}"
                    results[label] = run_policies(jobs, gpus, gavel, ["gogh"], config=config, predictors=pred,
                                                  risk_level=risk)["gogh"]
                accounts = energy_accounts(results, references=("oracle",))
                for name, r in results.items():
                    s, a = r.summary(), accounts[name]
                    rows.append({"family": fam, "noise": noise, "policy": name,
                                 "risk_level": None if name in ("oracle", "gogh") else float(name.split("@")[1]),
                                 "sla_attainment": s["sla_attainment"], "met_on_average": s["met_on_average"],
                                 "parked_vs_oracle": a.parked_vs["oracle"], "on_vs_oracle": a.always_on_vs["oracle"],
                                 "avg_jct_h": s["avg_jct_s"] / 3600, "migrations": s["migrations"],
                                 "unfinished": s["jobs_unfinished"], "train_s": train_s})
            print(f"{fam}: training {train_s:.0f} s, total {time.perf_counter() - t0:.0f} s", flush=True)
        bars.update("families", len(HOLDOUTS), len(HOLDOUTS))
    lines = ["| held-out family | noise | policy | SLA attainment | met on average | energy parked vs oracle | "
             "energy always on vs oracle | avg JCT h | migrations | unfinished |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['noise']:g} | {r['policy']} | {r['sla_attainment']:.4f} | "
                     f"{r['met_on_average']:.3f} | {r['parked_vs_oracle']:.3f} | {r['on_vs_oracle']:.3f} | "
                     f"{r['avg_jct_h']:.2f} | {r['migrations']} | {r['unfinished']} |")
    # per policy and noise, over the families: the worst SLA attainment and the worst energy
    lines += ["", "Over the held-out families (worst family):", "",
              "| noise | policy | worst SLA attainment | mean SLA attainment | worst parked vs oracle | "
              "mean parked vs oracle |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    summary = []
    for noise in NOISES:
        for name in ("gogh", *(f"gogh@{r:g}" for r in RISKS if r is not None)):
            sel = [r for r in rows if r["noise"] == noise and r["policy"] == name]
            sla = [r["sla_attainment"] for r in sel]
            en = [r["parked_vs_oracle"] for r in sel]
            row = {"noise": noise, "policy": name, "worst_sla": min(sla), "mean_sla": sum(sla) / len(sla),
                   "worst_parked_vs_oracle": max(en), "mean_parked_vs_oracle": sum(en) / len(en)}
            summary.append(row)
            lines.append(f"| {noise:g} | {name} | {row['worst_sla']:.4f} | {row['mean_sla']:.4f} | "
                         f"{row['worst_parked_vs_oracle']:.3f} | {row['mean_parked_vs_oracle']:.3f} |")
    wall = time.perf_counter() - t_all
    (OUT / "risk_tradeoff.json").write_text(json.dumps({"rows": rows, "summary": summary, "wall_s": wall,
                                                        "cluster": CLUSTER, "seed": SEED}, indent=2) + "\n")
    (OUT / "risk_tradeoff.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{wall:.0f} s")


if __name__ == "__main__":
    main()

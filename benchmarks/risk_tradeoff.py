"""Planning with margin, in the simulator: SLA attainment and energy against ``oracle``
when the learned ``gogh`` policy plans at the lower end of the refiner's interval.

Scenario (e) of docs/evaluation.md: Gavel's physical-cluster trace on its testbed, every job
re-labelled to one model family that the predictors are trained here without (P1 and P2 as
``gogh predictors train`` trains them, with P2's intervals calibrated on the remaining
families only). For each held-out family and measurement noise 0 and 0.1: ``oracle`` and
``gogh`` at risk level none (the point prediction), 0.5, 0.8 and 0.9, on the identical
jobs. Energy over one common window per (family, noise) run (``sim.account``), parked and
always on. Writes ``benchmarks/results/risk_tradeoff.{json,md}``.

The level is chosen on another truth, never on the reported one: ``--truth synthetic`` runs
the same study on the synthetic fleet (the zoo's synthetic throughputs, five GPU generations;
``risk_tradeoff_synthetic.{json,md}``) and applies the rule of :func:`choose_level` to it; the
Gavel run then reports the level so chosen beside the others.

    .venv/bin/python benchmarks/risk_tradeoff.py --truth synthetic   # chooses the level
    .venv/bin/python benchmarks/risk_tradeoff.py                     # reports on Gavel's data
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gogh_flows.progress import Progress
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig, attainment_text
from gogh_flows.sim.holdout import train_holdout
from gogh_flows.sim.run import parse_cluster, run_policies
from gogh_flows.sim.traces import read_trace
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json
from gogh_flows.truth.synthetic import synthetic_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs  # noqa: E402 - one definition

OUT = Path(__file__).resolve().parent / "results"
CLUSTERS = {"gavel": "v100=8,p100=16,k80=24", "synthetic": "h100=4,a100=8,v100=8,t4=12,k80=16"}
RISKS = (None, 0.5, 0.8, 0.9)
NOISES = (0.0, 0.1)
SLA_BAR, ENERGY_BAR = 0.98, 1.05  # issue 13: every held-out family at noise 0.1, parked vs oracle


def choose_level(summary: list[dict]) -> dict:
    """The rule, fixed before any Gavel figure is read: at noise 0.1, the levels whose worst
    held-out family keeps SLA attainment >= 0.98 and parked energy <= 1.05 of ``oracle``;
    among them the least mean energy (ties: the lower level). None meets both: the level with
    the best worst-family attainment."""
    levels = [r for r in summary if r["noise"] == 0.1 and r["policy"] != "gogh"]
    ok = [r for r in levels if r["worst_sla"] >= SLA_BAR and r["worst_parked_vs_oracle"] <= ENERGY_BAR]
    pick = (min(ok, key=lambda r: (round(r["mean_parked_vs_oracle"], 4), r["policy"])) if ok
            else max(levels, key=lambda r: r["worst_sla"]))
    return {"risk_level": float(pick["policy"].split("@")[1]), "meets_bars": bool(ok), **pick}


def main(truth_name: str = "gavel") -> None:
    t_all = time.perf_counter()
    data = gavel_dir()  # the trace and the Philly figures come from Gavel's data either way
    cluster = CLUSTERS[truth_name]
    gpus = parse_cluster(cluster)
    truth = (read_gavel_json(data / "simulation_throughputs.json") if truth_name == "gavel"
             else synthetic_table(list(dict.fromkeys(g.gpu_type for g in gpus))))
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    rows: list[dict] = []
    with Progress() as bars:
        for k, fam in enumerate(HOLDOUTS):
            bars.update("families", k, len(HOLDOUTS))
            t0 = time.perf_counter()
            pred = train_holdout(truth, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
            train_s = time.perf_counter() - t0
            jobs = holdout_jobs(truth, raw, fam, cluster, [])
            for noise in NOISES:
                config = SimConfig(seed=SEED, noise=noise)
                results = run_policies(jobs, gpus, truth, ["oracle"], config=config)
                for risk in RISKS:
                    label = "gogh" if risk is None else f"gogh@{risk:g}"
                    results[label] = run_policies(jobs, gpus, truth, ["gogh"], config=config, predictors=pred,
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
    report(rows, truth_name, cluster, time.perf_counter() - t_all, SEED)


def report(rows: list[dict], truth_name: str, cluster: str, wall: float, seed: int) -> None:
    """Tables, the level's verdict and the JSON, from the simulated rows (also rebuilt from a
    saved JSON by ``--from-json``, so a wording or column change needs no new run)."""
    lines = ["| held-out family | noise | policy | SLA attainment | met on average | energy parked vs oracle | "
             "energy always on vs oracle | avg JCT h | migrations | unfinished |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['noise']:g} | {r['policy']} | {attainment_text(r['sla_attainment'])} | "
                     f"{r['met_on_average']:.3f} | {r['parked_vs_oracle']:.3f} | {r['on_vs_oracle']:.3f} | "
                     f"{r['avg_jct_h']:.2f} | {r['migrations']} | {r['unfinished']} |")
    # per policy and noise, over the families: the worst SLA attainment and the worst energy,
    # parked (the bar's reading, fixed with the rule) and always on (issue 12's bar's reading)
    lines += ["", "Over the held-out families (worst family):", "",
              "| noise | policy | worst SLA attainment | mean SLA attainment | worst parked vs oracle | "
              "mean parked vs oracle | worst always on vs oracle | mean always on vs oracle |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    summary = []
    for noise in NOISES:
        for name in ("gogh", *(f"gogh@{r:g}" for r in RISKS if r is not None)):
            sel = [r for r in rows if r["noise"] == noise and r["policy"] == name]
            sla = [r["sla_attainment"] for r in sel]
            en = [r["parked_vs_oracle"] for r in sel]
            on = [r["on_vs_oracle"] for r in sel]
            row = {"noise": noise, "policy": name, "worst_sla": min(sla), "mean_sla": sum(sla) / len(sla),
                   "worst_parked_vs_oracle": max(en), "mean_parked_vs_oracle": sum(en) / len(en),
                   "worst_on_vs_oracle": max(on), "mean_on_vs_oracle": sum(on) / len(on)}
            summary.append(row)
            lines.append(f"| {noise:g} | {name} | {attainment_text(row['worst_sla'])} | {attainment_text(row['mean_sla'])} | "
                         f"{row['worst_parked_vs_oracle']:.3f} | {row['mean_parked_vs_oracle']:.3f} | "
                         f"{row['worst_on_vs_oracle']:.3f} | {row['mean_on_vs_oracle']:.3f} |")
    stem = "risk_tradeoff" if truth_name == "gavel" else f"risk_tradeoff_{truth_name}"
    chosen = None
    picked = OUT / "risk_tradeoff_synthetic.json"
    if truth_name != "gavel":
        chosen = choose_level(summary)
        lines += ["", f"Chosen by the rule (`choose_level`): risk level {chosen['risk_level']:g} "
                  f"({'meets' if chosen['meets_bars'] else 'no level meets'} the bars here: worst SLA "
                  f"{attainment_text(chosen['worst_sla'])}, worst parked energy {chosen['worst_parked_vs_oracle']:.3f} of oracle)."]
    elif picked.exists():
        level = json.loads(picked.read_text())["chosen"]["risk_level"]
        row = next(r for r in summary if r["noise"] == 0.1 and r["policy"] == f"gogh@{level:g}")
        verdict = row["worst_sla"] >= SLA_BAR and row["worst_parked_vs_oracle"] <= ENERGY_BAR
        on_verdict = row["worst_sla"] >= SLA_BAR and row["worst_on_vs_oracle"] <= ENERGY_BAR
        lines += ["", f"Level chosen on the synthetic fleet (`risk_tradeoff_synthetic.md`): {level:g}. Here, at noise "
                  f"0.1: worst family's SLA attainment {attainment_text(row['worst_sla'])}, worst parked energy "
                  f"{row['worst_parked_vs_oracle']:.3f} of oracle: the issue's bar (>= {SLA_BAR} and <= "
                  f"{ENERGY_BAR:g} on every held-out family, parked, as the rule reads it) is "
                  f"{'met' if verdict else 'not met'}. Read always on (every GPU drawing its idle power over the "
                  f"common window, as issue 12's bar reads energy), the worst family is at "
                  f"{row['worst_on_vs_oracle']:.3f}: {'within' if on_verdict else 'not within'} the bar."]
        chosen = {"risk_level": level, "chosen_on": "synthetic", "meets_bars": verdict,
                  "meets_bars_always_on": on_verdict, **row}
    (OUT / f"{stem}.json").write_text(json.dumps({"rows": rows, "summary": summary, "wall_s": wall, "truth": truth_name,
                                                  "cluster": cluster, "seed": seed, "chosen": chosen},
                                                 indent=2) + "\n")
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{wall:.0f} s")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--truth", choices=sorted(CLUSTERS), default="gavel")
    cli.add_argument("--from-json", action="store_true",
                     help="rebuild the tables from the saved results/risk_tradeoff*.json instead of simulating")
    args = cli.parse_args()
    if args.from_json:
        saved = json.loads((OUT / ("risk_tradeoff.json" if args.truth == "gavel"
                                   else f"risk_tradeoff_{args.truth}.json")).read_text())
        report(saved["rows"], args.truth, saved["cluster"], saved["wall_s"], saved["seed"])
    else:
        main(args.truth)

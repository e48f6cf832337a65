"""The peers side by side: Gavel's policies, Hadar/HadarE (reconstructions) and ours.

Writes ``docs/peers.md`` and ``benchmarks/results/compare_peers.json``. One run per
scenario (seed 0): every policy on the identical jobs, fleet and truth, in one process;
the scenarios are docs/evaluation.md's (b) Gavel's testbed, (d) the same with
measurement noise 0.1, (c) the MSR/Philly trace on 300 GPUs and (f) the modern mixed
fleet (``benchmarks/evaluate_policies.py``'s ``scenarios()``). Energy is the common-window
account (``sim.account``): every policy charged from 0 to the last completion of any of
them, always on and with empty GPUs parked. ``gogh`` and ``gogh-p1`` plan with the shipped
predictors for the scenario's truth (``models/gavel``, ``models/synthetic``): those were
trained on the very table the scenario runs on, so their figures are in-sample (the
held-out comparison is docs/evaluation.md (e)).

    .venv/bin/python benchmarks/compare_peers.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gogh_flows.progress import Progress
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig, attainment_text
from gogh_flows.sim.holdout import load_predictors
from gogh_flows.sim.run import PEER_POLICIES, parse_cluster, run_policies

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import SEED, scenarios  # noqa: E402 - the scenarios are defined once, there

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "peers.md"
OUT = REPO / "benchmarks" / "results" / "compare_peers.json"
KEYS = ("gavel-physical", "gavel-physical-noise", "gavel-msr", "modern-mixed")
OURS = ("oracle", "oracle+limits", "gogh", "gogh+limits", "gogh+limits+wait", "gogh-p1", "greedy-fastest", "greedy-efficiency",
        "first-fit")
MODELS = {"gavel": REPO / "models" / "gavel", "synthetic": REPO / "models" / "synthetic"}


def _row(name: str, result, account) -> dict:
    s = result.summary()
    return {"policy": name, "energy_kwh_on": account.always_on_kwh,
            "on_vs_greedy_fastest": account.always_on_vs.get("greedy-fastest"),
            "on_vs_oracle": account.always_on_vs.get("oracle"),
            "energy_kwh_parked": account.parked_kwh,
            "parked_vs_greedy_fastest": account.parked_vs.get("greedy-fastest"),
            "parked_vs_oracle": account.parked_vs.get("oracle"),
            "sla_attainment": s["sla_attainment"], "met_on_average": s["met_on_average"],
            "avg_jct_h": s["avg_jct_s"] / 3600, "makespan_h": s["makespan_s"] / 3600,
            "avg_queue_h": s["avg_queue_s"] / 3600, "completed": s["jobs_completed"],
            "unfinished": s["jobs_unfinished"], "decision_p99_ms": s["decision_p99_ms"]}


def _table(rows: list[dict]) -> list[str]:
    out = ["| policy | energy on kWh | on vs greedy-fastest | on vs oracle | parked kWh | parked vs "
           "greedy-fastest | parked vs oracle | SLA attainment | met on average | avg JCT h | "
           "makespan h | avg queue h | unfinished | decision p99 ms |",
           "| --- |" + " ---: |" * 13]
    for r in rows:
        out.append(
            f"| {r['policy']} | {r['energy_kwh_on']:.1f} | {r['on_vs_greedy_fastest']:.3f} | "
            f"{r['on_vs_oracle']:.3f} | {r['energy_kwh_parked']:.1f} | {r['parked_vs_greedy_fastest']:.3f} | "
            f"{r['parked_vs_oracle']:.3f} | {attainment_text(r['sla_attainment'])} | {r['met_on_average']:.3f} | "
            f"{r['avg_jct_h']:.2f} | {r['makespan_h']:.1f} | {r['avg_queue_h']:.2f} | {r['unfinished']} | "
            f"{r['decision_p99_ms']:.1f} |")
    return out


#: figure -> (row key, True when higher is better)
FIGURES = {"energy, always on (kWh)": ("energy_kwh_on", False), "energy, parked (kWh)": ("energy_kwh_parked", False),
           "SLA attainment": ("sla_attainment", True), "met on average": ("met_on_average", True),
           "average JCT (h)": ("avg_jct_h", False), "makespan (h)": ("makespan_h", False),
           "average queueing (h)": ("avg_queue_h", False)}


def verdict(rows: list[dict]) -> tuple[list[str], dict[str, str]]:
    """Best of ours against the best peer on each figure: the table, and who is ahead."""
    ours = [r for r in rows if r["policy"] not in PEER_POLICIES]
    peers = [r for r in rows if r["policy"] in PEER_POLICIES]
    out = ["| figure | best of ours | best peer | ahead |", "| --- | --- | --- | --- |"]
    ahead: dict[str, str] = {}
    for label, (key, higher) in FIGURES.items():
        pick = max if higher else min
        a, b = pick(ours, key=lambda r: r[key]), pick(peers, key=lambda r: r[key])
        tie = abs(a[key] - b[key]) <= 0.005 * max(abs(a[key]), abs(b[key]), 1e-9)
        who = "tie" if tie else ("ours" if (a[key] > b[key]) == higher else "peer")
        ahead[label] = who if who != "peer" else f"peer ({b['policy']})"
        out.append(f"| {label} | {a['policy']} {a[key]:.3f} | {b['policy']} {b[key]:.3f} | {who} |")
    return out, ahead


def main() -> None:
    t_all = time.perf_counter()
    todo = [sc for sc in scenarios() if sc.key in KEYS]
    names = (*OURS, *PEER_POLICIES)
    lines = [
        "# The peers, side by side",
        "",
        "Regenerated by `.venv/bin/python benchmarks/compare_peers.py` (seed 0, 2 cores). Every",
        "policy runs on the identical jobs, fleet and truth in one process; requirements and",
        "scenarios as in docs/evaluation.md. The peers (`gavel-*`, `hadar`, `hadare`, `rltune`) run in",
        "rounds with time slicing on whole GPUs (`gogh_flows.sim.rounds`, docs/simulation.md);",
        "ours place jobs event by event and may co-locate two on a GPU. `hadar` and `hadare` are",
        "reconstructions from the public descriptions (`gogh_flows/sim/hadar.py` says what was",
        "reconstructed), as is `rltune` (`gogh_flows/sim/rltune.py`; its PPO agent was trained by",
        "`gogh rltune train` on generated job streams, never on these, curve below); Gavel's",
        "policies reproduce Gavel's own simulator on its testbed (`benchmarks/gavel_calibration.py`).",
        "`+limits` is ours choosing each GPU's power limit with its placement (docs/energy.md).",
        "",
        "Energy is over one common window for every policy of a scenario (0 to the last completion",
        "of any): *on* with every GPU always powered, *parked* with empty GPUs at 0 W (what the",
        "decisions change). *SLA attainment* is the time a job ran at or above its requirement",
        "over its time from first placement to end; a round in which a time-sliced job waits",
        "counts against it. *Met on average* is the milder question: the share of completed jobs",
        "whose mean rate from first placement to end met the requirement. Only `oracle`, `gogh`,",
        "`gogh-p1` and `gavel-energy-slo` look at requirements at all.",
        "",
        "`gogh` and `gogh-p1` use the shipped predictors, trained on the table each scenario runs",
        "on: in-sample figures (docs/evaluation.md (e) has them on held-out families).",
        "",
        "![RLTune-style agent's training curve](img/rltune-training.png)",
        "",
    ]
    report: dict[str, dict] = {}
    with Progress() as bars:
        for k, sc in enumerate(todo):
            bars.update("scenarios", k, len(todo))
            t0 = time.perf_counter()
            gpus = parse_cluster(sc.cluster)
            kind = "synthetic" if sc.key == "modern-mixed" else "gavel"
            predictors = load_predictors(MODELS[kind], sc.truth)
            results = run_policies(sc.jobs, gpus, sc.truth, names, predictors=predictors,
                                   config=SimConfig(seed=SEED, noise=sc.noise))
            accounts = energy_accounts(results)
            rows = [_row(n, results[n], accounts[n]) for n in names]
            wall = time.perf_counter() - t0
            report[sc.key] = {"title": sc.title, "cluster": sc.cluster, "jobs": len(sc.jobs),
                              "noise": sc.noise, "wall_s": wall, "rows": rows}
            least_on = min(rows, key=lambda r: r["energy_kwh_on"])["policy"]
            least_parked = min(rows, key=lambda r: r["energy_kwh_parked"])["policy"]
            best_jct = min(rows, key=lambda r: r["avg_jct_h"])["policy"]
            lines += [f"## {sc.title}", "", f"Cluster `{sc.cluster}`; {len(sc.jobs)} jobs; noise "
                      f"{sc.noise:g}; predictors `models/{kind}`; all policies took {wall:.0f} s.", ""]
            lines += _table(rows)
            lines += ["", f"Least energy always on: **{least_on}**; parked: **{least_parked}**; "
                      f"shortest average JCT: **{best_jct}**.", ""]
            table, ahead = verdict(rows)
            report[sc.key]["ahead"] = ahead
            lines += ["Best of ours against the best peer (within 0.5%: a tie):", "", *table, ""]
            print(f"{sc.key}: {wall:.1f} s", flush=True)
        bars.update("scenarios", len(todo), len(todo))
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    DOC.write_text("\n".join(lines) + "\n")
    print(f"wrote {DOC} in {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()

"""Holding a job only for a GPU type that frees in time (``Patience.within_reach``), chosen on seeds no report uses.

`+wait` holds a new job for a busy GPU type that would run it for >= 10% less energy, up to 48 h,
whatever that type's line: on Gavel's testbed with every family unseen, jobs that arrived in the
first hour waited 46 h for a V100, and the learned policy's last completion came at 50 h against
greedy-fastest's 21 h (``benchmarks/window_tail.py``), which lengthens the common window of every
policy of the run. ``within_reach`` holds only where the running jobs' predicted remaining times,
and the line of jobs held before it, say the type frees GPUs for the job before its patience
runs out.

This script runs each `+wait` policy twice on the same jobs, with ``within_reach`` off (the old
rule) and on, beside greedy-fastest, over one common window, GPUs always on, on seeds 10-12
(docs/evaluation.md reports 0-2): scenario (b) (the oracle alone), (b) with every family unseen
(the learned policies, noise 0 and 0.1), (e) with LM held out (noise 0), and scenarios (a) and
(f) (the oracle). The rule fixed before the run: ``within_reach`` becomes the default if, over
these runs, it lowers the mean always-on ratio of `oracle+limits+fleet+wait` and of
`gogh+limits+fleet+wait`, with no run's SLA attainment under 0.98 where the old rule's was not.

Writes ``benchmarks/results/hold_reach.{json,md}``.

    .venv/bin/python benchmarks/hold_reach.py          # about 12 min on 2 cores
    .venv/bin/python benchmarks/hold_reach.py report   # the table again from the saved JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, NOISE, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs, scenarios  # noqa: E402

from gogh_flows.placement.patience import Patience  # noqa: E402
from gogh_flows.predict.data import MeasuredSet  # noqa: E402
from gogh_flows.sim.account import energy_accounts  # noqa: E402
from gogh_flows.sim.engine import SimConfig  # noqa: E402
from gogh_flows.sim.holdout import train_each_unseen, train_holdout  # noqa: E402
from gogh_flows.sim.run import WAIT_S, WAIT_SAVING, parse_cluster, run_policies  # noqa: E402
from gogh_flows.sim.traces import read_trace  # noqa: E402
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json  # noqa: E402

SEEDS = (10, 11, 12)
OUT = Path(__file__).resolve().parent / "results"
ORACLE = ("oracle+limits+fleet+wait",)
LEARNED = ("gogh+limits+wait", "gogh+limits+fleet+wait", *ORACLE)
RULES = {"old": False, "reach": True}


def side_by_side(jobs, cluster: str, truth, policies, seed: int, noise: float, predictors=None) -> dict:
    """Each policy with the old rule and with ``within_reach``, and greedy-fastest, over one window."""
    gpus = parse_cluster(cluster)
    config = SimConfig(seed=seed, noise=noise)
    results = dict(run_policies(jobs, gpus, truth, ("greedy-fastest",), config=config))
    for rule, reach in RULES.items():
        runs = run_policies(jobs, gpus, truth, policies, config=config, predictors=predictors,
                            patience=Patience(WAIT_S, WAIT_SAVING, within_reach=reach))
        results |= {f"{name} [{rule}]": r for name, r in runs.items()}
    acc = energy_accounts(results, references=("greedy-fastest",))
    return {name: {"on": acc[name].always_on_vs["greedy-fastest"], "sla": r.summary()["sla_attainment"],
                   "makespan_h": r.summary()["makespan_s"] / 3600, "jct_h": r.summary()["avg_jct_s"] / 3600}
            for name, r in results.items()}


def main() -> dict:
    t_all = time.perf_counter()
    out: dict[str, dict] = {}

    def record(key: str, seed: int, figures: dict, t0: float) -> None:
        out.setdefault(key, {})[str(seed)] = figures
        print(f"{key} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)

    by_seed = {seed: {sc.key: sc for sc in scenarios(seed)} for seed in SEEDS}
    for key, letter in (("gavel-physical", "(b)"), ("synthetic", "(a)"), ("modern-mixed", "(f)")):
        for seed in SEEDS:
            sc, t0 = by_seed[seed].get(key), time.perf_counter()
            if sc is None:
                raise SystemExit(f"no scenario {key!r}: have {', '.join(by_seed[seed])}")
            record(letter, seed, side_by_side(sc.jobs, sc.cluster, sc.truth, ORACLE, seed, sc.noise), t0)
    first = by_seed[SEEDS[0]]["gavel-physical"]
    family_of = MeasuredSet.from_table(first.truth).family
    families = sorted({family_of[j.job_type] for s in SEEDS for j in by_seed[s]["gavel-physical"].jobs})
    pred = train_each_unseen(first.truth, families, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED,
                             intervals=True)
    for seed in SEEDS:
        sc = by_seed[seed]["gavel-physical"]
        for nz in (0.0, NOISE):
            t0 = time.perf_counter()
            record(f"(b) every family unseen, noise {nz:g}", seed,
                   side_by_side(sc.jobs, sc.cluster, sc.truth, LEARNED, seed, nz, pred), t0)
    data = gavel_dir()
    gavel = read_gavel_json(data / "simulation_throughputs.json")
    cluster = "v100=8,p100=16,k80=24"
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    fam = "LM"
    assert fam in HOLDOUTS
    pred = train_holdout(gavel, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
    for seed in SEEDS:
        t0 = time.perf_counter()
        jobs = holdout_jobs(gavel, raw, fam, cluster, [], seed=seed)
        record(f"{fam}, noise 0", seed, side_by_side(jobs, cluster, gavel, LEARNED, seed, 0.0, pred), t0)
    return {"seeds": list(SEEDS), "runs": out, "wall_s": round(time.perf_counter() - t_all, 1)}


def report(d: dict) -> list[str]:
    lines = [f"Seeds {', '.join(map(str, d['seeds']))} (`benchmarks/hold_reach.py`, {d['wall_s'] / 60:.0f} min): "
             "always on against greedy-fastest over each run's common window, mean [min, max] over the seeds; "
             "SLA attainment, the lowest seed; makespan and average JCT, the mean.", "",
             "| run | policy | old rule | within reach | SLA old / reach | makespan h old / reach | avg JCT h old / reach |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    means: dict[str, dict[str, list[float]]] = {}
    worse_sla = []
    for key, seeds in d["runs"].items():
        names = sorted({n.rsplit(" [", 1)[0] for n in next(iter(seeds.values())) if " [" in n})
        for name in names:
            col = {rule: [seeds[s][f"{name} [{rule}]"] for s in seeds] for rule in RULES}

            def spread(rule: str) -> str:
                v = [x["on"] for x in col[rule]]
                return f"{statistics.fmean(v):.3f} [{min(v):.3f}, {max(v):.3f}]"

            def mean(rule: str, field: str) -> str:
                return f"{statistics.fmean(x[field] for x in col[rule]):.1f}"

            sla = {rule: min(x["sla"] for x in col[rule]) for rule in RULES}
            lines.append(f"| {key} | {name} | {spread('old')} | {spread('reach')} | {sla['old']:.4f} / "
                         f"{sla['reach']:.4f} | {mean('old', 'makespan_h')} / {mean('reach', 'makespan_h')} | "
                         f"{mean('old', 'jct_h')} / {mean('reach', 'jct_h')} |")
            for rule in RULES:
                means.setdefault(name, {}).setdefault(rule, []).extend(x["on"] for x in col[rule])
            worse_sla += [f"{key} {name} seed {s}" for s in seeds
                          if seeds[s][f"{name} [reach]"]["sla"] < 0.98 <= seeds[s][f"{name} [old]"]["sla"]]
    lines.append("")
    verdict = []
    for name in ("oracle+limits+fleet+wait", "gogh+limits+fleet+wait"):
        old, reach = (statistics.fmean(means[name][r]) for r in RULES)
        verdict.append(reach < old)
        lines.append(f"- {name}: mean always-on ratio {old:.4f} with the old rule, {reach:.4f} within reach, "
                     f"over {len(means[name]['old'])} runs.")
    lines.append(f"- Runs whose SLA attainment fell under 0.98 only within reach: {', '.join(worse_sla) or 'none'}.")
    keep = all(verdict) and not worse_sla
    lines.append(f"- By the rule fixed before the run, `within_reach` {'becomes' if keep else 'does not become'} "
                 "the default.")
    return lines


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    path = OUT / "hold_reach.json"
    if sys.argv[1:] == ["report"]:
        saved = json.loads(path.read_text())
    else:
        saved = main()
        path.write_text(json.dumps(saved, indent=1) + "\n")
    text = "\n".join(report(saved))
    (OUT / "hold_reach.md").write_text(text + "\n")
    print(text)

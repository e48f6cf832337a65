"""The optimiser's objective on an always-on fleet: energy with the busy boards' idle draw, or above it only.

The optimiser costs a decision by the energy to completion it adds to the GPUs it occupies,
their idle draw included (``EnergyModel(count_idle=True)``, the parked account). Issue 12's bar
is read always on: every GPU draws its idle power for the whole window, occupied or not, so what
a placement changes there is only the draw above idle. Counting the idle draw makes a slower
choice (a lower limit, a slower type) look dearer than it is on such a fleet. The simulator's
holds and moves already decide with the draw above idle on an always-on fleet; the placements
do not.

This script runs the optimiser's energy policies twice on the same jobs, deciding with the
parked objective (as now) and with the draw above idle (``EnergyModel(count_idle=False)``), beside
greedy-fastest, over one common window, GPUs always on, on seeds 10-12 (docs/evaluation.md
reports 0-2): scenarios (a), (b), (d) and (f) (the oracle's variants) and (b) with every family
unseen (the learned policy, noise 0). The rule fixed before the run: the draw above idle becomes
the simulator's always-on objective if, over these runs, it lowers the mean always-on ratio of
`oracle+limits+fleet+wait` and of `gogh+limits+fleet+wait`, with no run's SLA attainment newly
under 0.98.

Writes ``benchmarks/results/always_on_objective.{json,md}``.

    .venv/bin/python benchmarks/always_on_objective.py          # about 15 min on 2 cores
    .venv/bin/python benchmarks/always_on_objective.py report   # the table again from the saved JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import P1_EPOCHS, P2_EPOCHS, SEED, scenarios  # noqa: E402

from gogh_flows.energy import EnergyModel  # noqa: E402
from gogh_flows.predict.data import MeasuredSet  # noqa: E402
from gogh_flows.sim.account import energy_accounts  # noqa: E402
from gogh_flows.sim.engine import SimConfig  # noqa: E402
from gogh_flows.sim.holdout import train_each_unseen  # noqa: E402
from gogh_flows.sim.run import parse_cluster, run_policies  # noqa: E402

SEEDS = (10, 11, 12)
OUT = Path(__file__).resolve().parent / "results"
ORACLES = ("oracle+limits", "oracle+limits+fleet+wait")
LEARNED = ("gogh+limits+fleet+wait", "oracle+limits+fleet+wait")
OBJECTIVES = {"parked": EnergyModel(), "above idle": EnergyModel(count_idle=False)}


def side_by_side(jobs, cluster: str, truth, policies, seed: int, noise: float, predictors=None) -> dict:
    gpus = parse_cluster(cluster)
    config = SimConfig(seed=seed, noise=noise)
    results = dict(run_policies(jobs, gpus, truth, ("greedy-fastest",), config=config))
    for label, energy in OBJECTIVES.items():
        runs = run_policies(jobs, gpus, truth, policies, config=config, predictors=predictors, energy=energy)
        results |= {f"{name} [{label}]": r for name, r in runs.items()}
    acc = energy_accounts(results, references=("greedy-fastest",))
    return {name: {"on": acc[name].always_on_vs["greedy-fastest"], "sla": r.summary()["sla_attainment"],
                   "makespan_h": r.summary()["makespan_s"] / 3600, "jct_h": r.summary()["avg_jct_s"] / 3600}
            for name, r in results.items()}


def main() -> dict:
    t_all = time.perf_counter()
    out: dict[str, dict] = {}
    by_seed = {seed: {sc.key: sc for sc in scenarios(seed)} for seed in SEEDS}
    for key, letter in (("gavel-physical", "(b)"), ("gavel-physical-noise", "(d)"), ("synthetic", "(a)"),
                        ("modern-mixed", "(f)")):
        for seed in SEEDS:
            sc, t0 = by_seed[seed][key], time.perf_counter()
            out.setdefault(letter, {})[str(seed)] = side_by_side(sc.jobs, sc.cluster, sc.truth, ORACLES, seed, sc.noise)
            print(f"{letter} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    first = by_seed[SEEDS[0]]["gavel-physical"]
    family_of = MeasuredSet.from_table(first.truth).family
    families = sorted({family_of[j.job_type] for s in SEEDS for j in by_seed[s]["gavel-physical"].jobs})
    pred = train_each_unseen(first.truth, families, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED,
                             intervals=True)
    for seed in SEEDS:
        sc, t0 = by_seed[seed]["gavel-physical"], time.perf_counter()
        out.setdefault("(b) every family unseen, noise 0", {})[str(seed)] = side_by_side(
            sc.jobs, sc.cluster, sc.truth, LEARNED, seed, 0.0, pred)
        print(f"(b) every family unseen seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {"seeds": list(SEEDS), "runs": out, "wall_s": round(time.perf_counter() - t_all, 1)}


def report(d: dict) -> list[str]:
    labels = list(OBJECTIVES)
    lines = [f"Seeds {', '.join(map(str, d['seeds']))} (`benchmarks/always_on_objective.py`, {d['wall_s'] / 60:.0f} min): "
             "always on against greedy-fastest over each run's common window, mean [min, max] over the seeds; "
             "SLA attainment, the lowest seed; makespan and average JCT, the mean. Deciding with the energy of "
             "the occupied boards, idle draw included (parked: as now), or with the draw above idle.", "",
             f"| run | policy | {labels[0]} | {labels[1]} | SLA {' / '.join(labels)} | makespan h | avg JCT h |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    means: dict[str, dict[str, list[float]]] = {}
    worse_sla = []
    for key, seeds in d["runs"].items():
        names = sorted({n.rsplit(" [", 1)[0] for n in next(iter(seeds.values())) if " [" in n})
        for name in names:
            col = {lab: [seeds[s][f"{name} [{lab}]"] for s in seeds] for lab in labels}

            def spread(lab: str) -> str:
                v = [x["on"] for x in col[lab]]
                return f"{statistics.fmean(v):.3f} [{min(v):.3f}, {max(v):.3f}]"

            def mean(field: str) -> str:
                return " / ".join(f"{statistics.fmean(x[field] for x in col[lab]):.1f}" for lab in labels)

            sla = " / ".join(f"{min(x['sla'] for x in col[lab]):.4f}" for lab in labels)
            lines.append(f"| {key} | {name} | {spread(labels[0])} | {spread(labels[1])} | {sla} | "
                         f"{mean('makespan_h')} | {mean('jct_h')} |")
            for lab in labels:
                means.setdefault(name, {}).setdefault(lab, []).extend(x["on"] for x in col[lab])
            worse_sla += [f"{key} {name} seed {s}" for s in seeds
                          if seeds[s][f"{name} [{labels[1]}]"]["sla"] < 0.98 <= seeds[s][f"{name} [{labels[0]}]"]["sla"]]
    lines.append("")
    verdict = []
    for name in ("oracle+limits+fleet+wait", "gogh+limits+fleet+wait"):
        old, new = (statistics.fmean(means[name][lab]) for lab in labels)
        verdict.append(new < old)
        lines.append(f"- {name}: mean always-on ratio {old:.4f} deciding with the parked objective, {new:.4f} with the "
                     f"draw above idle, over {len(means[name][labels[0]])} runs.")
    if "oracle+limits" in means:
        old, new = (statistics.fmean(means["oracle+limits"][lab]) for lab in labels)
        lines.append(f"- oracle+limits (not part of the rule): {old:.4f} and {new:.4f}.")
    lines.append(f"- Runs whose SLA attainment fell under 0.98 only with the draw above idle: {', '.join(worse_sla) or 'none'}.")
    keep = all(verdict) and not worse_sla
    lines.append(f"- By the rule fixed before the run, the draw above idle {'becomes' if keep else 'does not become'} "
                 "the simulator's always-on objective.")
    return lines


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    path = OUT / "always_on_objective.json"
    if sys.argv[1:] == ["report"]:
        saved = json.loads(path.read_text())
    else:
        saved = main()
        path.write_text(json.dumps(saved, indent=1) + "\n")
    text = "\n".join(report(saved))
    (OUT / "always_on_objective.md").write_text(text + "\n")
    print(text)

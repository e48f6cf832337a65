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

    .venv/bin/python benchmarks/always_on_objective.py          # about 8 min on 2 cores
    .venv/bin/python benchmarks/always_on_objective.py report   # the table again from the saved JSON
    .venv/bin/python benchmarks/always_on_objective.py heldout  # (e)'s families on Gavel's testbed (no rule)

``heldout`` asks the question the first run left open: on (e)'s held-out-family runs the fixed
cap (`greedy-fastest+cap`) used less energy than `oracle+limits` and `gogh+limits` on seed 0
(docs/evaluation.md); does deciding with the draw above idle change that? It runs those two
policies with both objectives beside the cap, seeds 10-12, noise 0, and adopts nothing
(``always_on_objective_heldout.{json,md}``).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs, scenarios  # noqa: E402
from variant_runs import report as variant_report  # noqa: E402
from variant_runs import heading, run_or_report, unseen_predictors  # noqa: E402
from variant_runs import side_by_side as run_both  # noqa: E402

from gogh_flows.energy import EnergyModel  # noqa: E402
from gogh_flows.sim.account import energy_accounts  # noqa: E402
from gogh_flows.sim.engine import SimConfig  # noqa: E402
from gogh_flows.sim.run import parse_cluster, run_policies  # noqa: E402
from gogh_flows.sim.holdout import train_holdout  # noqa: E402
from gogh_flows.sim.traces import read_trace  # noqa: E402
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json  # noqa: E402

SEEDS = (10, 11, 12)
OUT = Path(__file__).resolve().parent / "results"
ORACLES = ("oracle+limits", "oracle+limits+fleet+wait")
LEARNED = ("gogh+limits+fleet+wait", "oracle+limits+fleet+wait")
#: the objective as it is (the parked account), then the draw above idle (the saved runs' labels)
VARIANTS = {"parked": {"energy": EnergyModel()}, "above idle": {"energy": EnergyModel(count_idle=False)}}


def side_by_side(jobs, cluster: str, truth, policies, seed: int, noise: float, predictors=None) -> dict:
    return run_both(jobs, cluster, truth, policies, seed, noise, VARIANTS, predictors)


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
    pred = unseen_predictors(by_seed, P1_EPOCHS, P2_EPOCHS, SEED)
    for seed in SEEDS:
        sc, t0 = by_seed[seed]["gavel-physical"], time.perf_counter()
        out.setdefault("(b) every family unseen, noise 0", {})[str(seed)] = side_by_side(
            sc.jobs, sc.cluster, sc.truth, LEARNED, seed, 0.0, pred)
        print(f"(b) every family unseen seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {"seeds": list(SEEDS), "runs": out, "wall_s": round(time.perf_counter() - t_all, 1)}


def heldout() -> dict:
    """(e)'s families on Gavel's testbed: the cap beside oracle+limits and gogh+limits, each objective."""
    t_all = time.perf_counter()
    data = gavel_dir()
    gavel = read_gavel_json(data / "simulation_throughputs.json")
    cluster = "v100=8,p100=16,k80=24"
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    out: dict[str, dict] = {}
    for fam in HOLDOUTS:
        pred = train_holdout(gavel, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
        for seed in SEEDS:
            t0 = time.perf_counter()
            jobs = holdout_jobs(gavel, raw, fam, cluster, [], seed=seed)
            gpus = parse_cluster(cluster)
            config = SimConfig(seed=seed)
            results = dict(run_policies(jobs, gpus, gavel, ("greedy-fastest", "greedy-fastest+cap"), config=config))
            for label, kwargs in VARIANTS.items():
                runs = run_policies(jobs, gpus, gavel, ("oracle+limits", "gogh+limits"), config=config,
                                    predictors=pred, **kwargs)
                results |= {f"{name} [{label}]": r for name, r in runs.items()}
            acc = energy_accounts(results, references=("greedy-fastest",))
            out.setdefault(fam, {})[str(seed)] = {
                name: {"on": acc[name].always_on_vs["greedy-fastest"], "sla": r.summary()["sla_attainment"]}
                for name, r in results.items()}
            print(f"{fam} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {"seeds": list(SEEDS), "runs": out, "wall_s": round(time.perf_counter() - t_all, 1)}


def heldout_report(d: dict) -> list[str]:
    names = ("greedy-fastest+cap", *(f"{p} [{lab}]" for p in ("oracle+limits", "gogh+limits") for lab in VARIANTS))
    lines = [f"(e)'s held-out families on Gavel's testbed, noise 0, seeds {', '.join(map(str, d['seeds']))} "
             f"(`benchmarks/always_on_objective.py heldout`, {d['wall_s'] / 60:.0f} min): always on against "
             "greedy-fastest over each run's common window, mean [min, max] over the seeds; SLA attainment, the "
             "lowest seed. Nothing is adopted from this run.", "",
             "| held-out family | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for fam, seeds in d["runs"].items():
        cells = []
        for n in names:
            v = [seeds[s][n]["on"] for s in seeds]
            cells.append(f"{statistics.fmean(v):.3f} [{min(v):.3f}, {max(v):.3f}] ({min(seeds[s][n]['sla'] for s in seeds):.4f})")
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names[1:]:
        wins = sum(d["runs"][f][s][n]["on"] < d["runs"][f][s]["greedy-fastest+cap"]["on"]
                   for f in d["runs"] for s in d["runs"][f])
        total = sum(len(d["runs"][f]) for f in d["runs"])
        lines.append(f"- {n} uses less energy than the cap on {wins} of {total} runs.")
    return lines


def report(d: dict) -> list[str]:
    head = heading("always_on_objective.py", d, "Deciding with the energy of the occupied boards, idle draw "
                   "included (parked: as now), or with the draw above idle.")
    return variant_report(d["runs"], list(VARIANTS), head, "the draw above idle as the simulator's always-on objective")


if __name__ == "__main__":
    if sys.argv[1:2] == ["heldout"]:
        run_or_report(OUT, "always_on_objective_heldout", sys.argv[2:] == ["report"], heldout, heldout_report)
    else:
        run_or_report(OUT, "always_on_objective", sys.argv[1:] == ["report"], main, report)

"""How much of the power-limit saving on Gavel's data rests on knowing the power side exactly.

Gavel's tables measure throughputs only: every job's board power in the simulator is the
energy model's at one activity (0.8) for every job, and its response to a power limit is the
model fitted on Zeus's curves (docs/energy.md). The planner uses the same activity and the
same model, so on scenario (b) a policy choosing limits knows the power side exactly and is
uncertain only about throughputs (an audit's finding, 2026-12-07). This script asks what is
left of the saving when it does not:

* ``activity hidden``: each (job type, GPU type) draws at an activity of its own, uniform in
  0.4-1.0 (a hash of the pair, the same for every seed), which the truth uses and the planner
  does not (it keeps 0.8);
* ``other limit response``: the boards slow and draw under a limit by the other candidate form
  fitted on the same Zeus curves (``powerlaw``, under-weight 1: nearly as good a fit by
  leave-one-GPU-out, docs/energy.md), and the policies know it (the simulator's energy model is
  both the truth's and the planner's): how large the saving is if that form is the true one.

Each beside greedy-fastest at full power and greedy-fastest with every board at its lowest limit
(``benchmarks/static_cap.py``'s chosen cap), on (b)'s jobs, seeds 0-2, GPUs always on, one
common window per run. Sensitivities, not choices: nothing here is tuned.

Writes ``benchmarks/results/power_knowledge.{json,md}``.

    .venv/bin/python benchmarks/power_knowledge.py      # about 2 min on 2 cores
"""

from __future__ import annotations

import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import scenarios  # noqa: E402
from static_cap import save, spread  # noqa: E402

from gogh_flows.energy import EnergyModel  # noqa: E402
from gogh_flows.placement.baselines import CappedGreedyFastest  # noqa: E402
from gogh_flows.placement.problem import TableThroughputs  # noqa: E402
from gogh_flows.power_limits import fit_power_limit_model, read_traces  # noqa: E402
from gogh_flows.sim.account import energy_accounts  # noqa: E402
from gogh_flows.sim.engine import SimConfig, attainment_text, simulate  # noqa: E402
from gogh_flows.sim.run import CAP_FRACTION, DEFAULT_LIMIT_LEVELS, make_policy, parse_cluster  # noqa: E402
from gogh_flows.datapaths import default_data  # noqa: E402
from gogh_flows.truth.table import ThroughputTable  # noqa: E402

SEEDS = (0, 1, 2)


def _activity(job_type: str, gpu_type: str) -> float:
    return 0.4 + 0.6 * (zlib.crc32(f"{job_type}|{gpu_type}".encode()) % 10_000) / 10_000


def with_hidden_activity(truth: ThroughputTable) -> ThroughputTable:
    frame = truth.frame.with_columns(
        pl.struct("job_type", "gpu_type", "partner").map_elements(
            lambda r: _activity(r["job_type"], r["gpu_type"]) if r["partner"] is None else None,
            return_dtype=pl.Float64).alias("activity"))
    return ThroughputTable(frame, source=f"{truth.source}+hidden activity")


class PlansAtDefaultActivity(TableThroughputs):
    """The truth's throughputs, but every job's activity the planner's default (as on Gavel's data)."""

    def activity(self, job, gpu_type: str) -> float:
        return 0.8


def run(jobs, cluster: str, truth, seed: int, *, truth_energy: EnergyModel, blind: bool) -> dict:
    gpus = parse_cluster(cluster)
    counts = Counter(g.gpu_type for g in gpus)
    config = SimConfig(seed=seed)
    out = {}
    for name in ("greedy-fastest", "oracle+limits"):
        p = make_policy(name, truth, seed, gpu_types=sorted(counts), gpu_counts=counts)
        planning = PlansAtDefaultActivity(truth) if blind and name != "greedy-fastest" else p.planning
        # ``energy`` is the truth's and the planner's alike (the simulator has one model)
        out[name] = simulate(jobs, gpus, truth, p.policy, planning=planning, config=config, energy=truth_energy,
                             reoptimize_s=p.reoptimize_s, patience=p.patience)
    cap = CappedGreedyFastest(name="greedy-fastest+cap", cap_fraction=CAP_FRACTION, power_limit_levels=DEFAULT_LIMIT_LEVELS)
    out[cap.name] = simulate(jobs, gpus, truth, cap, planning=TableThroughputs(truth), config=config,
                             energy=truth_energy)
    acc = energy_accounts(out)
    return {n: {"on": acc[n].always_on_vs["greedy-fastest"], "parked": acc[n].parked_vs["greedy-fastest"],
                "sla": r.summary()["sla_attainment"]} for n, r in out.items()}


def main() -> dict:
    t0 = time.perf_counter()
    alt = fit_power_limit_model(list(read_traces(default_data("zeus")).values()), forms=("powerlaw",),
                                under_weights=(1.0,))
    variants = {"as published": dict(hidden=False, energy=EnergyModel()),
                "activity hidden": dict(hidden=True, energy=EnergyModel()),
                "other limit response": dict(hidden=False, energy=EnergyModel(limit_model=alt))}
    data: dict = {"seeds": list(SEEDS), "cap": CAP_FRACTION, "alt_model": {"form": alt.form, "params": dict(alt.params)},
                  "variants": {}}
    for label, v in variants.items():
        runs = {}
        for seed in SEEDS:
            sc = {s.key: s for s in scenarios(seed)}["gavel-physical"]
            truth = with_hidden_activity(sc.truth) if v["hidden"] else sc.truth
            runs[seed] = run(sc.jobs, sc.cluster, truth, seed, truth_energy=v["energy"], blind=v["hidden"])
        data["variants"][label] = runs
        print(f"{label}: {time.perf_counter() - t0:.0f} s", flush=True)
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    return data


def report(d: dict) -> list[str]:
    lines = ["# Power-limit savings when the power side is not known exactly (scenario (b))", "",
             f"`benchmarks/power_knowledge.py` ({d['wall_s']:.0f} s, 2 cores); Gavel's physical-cluster trace on its "
             f"testbed, seeds {', '.join(map(str, d['seeds']))}, always on and parked against greedy-fastest over each "
             "run's common window, mean [min, max]; SLA attainment, the lowest seed. 'other limit response': the truth's "
             f"`{d['alt_model']['form']}` fit of the same Zeus curves as the boards' response to a limit, "
             "known to the policies too.", "",
             "| truth | policy | always on vs greedy-fastest | parked vs greedy-fastest | SLA, lowest |",
             "| --- | --- | ---: | ---: | ---: |"]
    for label, runs in d["variants"].items():
        names = list(next(iter(runs.values())))
        for n in names:
            rows = [runs[s][n] if s in runs else runs[str(s)][n] for s in d["seeds"]]
            lines.append(f"| {label} | {n} | {spread([r['on'] for r in rows])} | {spread([r['parked'] for r in rows])} "
                         f"| {attainment_text(min(r['sla'] for r in rows))} |")
    return lines


if __name__ == "__main__":
    result = main()
    save("power_knowledge", result, report(result))

"""An experiment, not a product feature: does planning at a risk level trap a job type on the GPU
types it was first measured on, and would a trial on an unmeasured type get the energy back?

At a risk level an entry not yet measured is planned at the lower end of its interval (x/÷ 3
after one observation at 90%), so once a job type has run on one GPU type, a cheaper type
whose *point* prediction meets a job's requirement is usually ruled out by the margin, never
tried, never measured. The variant here (``gogh@0.9+trial``) offers such a type at its point
prediction, for the jobs whose requirement that point meets, until the type has been measured
there (every such job, not one at a time: an upper bound on what trials could gain and on what
they could cost in attainment). It patches ``LearnedThroughputs._single`` for this process only.

Scenario (e) as in ``risk_tradeoff.py`` (Gavel's physical-cluster trace, each family held out in
turn, seed 0), noise 0 and 0.1, ``oracle`` / ``gogh@0.9`` / ``gogh@0.9+trial``. Writes
``benchmarks/results/risk_type_trials.{json,md}``.

    .venv/bin/python benchmarks/risk_type_trials.py
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from gogh_flows.sim import learned
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig, attainment_text
from gogh_flows.sim.holdout import train_holdout
from gogh_flows.sim.run import parse_cluster, run_policies
from gogh_flows.sim.traces import read_trace
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs  # noqa: E402 - one definition

OUT = Path(__file__).resolve().parent / "results"
CLUSTER = "v100=8,p100=16,k80=24"
RISK = 0.9
_single = learned.LearnedThroughputs._single
TRIALS = {"on": False}


def _single_with_trials(self, job):
    """The job's row with every unmeasured GPU type whose point prediction meets its need
    offered at that point (no margin) until its type is measured there."""
    if not (TRIALS["on"] and self._shrink):
        return _single(self, job)
    typed = self._type_measured(job.job_type, job.num_gpus)
    own = self._own.get(job.id, {})
    if not (typed or own):  # before any measurement: the margin stands (nothing to trap yet)
        return _single(self, job)
    point_row, need = self._type_row(job.job_type), self._need(job)
    trial = [g not in typed and g not in own and point_row[i] >= need[i] for i, g in enumerate(self.gpus)]
    if not any(trial):
        return _single(self, job)
    low = _single(self, job)
    shrink, self._shrink = self._shrink, {}
    try:
        self._floored.pop(job.id, None)
        point = _single(self, job)
    finally:
        self._shrink = shrink
        self._floored.pop(job.id, None)  # the two rows must not answer for each other
    return np.where(trial, point, low)


def main() -> None:
    t_all = time.perf_counter()
    learned.LearnedThroughputs._single = _single_with_trials
    data = gavel_dir()
    gpus = parse_cluster(CLUSTER)
    truth = read_gavel_json(data / "simulation_throughputs.json")
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    rows = []
    for fam in HOLDOUTS:
        pred = train_holdout(truth, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
        jobs = holdout_jobs(truth, raw, fam, CLUSTER, [])
        for noise in (0.0, 0.1):
            config = SimConfig(seed=SEED, noise=noise)
            results = run_policies(jobs, gpus, truth, ["oracle"], config=config)
            for label, on in ((f"gogh@{RISK:g}", False), (f"gogh@{RISK:g}+trial", True)):
                TRIALS["on"] = on
                results[label] = run_policies(jobs, gpus, truth, ["gogh"], config=config, predictors=pred,
                                              risk_level=RISK)["gogh"]
            TRIALS["on"] = False
            accounts = energy_accounts(results, references=("oracle",))
            for name, r in results.items():
                where = Counter(rec.gpu_type for rec in r.jobs.values())
                rows.append({"family": fam, "noise": noise, "policy": name,
                             "sla_attainment": r.summary()["sla_attainment"],
                             "parked_vs_oracle": accounts[name].parked_vs["oracle"],
                             "on_vs_oracle": accounts[name].always_on_vs["oracle"],
                             "migrations": r.migrations, "jobs_by_gpu_type": dict(sorted(where.items()))})
            print(f"{fam}, noise {noise:g}: done", flush=True)
    lines = ["| held-out family | noise | policy | SLA attainment | parked vs oracle | always on vs oracle | "
             "migrations | jobs by GPU type (last) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['noise']:g} | {r['policy']} | {attainment_text(r['sla_attainment'])} | "
                     f"{r['parked_vs_oracle']:.3f} | {r['on_vs_oracle']:.3f} | {r['migrations']} | "
                     + ", ".join(f"{g} {n}" for g, n in r["jobs_by_gpu_type"].items()) + " |")
    lines += ["", "Over the held-out families at noise 0.1:", "",
              "| policy | worst SLA attainment | worst parked vs oracle | mean parked vs oracle | "
              "worst always on vs oracle |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in (f"gogh@{RISK:g}", f"gogh@{RISK:g}+trial"):
        sel = [r for r in rows if r["noise"] == 0.1 and r["policy"] == name]
        lines.append(f"| {name} | {attainment_text(min(r['sla_attainment'] for r in sel))} | "
                     f"{max(r['parked_vs_oracle'] for r in sel):.3f} | "
                     f"{sum(r['parked_vs_oracle'] for r in sel) / len(sel):.3f} | "
                     f"{max(r['on_vs_oracle'] for r in sel):.3f} |")
    wall = time.perf_counter() - t_all
    (OUT / "risk_type_trials.json").write_text(json.dumps({"rows": rows, "risk_level": RISK, "cluster": CLUSTER,
                                                           "seed": SEED, "wall_s": wall}, indent=2) + "\n")
    (OUT / "risk_type_trials.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{wall:.0f} s")


if __name__ == "__main__":
    main()

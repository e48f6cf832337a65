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

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import HOLDOUTS, NOISE, P1_EPOCHS, P2_EPOCHS, SEED, holdout_jobs, scenarios  # noqa: E402
from variant_runs import report as variant_report  # noqa: E402
from variant_runs import heading, run_or_report, unseen_predictors  # noqa: E402
from variant_runs import side_by_side as run_both  # noqa: E402

from gogh_flows.placement.patience import Patience  # noqa: E402
from gogh_flows.sim.holdout import train_holdout  # noqa: E402
from gogh_flows.sim.run import WAIT_S, WAIT_SAVING  # noqa: E402
from gogh_flows.sim.traces import read_trace  # noqa: E402
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json  # noqa: E402

SEEDS = (10, 11, 12)
OUT = Path(__file__).resolve().parent / "results"
ORACLE = ("oracle+limits+fleet+wait",)
LEARNED = ("gogh+limits+wait", "gogh+limits+fleet+wait", *ORACLE)
#: the old rule, then within reach (the saved runs' labels)
VARIANTS = {"old": {"patience": Patience(WAIT_S, WAIT_SAVING)},
            "reach": {"patience": Patience(WAIT_S, WAIT_SAVING, within_reach=True)}}


def side_by_side(jobs, cluster: str, truth, policies, seed: int, noise: float, predictors=None) -> dict:
    return run_both(jobs, cluster, truth, policies, seed, noise, VARIANTS, predictors)


def main() -> dict:
    t_all = time.perf_counter()
    out: dict[str, dict] = {}

    def record(key: str, seed: int, figures: dict, t0: float) -> None:
        out.setdefault(key, {})[str(seed)] = figures
        print(f"{key} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)

    by_seed = {seed: {sc.key: sc for sc in scenarios(seed)} for seed in SEEDS}
    for key, letter in (("gavel-physical", "(b)"), ("synthetic", "(a)"), ("modern-mixed", "(f)")):
        for seed in SEEDS:
            sc, t0 = by_seed[seed][key], time.perf_counter()
            record(letter, seed, side_by_side(sc.jobs, sc.cluster, sc.truth, ORACLE, seed, sc.noise), t0)
    pred = unseen_predictors(by_seed, P1_EPOCHS, P2_EPOCHS, SEED)
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
    head = heading("hold_reach.py", d, "Each `+wait` policy with the old rule and within reach.")
    return variant_report(d["runs"], list(VARIANTS), head, "`within_reach` as the default")


if __name__ == "__main__":
    run_or_report(OUT, "hold_reach", sys.argv[1:] == ["report"], main, report)

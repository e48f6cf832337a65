"""What waiting for an efficient GPU buys, and what it costs; and the patience the simulator's
``+wait`` policies use, chosen on seeds that no report uses (issue 12;
``PlacementPolicy.wait_for_efficiency_s`` in the product).

``oracle+limits+fleet`` with new jobs allowed to wait up to 0 (never), 1, 3, 6, 12, 24 and
48 hours for a GPU type that runs them for at least 10% less energy than what is free
(``placement/patience.py``), on scenarios (b), (d), (f) and (f, noise) of docs/evaluation.md,
beside greedy-fastest, with the **selection seeds** 10, 11 and 12 (docs/evaluation.md and
``energy_seeds.py`` report seeds 0-2; (b) and (d) replay one trace, so there the seeds draw only
the requirements and the noise: the choice has seen the same jobs at other requirements). Every
run of a scenario and seed shares one energy window (to the latest last completion of any of
them), so the rows of a scenario compare with each other; they are not the figures of
docs/evaluation.md, whose window is set by its own policies.

Then, at the chosen patience, the saving a held job waits for: 5%, 10% (the default, fixed
before the patience was chosen) and 20%, on the same scenarios and seeds, each scenario and seed
over one energy window of its own (greedy-fastest and the three). This is a check of the
default, not a choice the simulator adopts by itself: ``sim.run.WAIT_SAVING`` stays what it is,
and the report says which saving would have had the least energy.

The patience chosen is the one with the least always-on energy against greedy-fastest, averaged
over the four scenarios and three seeds (a tie within 0.002 goes to the shorter patience, which
costs less completion time); ``sim.run.WAIT_S`` is set to it, and ``tests/test_docs.py`` checks
that it is this file's choice.

Writes ``benchmarks/results/wait_tradeoff.{json,md}``.

    .venv/bin/python benchmarks/wait_tradeoff.py          # about 17 minutes on 2 cores
    .venv/bin/python benchmarks/wait_tradeoff.py report   # the report again from the JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gogh_flows.placement.patience import Patience
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig, SimResult, attainment_text
from gogh_flows.sim.run import WAIT_SAVING, WAIT_SUFFIX, parse_cluster, run_policies

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import scenarios  # noqa: E402 - the scenarios are defined once, there

OUT = Path(__file__).resolve().parent / "results"
KEYS = ("gavel-physical", "gavel-physical-noise", "modern-mixed", "modern-mixed-noise")
#: seeds for choosing, never reported by docs/evaluation.md or energy_seeds.py (seeds 0-2)
SELECTION_SEEDS = (10, 11, 12)
HOURS = (0, 1, 3, 6, 12, 24, 48)
#: the savings a held job may wait for, compared at the chosen patience
SAVINGS = (0.05, WAIT_SAVING, 0.2)
POLICY = "oracle+limits+fleet"
#: patiences whose mean ratios differ by less than this are a tie (to the shorter)
TIE = 0.002


def least(means: dict):
    """The candidate of least mean ratio; one within :data:`TIE` of it that comes earlier in
    ``means`` (the cheaper one) wins the tie."""
    best = min(means.values())
    return next(k for k, m in means.items() if m <= best + TIE)


def choose(rows: list[dict]) -> float:
    """The patience (hours) of least mean always-on ratio over every scenario and seed; ties to
    the shorter."""
    return least({h: statistics.fmean(r["always_on_vs_greedy"] for r in rows if r["hours"] == h) for h in HOURS})


def rewrite() -> None:
    """The report again from the saved JSON, without running anything."""
    saved = json.loads((OUT / "wait_tradeoff.json").read_text())
    text = report(saved["rows"], saved["titles"], saved["chosen_hours"], saved["seconds"], saved.get("saving_rows"))
    (OUT / "wait_tradeoff.md").write_text(text)
    print(text)


def main() -> None:
    if sys.argv[1:] == ["report"]:
        return rewrite()
    t_all = time.perf_counter()
    rows: list[dict] = []
    titles: dict[str, str] = {}
    kept: dict[tuple[str, int], tuple] = {}  # (scenario, seed) -> what the saving check reruns with
    for seed in SELECTION_SEEDS:
        for sc in (s for s in scenarios(seed) if s.key in KEYS):
            t0 = time.perf_counter()
            titles[sc.key] = sc.title
            gpus = parse_cluster(sc.cluster)
            config = SimConfig(seed=seed, noise=sc.noise)
            results = run_policies(sc.jobs, gpus, sc.truth, ["greedy-fastest"], config=config)
            for hours in HOURS:
                name = POLICY + (WAIT_SUFFIX if hours else "")
                results[f"{hours} h"] = run_policies(sc.jobs, gpus, sc.truth, [name], config=config,
                                                     patience=Patience(hours * 3600.0, WAIT_SAVING))[name]
            rows += _rows(results, sc.key, seed, "patience")
            kept[(sc.key, seed)] = (sc, gpus, config, results)
            print(f"{sc.key} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
    chosen = choose([r for r in rows if r["hours"] is not None])
    saving_rows: list[dict] = []
    for (key, seed), (sc, gpus, config, results) in kept.items():
        t0 = time.perf_counter()
        at = {"greedy-fastest": results["greedy-fastest"], f"{WAIT_SAVING:g}": results[f"{chosen:g} h"]}
        name = POLICY + (WAIT_SUFFIX if chosen else "")
        for saving in (x for x in SAVINGS if x != WAIT_SAVING):
            at[f"{saving:g}"] = run_policies(sc.jobs, gpus, sc.truth, [name], config=config,
                                             patience=Patience(chosen * 3600.0, saving))[name]
        saving_rows += _rows(at, key, seed, "saving")
        print(f"{key} seed {seed}, savings: {time.perf_counter() - t0:.1f} s", flush=True)
    means = saving_means(saving_rows)
    best_saving = min(means, key=means.__getitem__)
    wall = time.perf_counter() - t_all
    OUT.mkdir(exist_ok=True)
    (OUT / "wait_tradeoff.json").write_text(json.dumps(
        {"seeds": list(SELECTION_SEEDS), "min_saving": WAIT_SAVING, "chosen_hours": chosen, "tie": TIE,
         "seconds": wall, "rows": rows, "savings": list(SAVINGS), "least_energy_saving": best_saving,
         "saving_rows": saving_rows, "titles": titles}, indent=1) + "\n")
    text = report(rows, titles, chosen, wall, saving_rows)
    (OUT / "wait_tradeoff.md").write_text(text)
    print(text)


def _rows(results: dict, key: str, seed: int, column: str) -> list[dict]:
    """One row per run of a scenario and seed, all over one energy window; ``column`` names what
    the runs differ in (``patience``: "greedy-fastest" or "<h> h"; ``saving``: its share)."""
    acc = energy_accounts(results)
    out = []
    for name, r in results.items():
        s = r.summary()
        row = {"scenario": key, "seed": seed, column: name,
               "always_on_vs_greedy": acc[name].always_on_vs["greedy-fastest"],
               "parked_vs_greedy": acc[name].parked_vs["greedy-fastest"],
               "sla_attainment": s["sla_attainment"], "avg_jct_h": s["avg_jct_s"] / 3600,
               "avg_queue_h": s["avg_queue_s"] / 3600, "makespan_h": s["makespan_s"] / 3600,
               "unfinished": s["jobs_unfinished"]}
        if column == "patience":
            row["hours"] = None if name == "greedy-fastest" else int(name.split()[0])
        out.append(row)
    return out


def candidate_rows(candidates: Mapping[str, Any], column: str,
                   run: Callable[[Any, list, SimConfig, Any], SimResult],
                   extra: Callable[[dict], dict]) -> list[dict]:
    """Every candidate beside greedy-fastest on the selection scenarios and seeds, each scenario
    and seed over one energy window: a row per candidate run, named in ``column``, with the
    energy ratios, the lowest SLA, the mean JCT and what ``extra`` takes from its summary.
    ``run(scenario, gpus, config, value)`` simulates one candidate."""
    rows: list[dict] = []
    for seed in SELECTION_SEEDS:
        for sc in (s for s in scenarios(seed) if s.key in KEYS):
            t0 = time.perf_counter()
            gpus = parse_cluster(sc.cluster)
            config = SimConfig(seed=seed, noise=sc.noise)
            results = run_policies(sc.jobs, gpus, sc.truth, ["greedy-fastest"], config=config)
            for name, value in candidates.items():
                results[name] = run(sc, gpus, config, value)
            acc = energy_accounts(results)
            for name in candidates:
                s = results[name].summary()
                rows.append({"scenario": sc.key, "seed": seed, column: name,
                             "always_on_vs_greedy": acc[name].always_on_vs["greedy-fastest"],
                             "parked_vs_greedy": acc[name].parked_vs["greedy-fastest"],
                             "sla_attainment": s["sla_attainment"], "avg_jct_h": s["avg_jct_s"] / 3600, **extra(s)})
            print(f"{sc.key} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def energy_cells(rs: list[dict]) -> str:
    """A candidate's always-on and parked ratios, lowest SLA and mean JCT over its rows, as table cells."""
    return (f"{spread([r['always_on_vs_greedy'] for r in rs])} | {spread([r['parked_vs_greedy'] for r in rs])} | "
            f"{attainment_text(min(r['sla_attainment'] for r in rs))} | {statistics.fmean(r['avg_jct_h'] for r in rs):.2f}")


def saving_means(saving_rows: list[dict]) -> dict[float, float]:
    """Each saving's mean always-on ratio over the scenarios and seeds."""
    return {x: statistics.fmean(r["always_on_vs_greedy"] for r in saving_rows if r["saving"] == f"{x:g}")
            for x in SAVINGS}


def spread(values: list[float], digits: int = 3) -> str:
    return f"{statistics.fmean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def report(rows: list[dict], titles: dict[str, str], chosen: float, wall: float,
           saving_rows: list[dict] | None = None) -> str:
    lines = ["# Waiting for an efficient GPU: energy against completion time", "",
             "Regenerated by `.venv/bin/python benchmarks/wait_tradeoff.py` with the selection seeds "
             f"{', '.join(map(str, SELECTION_SEEDS))} (the reports use seeds 0-2). `{POLICY}` with new jobs waiting "
             f"up to the patience for a GPU type that saves at least {WAIT_SAVING:.0%} energy; one energy window per "
             "scenario and seed (its ratios compare with each other, not with docs/evaluation.md's). Mean "
             "[min, max] over the seeds; SLA attainment, the lowest seed.", ""]
    for key, title in titles.items():
        lines += [f"## {title}", "", "| patience | always on vs greedy-fastest | parked vs greedy-fastest | "
                  "SLA, lowest | avg JCT h | avg queue h | makespan h |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name in ["greedy-fastest", *(f"{h} h" for h in HOURS)]:
            rs = [r for r in rows if r["scenario"] == key and r["patience"] == name]
            lines.append(f"| {name} | {spread([r['always_on_vs_greedy'] for r in rs])} | "
                         f"{spread([r['parked_vs_greedy'] for r in rs])} | {attainment_text(min(r['sla_attainment'] for r in rs))} | "
                         f"{statistics.fmean(r['avg_jct_h'] for r in rs):.2f} | "
                         f"{statistics.fmean(r['avg_queue_h'] for r in rs):.2f} | "
                         f"{statistics.fmean(r['makespan_h'] for r in rs):.1f} |")
        lines.append("")
    lines += ["## The choice", "", "| patience | always on vs greedy-fastest, mean over the scenarios and seeds |",
              "| --- | ---: |"]
    for h in HOURS:
        lines.append(f"| {h} h | {statistics.fmean(r['always_on_vs_greedy'] for r in rows if r['hours'] == h):.3f} |")
    lines += ["", f"Chosen: **{chosen:g} h** (least mean; a difference under {TIE} is a tie, to the shorter). "
              f"`sim.run.WAIT_S` is {chosen:g} h.", ""]
    if saving_rows:
        lines += ["## The saving a held job waits for, at the chosen patience", "",
                  "Each scenario and seed over one window of its own (greedy-fastest and the savings below), so these "
                  "ratios compare with each other only.", "",
                  "| scenario | saving | always on vs greedy-fastest | parked vs greedy-fastest | SLA, lowest | avg JCT h |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for key, title in titles.items():
            for x in SAVINGS:
                rs = [r for r in saving_rows if r["scenario"] == key and r["saving"] == f"{x:g}"]
                lines.append(f"| {title} | {x:.0%} | {spread([r['always_on_vs_greedy'] for r in rs])} | "
                             f"{spread([r['parked_vs_greedy'] for r in rs])} | "
                             f"{attainment_text(min(r['sla_attainment'] for r in rs))} | "
                             f"{statistics.fmean(r['avg_jct_h'] for r in rs):.2f} |")
        means = saving_means(saving_rows)
        best_saving = min(means, key=means.__getitem__)
        near = [f"{x:.0%}" for x in SAVINGS if x != best_saving and means[x] <= means[best_saving] + TIE]
        lines += ["", "Mean always-on ratio over the scenarios and seeds: "
                  + ", ".join(f"{x:.0%} {m:.3f}" for x, m in means.items())
                  + f". Least: **{best_saving:.0%}**"
                  + (f" ({' and '.join(near)} within {TIE} of it)" if near else "")
                  + f"; `sim.run.WAIT_SAVING` is {WAIT_SAVING:.0%}.", ""]
    lines += [f"Wall time: {wall:.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

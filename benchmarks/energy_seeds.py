"""Issue 12's energy bar over seeds 0-2: how much of docs/evaluation.md's seed-0 figure is the seed.

docs/evaluation.md runs every scenario once, with seed 0. A ratio such as 0.832 against
greedy-fastest then mixes what the policy does with one draw of arrivals, requirements and
noise. This script runs the energy policies of every scenario of that page, and the learned
policies of its section (e) (Gavel's trace and the modern fleet, each re-labelled to a family the
predictors never saw), with seeds 0, 1 and 2 (each seed draws the generated streams,
every job's requirement, the held-out family's job types and the measurement noise; the
traces, fleets and truth tables stay), GPUs always on, and reports each policy's mean
[min, max] over the seeds of its energy over one common window against greedy-fastest (always
on, and parked from the same run), with SLA attainment; then which scenarios meet issue 12's
bar on every seed, the oracle beside each learned run (issue 12 asks for both bars on one
scenario), and beside every row the floor of that run (``sim.bound``: the least always-on
energy any schedule choosing among the same limit levels could spend, with hindsight and jobs
free to wait), so a seed that misses the bar says whether any policy could have met it. The
predictors of (e) are trained once per held-out family (seed 0, as the page's),
so the spread is the workload's, not the training's.

Writes ``benchmarks/results/energy_seeds.{json,md}`` and the marked block of
docs/evaluation.md (``benchmarks/evaluate_policies.py`` keeps that block when it regenerates
the page).

    .venv/bin/python benchmarks/energy_seeds.py            # runs everything (about 45 min)
    .venv/bin/python benchmarks/energy_seeds.py report     # the tables again from the saved JSON
    .venv/bin/python benchmarks/energy_seeds.py modern     # the modern fleet's learned runs only
    .venv/bin/python benchmarks/energy_seeds.py unseen     # (b)'s and (f)'s own streams, every family unseen
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.progress import Progress
from collections import Counter

from gogh_flows.sim.account import busy_gpu_hours, energy_accounts
from gogh_flows.sim.bound import floor_rows
from gogh_flows.sim.engine import SimConfig, TrueRates, attainment_text
from gogh_flows.sim.holdout import train_each_unseen, train_holdout
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS, parse_cluster, run_policies
from gogh_flows.sim.traces import read_trace
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import (  # noqa: E402 - one definition of every scenario
    DOC,
    HOLDOUTS,
    LEARNED_BAR,
    MODERN_RUN,
    NOISE,
    P1_EPOCHS,
    P2_EPOCHS,
    SEED,
    SEEDS_BEGIN,
    SEEDS_END,
    holdout_jobs,
    modern_fleet,
    modern_holdout_jobs,
    scenarios,
)

SEEDS = (0, 1, 2)
OUT = Path(__file__).resolve().parent / "results"
#: the policies of every scenario: the simple baselines, then the optimiser's energy variants
POLICIES = ("greedy-fastest", "first-fit", "greedy-efficiency", "oracle", "oracle+limits", "oracle+limits+fleet",
            "oracle+limits+fleet+wait")
#: the learned runs of (e): greedy-fastest as the reference, the learned policies, oracle's best variant
LEARNED = ("greedy-fastest", *LEARNED_BAR, "oracle+limits+fleet+wait")
ORACLES = tuple(p for p in POLICIES if p.startswith("oracle"))
#: the modern fleet's learned runs as this script's saved table ran them: without the page's
#: greedy-fastest+cap, whose longer completions would lengthen their common window
MODERN = tuple(p for p in MODERN_RUN if p != "greedy-fastest+cap")
BEGIN, END = SEEDS_BEGIN, SEEDS_END


def figures(results: dict) -> dict[str, dict[str, float]]:
    """Per policy: always-on and parked energy over one common window against greedy-fastest, SLA;
    and its makespan and busy GPU-hours per type (what sets the window: the report's tables leave
    them to the JSON)."""
    acc = energy_accounts(results)
    out = {}
    for name, r in results.items():
        s = r.summary()
        out[name] = {"on": acc[name].always_on_vs["greedy-fastest"], "parked": acc[name].parked_vs["greedy-fastest"],
                     "sla": s["sla_attainment"], "makespan_h": s["makespan_s"] / 3600, "busy_gpu_h": busy_gpu_hours(r)}
    return out


def floor(jobs: list, cluster: str, truth, noise: float, seed: int, results: dict) -> dict[str, float | str]:
    """The run's floors against greedy-fastest, always on: ``wait`` (jobs free to wait until the
    common window's end) and ``due`` (no job done later than greedy-fastest did it), both with
    the policies' limit levels; a ``note`` where the relaxation gave none."""
    fleet = Counter(g.gpu_type for g in parse_cluster(cluster))
    rows = floor_rows(jobs, fleet, TrueRates(truth, noise, seed), results, levels=DEFAULT_LIMIT_LEVELS, label="floor")
    out: dict[str, float | str] = {}
    for key, when in (("wait", "floor, may wait"), ("due", "floor, by greedy-fastest")):
        row = rows.get(when, {})
        if "on_vs_greedy-fastest" in row:
            out[key] = row["on_vs_greedy-fastest"]
        elif "note" in row:
            out[f"{key}_note"] = row["note"]
    return out


def label(title: str) -> str:
    """``(f, noise)`` of "(f, noise) As (f), with measurement noise 0.1"."""
    return title.split(")", 1)[0] + ")"


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def scenario_runs(bars: Progress) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for i, seed in enumerate(SEEDS):
        for sc in scenarios(seed):
            t0 = time.perf_counter()
            on = run_policies(sc.jobs, parse_cluster(sc.cluster), sc.truth, POLICIES,
                              config=SimConfig(seed=seed, noise=sc.noise))
            entry = out.setdefault(sc.key, {"title": sc.title, "jobs": len(sc.jobs), "runs": {}, "floors": {}})
            entry["runs"][str(seed)] = figures(on)
            entry["floors"][str(seed)] = floor(sc.jobs, sc.cluster, sc.truth, sc.noise, seed, on)
            print(f"{sc.key} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
        bars.update("seeds, scenarios", i + 1, len(SEEDS))
    return out


def learned_runs(bars: Progress) -> dict[str, dict]:
    data = gavel_dir()
    gavel = read_gavel_json(data / "simulation_throughputs.json")
    cluster = "v100=8,p100=16,k80=24"
    gpus = parse_cluster(cluster)
    raw = read_trace(data / "traces" / "physical_cluster" / "max_min_fairness.trace")
    out: dict[str, dict] = {}
    for k, fam in enumerate(HOLDOUTS):
        pred = train_holdout(gavel, fam, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
        for seed in SEEDS:
            jobs = holdout_jobs(gavel, raw, fam, cluster, [], seed=seed)
            for nz in (0.0, NOISE):
                t0 = time.perf_counter()
                on = run_policies(jobs, gpus, gavel, LEARNED, config=SimConfig(seed=seed, noise=nz), predictors=pred)
                entry = out.setdefault(f"{fam}, noise {nz:g}", {"runs": {}, "floors": {}})
                entry["runs"][str(seed)] = figures(on)
                entry["floors"][str(seed)] = floor(jobs, cluster, gavel, nz, seed, on)
                print(f"(e) {fam} noise {nz:g} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
        bars.update("held-out families", k + 1, len(HOLDOUTS))
    return out


def modern_runs(bars: Progress) -> dict[str, dict]:
    """(e)'s learned policies on the modern fleet (the section of docs/evaluation.md that runs
    seed 0 only), seeds 0-2: P1 and P2 trained once on (f)'s truth without the family."""
    truth, cluster, _ = modern_fleet(SEED)  # cached: the truth and fleet every seed's jobs share
    pred = train_holdout(truth, HOLDOUTS[0], p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
    out: dict[str, dict] = {}
    for i, seed in enumerate(SEEDS):
        _, _, jobs = modern_holdout_jobs(seed)
        for nz in (0.0, NOISE):
            t0 = time.perf_counter()
            on = run_policies(jobs, parse_cluster(cluster), truth, MODERN, config=SimConfig(seed=seed, noise=nz),
                              predictors=pred)
            entry = out.setdefault(f"modern fleet, {HOLDOUTS[0]}, noise {nz:g}", {"runs": {}, "floors": {}})
            entry["runs"][str(seed)] = figures(on)
            entry["floors"][str(seed)] = floor(jobs, cluster, truth, nz, seed, on)
            print(f"(e, modern) noise {nz:g} seed {seed}: {time.perf_counter() - t0:.1f} s", flush=True)
        bars.update("modern fleet, seeds", i + 1, len(SEEDS))
    return out


#: the scenarios whose own mix runs with every job's family unseen: (scenario key, label)
UNSEEN = (("gavel-physical", "(b)"), ("modern-mixed", "(f)"))


def unseen_runs(bars: Progress) -> dict[str, dict]:
    """The learned policies on the scenarios' own streams, every job planned with predictors trained
    without its family (``sim.unseen``; one training per family, seed 0), noise 0 and 0.1, seeds 0-2."""
    out: dict[str, dict] = {}
    for k, (key, letter) in enumerate(UNSEEN):
        runs = {seed: {sc.key: sc for sc in scenarios(seed)}[key] for seed in SEEDS}
        truth = runs[SEED].truth
        family_of = MeasuredSet.from_table(truth).family
        families = sorted({family_of[j.job_type] for sc in runs.values() for j in sc.jobs})  # as the CLI trains
        t0 = time.perf_counter()
        pred = train_each_unseen(truth, families, p1_epochs=P1_EPOCHS, p2_epochs=P2_EPOCHS, seed=SEED, intervals=True)
        print(f"{letter} every family unseen ({', '.join(families)}): training {time.perf_counter() - t0:.1f} s",
              flush=True)
        for seed, sc in runs.items():
            for nz in (0.0, NOISE):
                t0 = time.perf_counter()
                on = run_policies(sc.jobs, parse_cluster(sc.cluster), sc.truth, LEARNED,
                                  config=SimConfig(seed=seed, noise=nz), predictors=pred)
                entry = out.setdefault(f"{letter} every family unseen, noise {nz:g}", {"runs": {}, "floors": {}})
                entry["runs"][str(seed)] = figures(on)
                entry["floors"][str(seed)] = floor(sc.jobs, sc.cluster, sc.truth, nz, seed, on)
                print(f"{letter} every family unseen, noise {nz:g}, seed {seed}: {time.perf_counter() - t0:.1f} s",
                      flush=True)
        bars.update("every family unseen", k + 1, len(UNSEEN))
    return out


def window_note(scen: dict, learned: dict) -> str:
    """(b)'s best oracle variant in its own run and beside the learned policies, where both were run."""
    own, beside = scen.get("gavel-physical"), learned.get("(b) every family unseen, noise 0")
    if not own or not beside:
        return ""
    name, learner = "oracle+limits+fleet+wait", "gogh+limits+fleet+wait"
    runs = list(beside["runs"].values())
    why = ""
    if all("makespan_h" in r[n] for r in runs for n in (name, learner)):  # saved since 2026-11-29
        def mean(n: str, key) -> float:
            return statistics.fmean(key(r[n]) for r in runs)

        top = max(runs[0][name]["busy_gpu_h"], key=lambda t: mean(name, lambda f: f["busy_gpu_h"][t]))
        ends = [mean(n, lambda f: f["makespan_h"]) for n in (learner, name)]
        busy = [mean(n, lambda f: f["busy_gpu_h"][top]) for n in (learner, name)]
        why = (f"; there {learner} ended at {ends[0]:.1f} h on average against {ends[1]:.1f} h, the {top} GPUs "
               f"(the type the oracle kept busiest) busy {busy[0]:.0f} GPU-hours against {busy[1]:.0f}"
               + (": it queued more work for them, on predicted rates" if ends[0] > ends[1] and busy[0] > busy[1]
                  else ""))
    return (f" (on (b), {name} {spread([r[name]['on'] for r in runs])} beside the learned "
            f"policies, {spread([r[name]['on'] for r in own['runs'].values()])} in (b)'s own run, on the same jobs"
            f"{why})")


def report(scen: dict, learned: dict, wall_s: float) -> list[str]:
    lines = [
        "## Issue 12's bar over seeds 0-2",
        "",
        f"`benchmarks/energy_seeds.py` ({wall_s / 60:.0f} min, 2 cores; "
        "`benchmarks/results/energy_seeds.{json,md}`): every scenario above, the learned runs of (e), and "
        "the learned policies on (b)'s and (f)'s own streams with every job's family unseen, "
        "with seeds 0, 1 and 2 (each draws the generated streams, the requirements, (e)'s job types and the "
        "noise; traces, fleets and truth stay; (e)'s predictors trained once per family, seed 0), GPUs "
        "always on. Energy over one common window against greedy-fastest, mean [min, max] over the seeds, "
        "always on and parked (what the jobs drew, from the same run; the tables above simulate a parked "
        "fleet apart); SLA attainment, the lowest seed. Seed 0 repeats the runs above with fewer policies, so its "
        "common window, and its ratios, can differ from theirs by about 0.01. "
        "The oracle beside a learned run is from that run: where the learned policies finish later, its window is "
        "longer, and its always-on ratio higher, than in the scenario's own run" + window_note(scen, learned) + ".",
        "",
        "| scenario | policy | always on vs greedy-fastest | parked vs greedy-fastest | SLA, lowest |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for key, entry in scen.items():
        runs = list(entry["runs"].values())
        letter = label(entry["title"])
        for name in POLICIES:
            lines.append(f"| {letter} | {name} | {spread([r[name]['on'] for r in runs])} | "
                         f"{spread([r[name]['parked'] for r in runs])} | {attainment_text(min(r[name]['sla'] for r in runs))} |")
    lines += ["", "The learned policies of (e) (Gavel's physical-cluster trace re-labelled to a held-out family; "
              f"'modern fleet': scenario (f)'s stream re-labelled to {HOLDOUTS[0]}, as in (e)'s last table, its "
              "predictors trained on (f)'s truth without the family, seed 0; '(b)/(f) every family unseen': "
              "that scenario's own stream and mix, every job planned with predictors trained without its "
              "family, one training per family, seed 0, `gogh_flows/sim/unseen.py`):", "",
              "| held-out family | policy | always on vs greedy-fastest | parked vs greedy-fastest | SLA, lowest |",
              "| --- | --- | ---: | ---: | ---: |"]
    for key, entry in learned.items():
        runs = list(entry["runs"].values())
        for name in LEARNED[1:]:
            lines.append(f"| {key} | {name} | {spread([r[name]['on'] for r in runs])} | "
                         f"{spread([r[name]['parked'] for r in runs])} | {attainment_text(min(r[name]['sla'] for r in runs))} |")
    lines += ["", "Against the bar, seed by seed (always on, at SLA attainment >= 0.98): the variant that "
              "meets it on the most seeds (then the lowest mean), and on how many seeds it is at or under the bar; where a learned policy runs, the "
              "oracle's best variant of the same runs beside it (issue 12 asks for both on one scenario). "
              "Beside each, the run's floor (`gogh_flows/sim/bound.py`, as under each scenario's table above, "
              "per seed): the least always-on energy any schedule choosing among the same limit levels could "
              "spend, with hindsight and jobs free to wait until the common window's end, and on how many seeds "
              "that floor is itself at or under the bar. A seed whose floor is above the bar is one no policy "
              "could meet it on; a floor within 0.01 under it leaves a policy without hindsight no room.", "",
              "| scenario | bar | variant | always on vs greedy-fastest | seeds at or under the bar | "
              "floor, jobs may wait | seeds the floor allows |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for title, runs, floors, names, bar in (
            *((label(e["title"]), list(e["runs"].values()), e.get("floors", {}), ORACLES, 0.80)
              for e in scen.values()),
            *(row for key, e in learned.items()
              for row in ((key, list(e["runs"].values()), e.get("floors", {}), LEARNED_BAR, 0.85),
                          (key, list(e["runs"].values()), e.get("floors", {}), ("oracle+limits+fleet+wait",),
                           0.80)))):
        def met(n: str) -> int:
            return sum(r[n]["on"] <= bar and r[n]["sla"] >= 0.98 for r in runs)

        # the variant that meets the bar on the most seeds (a lower mean at attainment under 0.98
        # would not), then the lowest mean
        best = min(names, key=lambda n: (-met(n), statistics.fmean(r[n]["on"] for r in runs)))
        ok = met(best)
        waits = [f["wait"] for f in floors.values() if "wait" in f]
        floor_text = spread(waits) if waits else "n/a"
        allows = (f"{sum(w <= bar for w in waits)} of {len(waits)}"
                  + (f" ({len(floors) - len(waits)} not solved)" if len(waits) < len(floors) else "")
                  if floors else "n/a")
        lines.append(f"| {title} | {bar:.2f} | {best} | {spread([r[best]['on'] for r in runs])} | "
                     f"{ok} of {len(runs)} | {floor_text} | {allows} |")
    return lines + ["", *verdict(learned)]


def verdict(learned: dict) -> list[str]:
    """Issue 12's reading of the table: the learned runs where both bars hold on every seed (the
    learned policy <= 0.85 and the oracle <= 0.80 of the same runs, at attainment >= 0.98)."""
    def seeds_met(runs: list, names, bar: float) -> int:
        return max(sum(r[n]["on"] <= bar and r[n]["sla"] >= 0.98 for r in runs) for n in names)

    both, near = [], []
    for key, e in learned.items():
        runs = list(e["runs"].values())
        mine, oracle = seeds_met(runs, LEARNED_BAR, 0.85), seeds_met(runs, ("oracle+limits+fleet+wait",), 0.80)
        if mine == oracle == len(runs):
            both.append(key)
        elif mine + oracle >= 2 * len(runs) - 1:
            near.append(f"{key} (learned {mine} of {len(runs)}, oracle {oracle} of {len(runs)})")
    return [f"Both bars on every seed ({len(both)} of the {len(learned)} learned runs; issue 12 asks for three "
            f"scenarios, one on Gavel's measured throughputs): {'; '.join(both) or 'none'}. One seed short: "
            f"{'; '.join(near) or 'none'}."]


def tables(saved: dict) -> list[str]:
    """The report of a saved run (``energy_seeds.json``)."""
    return report(saved["scenarios"], {**saved["learned"], **saved.get("learned_modern", {}),
                                       **saved.get("learned_unseen", {})}, saved["wall_s"])


def write_block(lines: list[str]) -> None:
    """Into docs/evaluation.md between the markers (appended with them the first time)."""
    text = DOC.read_text()
    block = BEGIN + "\n\n" + "\n".join(lines) + "\n\n" + END
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(text)


#: the parts a mode reruns alone, into the saved JSON (the rest as saved): mode -> (runner, key, seconds key)
PARTS = {"modern": (modern_runs, "learned_modern", "modern_s"), "unseen": (unseen_runs, "learned_unseen", "unseen_s")}


def main(argv: list[str]) -> None:
    """``report``: rewrite the tables from the saved JSON, without running anything; ``modern``:
    run the modern fleet's learned runs only, ``unseen``: the runs with every family unseen only,
    into the saved JSON (the rest as saved)."""
    if argv[:1] and argv[0] not in ("report", *PARTS):
        raise SystemExit(f"unknown mode {argv[0]!r}; choose report, {', '.join(PARTS)} or nothing (run everything)")
    if argv[:1]:
        saved = json.loads((OUT / "energy_seeds.json").read_text())
        if argv[0] in PARTS:
            run, key, secs = PARTS[argv[0]]
            t0 = time.perf_counter()
            with Progress() as bars:
                part = run(bars)
            took = time.perf_counter() - t0
            saved.update({key: part, secs: round(took, 1)},
                         wall_s=round(saved["wall_s"] - saved.get(secs, 0.0) + took, 1))
            (OUT / "energy_seeds.json").write_text(json.dumps(saved, indent=1))
    else:
        t0 = time.perf_counter()
        with Progress() as bars:
            scen = scenario_runs(bars)
            learned = learned_runs(bars)
            t1 = time.perf_counter()
            modern = modern_runs(bars)
            t2 = time.perf_counter()
            unseen = unseen_runs(bars)
        wall = time.perf_counter() - t0
        saved = {"seeds": list(SEEDS), "policies": list(POLICIES), "learned_policies": list(LEARNED),
                 "scenarios": scen, "learned": learned, "learned_modern": modern, "learned_unseen": unseen,
                 "modern_s": round(t2 - t1, 1), "unseen_s": round(wall - (t2 - t0), 1), "wall_s": round(wall, 1)}
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "energy_seeds.json").write_text(json.dumps(saved, indent=1))
    lines = tables(saved)
    (OUT / "energy_seeds.md").write_text("\n".join(lines) + "\n")
    write_block(lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The simple baseline for power limits: greedy-fastest with every board under one fixed cap.

docs/evaluation.md's baselines run every board at its full limit, while ``oracle+limits``
chooses a limit per placement; a reviewer (2026-12-07) asked how much of that saving one cap
for the whole fleet already gets, which is what an operator would try first (``nvidia-smi
-pl`` on every board; Zeus's finding that a fixed fraction does not carry over across GPUs
and jobs is the reason to do better). Here greedy-fastest places as always, and every
assignment runs at the same fraction ``f`` of its GPU type's limit range; a job measured
below its requirement there is lifted to the lowest level that meets it, by the engine's
guard, as ``oracle+limits``' jobs are (``gogh simulate --policy greedy-fastest+cap``, at the
fraction chosen here: ``gogh_flows.sim.run.CAP_FRACTION``). ``f`` is chosen per scenario on the selection seeds
10-12 (the lowest mean always-on energy with SLA attainment >= 0.98 on every selection seed),
never on the reported seeds 0-2, each fraction read beside greedy-fastest alone (a window the
time-limited optimiser's end does not move). Reported: energy over one common window of
greedy-fastest, the cap and ``oracle+limits`` (the ``+wait`` variants stretch a window,
docs/evaluation.md; they are left out so the three compare on the same hours).

Writes ``benchmarks/results/static_cap.{json,md}``.

    .venv/bin/python benchmarks/static_cap.py      # about 3 min on 2 cores
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policies import scenarios  # noqa: E402 - the page's own scenarios

from gogh_flows.placement.baselines import CappedGreedyFastest  # noqa: E402
from gogh_flows.placement.problem import TableThroughputs  # noqa: E402
from gogh_flows.sim.account import energy_accounts  # noqa: E402
from gogh_flows.sim.engine import SimConfig, attainment_text, simulate  # noqa: E402
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS, make_policy, parse_cluster  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
KEYS = ("synthetic", "gavel-physical", "gavel-physical-noise", "modern-mixed")
FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
SELECT, REPORT = (10, 11, 12), (0, 1, 2)


def _figures(results: dict, names: tuple[str, ...]) -> dict[str, dict]:
    """Each named policy against greedy-fastest over the common window of ``names`` alone."""
    acc = energy_accounts({n: results[n] for n in names})
    return {n: {"on": acc[n].always_on_vs["greedy-fastest"], "parked": acc[n].parked_vs["greedy-fastest"],
                "sla": results[n].summary()["sla_attainment"], "jct_h": results[n].summary()["avg_jct_s"] / 3600}
            for n in names}


def run(sc, seed: int) -> dict[str, dict]:
    """Per fraction: the cap beside greedy-fastest alone (``pair``: what the choice reads, free of the
    time-limited optimiser's end), and beside greedy-fastest and ``oracle+limits`` (``triple``: what
    is reported)."""
    gpus = parse_cluster(sc.cluster)
    config = SimConfig(seed=seed, noise=sc.noise)
    counts = Counter(g.gpu_type for g in gpus)
    results = {}
    for name in ("greedy-fastest", "oracle+limits"):
        p = make_policy(name, sc.truth, seed, gpu_types=sorted(counts), gpu_counts=counts)
        results[name] = simulate(sc.jobs, gpus, sc.truth, p.policy, planning=p.planning, config=config,
                                 reoptimize_s=p.reoptimize_s, patience=p.patience)
    out: dict[str, dict] = {"pair": {}, "triple": {}}
    for f in FRACTIONS:
        name = f"greedy-fastest, cap {f:g}"
        policy = CappedGreedyFastest(name=name, cap_fraction=f, power_limit_levels=DEFAULT_LIMIT_LEVELS)
        results[name] = simulate(sc.jobs, gpus, sc.truth, policy, planning=TableThroughputs(sc.truth), config=config)
        out["pair"][f"{f:g}"] = _figures(results, ("greedy-fastest", name))[name]
        out["triple"][f"{f:g}"] = _figures(results, ("greedy-fastest", name, "oracle+limits"))
    return out


def main() -> dict:
    t0 = time.perf_counter()
    by_seed = {s: {sc.key: sc for sc in scenarios(s)} for s in (*SELECT, *REPORT)}
    out: dict = {"fractions": list(FRACTIONS), "selection_seeds": list(SELECT), "report_seeds": list(REPORT),
                 "scenarios": {}}
    for key in KEYS:
        runs = {s: run(by_seed[s][key], s) for s in (*SELECT, *REPORT)}
        ok = [f for f in FRACTIONS if min(runs[s]["pair"][f"{f:g}"]["sla"] for s in SELECT) >= 0.98]
        chosen = min(ok, key=lambda f: statistics.fmean(runs[s]["pair"][f"{f:g}"]["on"] for s in SELECT),
                     default=None)
        out["scenarios"][key] = {"title": by_seed[0][key].title, "chosen_fraction": chosen,
                                 "runs": {s: runs[s] for s in (*SELECT, *REPORT)}}
        print(f"{key}: cap {chosen} chosen ({time.perf_counter() - t0:.0f} s)", flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def spread(xs: list[float]) -> str:
    """Mean [min, max] over the seeds, as the seed tables of docs/evaluation.md print them."""
    return f"{statistics.fmean(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def save(name: str, data: dict, lines: list[str]) -> None:
    """``benchmarks/results/<name>.{json,md}``, and the table printed."""
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=1))
    text = "\n".join(lines) + "\n"
    (OUT / f"{name}.md").write_text(text)
    print(text)


def report(d: dict) -> list[str]:
    lines = ["# One fixed cap for the whole fleet: the simple baseline for power limits", "",
             f"`benchmarks/static_cap.py` ({d['wall_s']:.0f} s, 2 cores). Greedy-fastest with every board at one "
             f"fraction of its type's limit range (candidates {', '.join(f'{f:g}' for f in d['fractions'])}), the "
             "fraction chosen per scenario on seeds 10-12 (lowest mean always-on energy at SLA attainment >= 0.98 on "
             "each, each fraction beside greedy-fastest alone), reported on seeds 0-2 beside greedy-fastest at full "
             "power and `oracle+limits`, over the common window of those three; mean [min, max] over the seeds; SLA "
             "attainment, the lowest seed. 'share of oracle+limits' saving': (1 - cap) / (1 - oracle+limits), always "
             "on, per seed, averaged.", "",
             "| scenario | cap chosen | policy | always on vs greedy-fastest | parked vs greedy-fastest | SLA, lowest "
             "| avg JCT h | share of oracle+limits' saving |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for e in d["scenarios"].values():
        f = e["chosen_fraction"]
        if f is None:
            continue
        cap = f"greedy-fastest, cap {f:g}"
        triples = [e["runs"][str(s) if str(s) in e["runs"] else s]["triple"][f"{f:g}"] for s in d["report_seeds"]]
        for n in ("greedy-fastest", cap, "oracle+limits"):
            rows = [t[n] for t in triples]
            share = (f"{statistics.fmean((1 - t[cap]['on']) / (1 - t['oracle+limits']['on']) for t in triples):.2f}"
                     if n == cap else "")
            lines.append(f"| {e['title'].split(')')[0]}) | {f'{f:g}' if n == cap else ''} | {n} | "
                         f"{spread([r['on'] for r in rows])} | {spread([r['parked'] for r in rows])} | "
                         f"{attainment_text(min(r['sla'] for r in rows))} | "
                         f"{statistics.fmean(r['jct_h'] for r in rows):.2f} | {share} |")
    return lines


if __name__ == "__main__":
    result = main()
    save("static_cap", result, report(result))

"""How well could *any* simple limit rule do on Zeus's curves? A bound for `gogh power evaluate`.

`gogh power evaluate` (docs/energy.md, "Power limits") asks a model fitted on other GPUs to
choose a limit from one full-power measurement. Before blaming the model, this script asks
what the best rule of two simple families achieves when it is tuned **on the held-out GPU's
own measured curves** (in-sample, with hindsight: an optimistic bound, not a method):

* ``k``: the lowest limit ``L >= k * P0`` (a limit relative to the job's full-power draw);
* ``affine``: the lowest limit ``L >= idle + k * (P0 - idle) + c * (L_max - idle)``.

* ``increasing``: **any** rule "the lowest measured limit at or above a threshold that never
  falls as the full-power draw rises" (the two above among them, and the held-out model's
  first choices, checked here), the best one found exactly by dynamic programming over the
  configurations sorted by their full-power draw.

For each GPU and requirement r it reports the least mean energy regret among the rule's
settings whose violation rate is <= 2% (the issue's bar), scored exactly as the evaluation
scores the model. It also counts the configurations where a limit that cannot bind
(``L >= 1.5 P0``, below the maximum) was measured slower than r of full speed: run-to-run
noise that no rule lowering limits can avoid.

    .venv/bin/python benchmarks/power_limit_bound.py [--data ../shared/data/zeus]

Writes ``benchmarks/results/power_limit_bound.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from gogh_flows.power_limits import (
    REQUIREMENTS,
    LimitMeasurement,
    TraceSet,
    _configs,
    _measured_best,
    choose_limit,
    fit_power_limit_model,
    read_traces,
)

OUT = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "zeus"
BAR_VIOLATIONS = 0.02


def score_threshold(trace: TraceSet, threshold, r: float) -> tuple[float, float]:
    """(violation rate, mean regret) of 'the lowest measured limit >= threshold(P0)'."""
    chosen, best, violated = [], [], []
    for lim, t, p, t0, p0 in _configs(trace):
        ok = np.flatnonzero(lim >= threshold(p0))
        i = int(ok[0]) if ok.size else int(np.argmax(lim))  # lim is sorted ascending
        b = _measured_best(lim, t, p, t0, r)
        chosen.append(t[i] * p[i])
        best.append(t[b] * p[b])
        violated.append(t0 / t[i] < r - 1e-12)
    return float(np.mean(violated)), float(np.mean(np.array(chosen) / np.array(best) - 1.0))


def best_increasing(trace: TraceSet, r: float) -> dict | None:
    """The least mean regret of any rule "the lowest measured limit at or above a threshold that
    never falls as the full-power draw rises", at <= 2% violations: exact, by dynamic programming
    over (configuration by draw, the threshold on every limit any configuration was measured at,
    violations used so far). A configuration measured at fewer limits takes its lowest one at or
    above the threshold (its highest when none is), as the other rules and the model do, so its
    own choice may fall where a neighbour's was measured in finer steps."""
    configs = sorted(_configs(trace), key=lambda c: c[4])
    grid = np.unique(np.concatenate([c[0] for c in configs]))
    n, m = len(configs), len(grid)
    allowed = int(np.floor(BAR_VIOLATIONS * n + 1e-9))
    cost = np.zeros((n, m))
    bad = np.zeros((n, m), dtype=int)
    for j, (lim, t, p, t0, _) in enumerate(configs):
        b = _measured_best(lim, t, p, t0, r)
        for i, w in enumerate(grid):
            above = np.flatnonzero(lim >= w)
            k = int(above[np.argmin(lim[above])]) if above.size else int(np.argmax(lim))
            cost[j, i] = t[k] * p[k] / (t[b] * p[b]) - 1.0
            bad[j, i] = int(t0 / t[k] < r - 1e-12)
    # best[i, v]: least total regret so far with the last threshold at index <= i and v violations used
    best = np.full((m, allowed + 1), np.inf)
    best[:, 0] = 0.0
    for j in range(n):
        new = np.full((m, allowed + 1), np.inf)
        for v in range(allowed + 1):
            for i in range(m):
                u = v - bad[j, i]
                if u >= 0:
                    new[i, v] = best[i, u] + cost[j, i]
        best = np.minimum.accumulate(new, axis=0)  # a higher-drawing job may take any threshold >= it
    total = float(best[-1].min())
    if not np.isfinite(total):
        return None
    return {"setting": [], "violation_rate": int(np.argmin(best[-1])) / n, "regret_mean": total / n}


def chosen_by_increasing_threshold(trace: TraceSet, chosen: list[float]) -> bool:
    """Whether limits ``chosen`` per configuration (in :func:`_configs`' order) are what some
    threshold that never falls as the draw rises picks, each configuration taking its lowest
    measured limit at or above it: the class :func:`best_increasing` searches."""
    configs = list(_configs(trace))
    order = sorted(range(len(configs)), key=lambda j: configs[j][4])
    floor = -np.inf  # the least threshold the configurations so far allow
    for j in order:
        lim = configs[j][0]
        below = lim[lim < chosen[j]]
        lowest = float(below.max()) if below.size else -np.inf  # the threshold must lie above it
        floor = max(floor, lowest)
        if not floor < chosen[j]:
            return False
    return True


def best_setting(rows: list[tuple]) -> dict | None:
    feasible = [row for row in rows if row[-2] <= BAR_VIOLATIONS]
    if not feasible:
        return None
    *setting, vio, regret = min(feasible, key=lambda row: row[-1])
    return {"setting": [round(float(s), 3) for s in setting], "violation_rate": vio, "regret_mean": regret}


def noise_floor(trace: TraceSet, r: float) -> tuple[int, int]:
    hit = total = 0
    for lim, t, _, t0, p0 in _configs(trace):
        slack = (lim >= 1.5 * p0) & (lim < lim.max())
        if slack.any():
            total += 1
            hit += bool((t0 / t[slack] < r - 1e-12).any())
    return hit, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="folder with summary_power_<gpu>.csv")
    args = ap.parse_args()
    traces = read_traces(args.data)
    ks = np.arange(0.3, 2.0001, 0.02)
    cs = np.arange(-0.3, 0.5001, 0.025)
    result: dict = {}
    lines = ["| GPU | r | best `k` rule (k: violations / regret) | best `affine` rule (k, c: violations / regret) "
             "| best rule increasing in the draw (violations / regret) "
             "| the held-out model's first choices are such a rule "
             "| configs with a non-binding limit measured below r |", "| --- | ---: | --- | --- | --- | --- | ---: |"]
    for name, trace in traces.items():
        idle, top = trace.gpu.idle_w, trace.full_limit
        # the model `gogh power evaluate --test-gpu name` fits (on the other GPUs) and its first choices
        model = fit_power_limit_model([traces[g] for g in sorted(traces) if g != name])
        for r in REQUIREMENTS:
            first = [choose_limit(model, LimitMeasurement(t0, p0, trace.full_limit), trace.gpu, r, lim)
                     for lim, _, _, t0, p0 in _configs(trace)]
            in_class = chosen_by_increasing_threshold(trace, first)
            k_rows = [(k, *score_threshold(trace, lambda p0, k=k: k * p0, r)) for k in ks]
            a_rows = [(k, c, *score_threshold(trace, lambda p0, k=k, c=c: idle + k * (p0 - idle) + c * (top - idle), r))
                      for k, c in itertools.product(ks[::2], cs)]
            k_best, a_best, m_best = best_setting(k_rows), best_setting(a_rows), best_increasing(trace, r)
            hit, total = noise_floor(trace, r)
            result.setdefault(name, {})[f"{r:g}"] = {"k": k_best, "affine": a_best, "increasing": m_best,
                                                     "model_in_class": in_class, "noise": [hit, total]}

            def cell(b: dict | None) -> str:
                if b is None:
                    return "none reaches <= 2% violations"
                head = f"{', '.join(f'{s:g}' for s in b['setting'])}: " if b["setting"] else ""
                return f"{head}{100 * b['violation_rate']:.1f}% / {100 * b['regret_mean']:.1f}%"

            lines.append(f"| {name} | {r:g} | {cell(k_best)} | {cell(a_best)} | {cell(m_best)} | {'yes' if in_class else 'no'} | {hit} of {total} |")
    table = "\n".join(lines)
    print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / "power_limit_bound.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "power_limit_bound.md").write_text(
        "# Best simple limit rules, tuned in-sample on each GPU (benchmarks/power_limit_bound.py)\n\n"
        "Least mean energy regret at <= 2% violations, the rule tuned on the GPU it is scored on.\n\n"
        + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

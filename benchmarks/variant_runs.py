"""Two variants of the same policies on the same jobs, over one common window: the runs and the table.

What ``hold_reach.py`` and ``always_on_objective.py`` share: each runs a set of policies once per
variant (a patience, an energy model) beside greedy-fastest, on the selection seeds, and adopts
the variant by a rule fixed before the run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig
from gogh_flows.sim.run import parse_cluster, run_policies

#: the policies a rule is read on
RULED = ("oracle+limits+fleet+wait", "gogh+limits+fleet+wait")


def side_by_side(jobs, cluster: str, truth, policies: Sequence[str], seed: int, noise: float,
                 variants: Mapping[str, Mapping], predictors=None) -> dict:
    """Each policy once per variant (``run_policies`` keyword arguments), named ``"<policy> [<variant>]"``,
    and greedy-fastest, over one common window, GPUs always on."""
    gpus = parse_cluster(cluster)
    config = SimConfig(seed=seed, noise=noise)
    results = dict(run_policies(jobs, gpus, truth, ("greedy-fastest",), config=config))
    for label, kwargs in variants.items():
        runs = run_policies(jobs, gpus, truth, policies, config=config, predictors=predictors, **kwargs)
        results |= {f"{name} [{label}]": r for name, r in runs.items()}
    acc = energy_accounts(results, references=("greedy-fastest",))
    return {name: {"on": acc[name].always_on_vs["greedy-fastest"], "sla": r.summary()["sla_attainment"],
                   "makespan_h": r.summary()["makespan_s"] / 3600, "jct_h": r.summary()["avg_jct_s"] / 3600}
            for name, r in results.items()}


def heading(script: str, d: dict, what: str) -> str:
    """The table's first line: the seeds, the script and its time, what the figures are, then ``what``."""
    return (f"Seeds {', '.join(map(str, d['seeds']))} (`benchmarks/{script}`, {d['wall_s'] / 60:.0f} min): always on "
            "against greedy-fastest over each run's common window, mean [min, max] over the seeds; SLA attainment, "
            f"the lowest seed; makespan and average JCT, the mean. {what}")


def report(runs: dict, labels: Sequence[str], head: str, adopted: str) -> list[str]:
    """The table of every run and policy (mean [min, max] over the seeds), then the rule: the second
    variant is adopted (``adopted``, said of it) if it lowers the mean always-on ratio of every
    policy of :data:`RULED` that ran, with no run's attainment newly under 0.98."""
    old_label, new_label = labels
    lines = [head, "", f"| run | policy | {old_label} | {new_label} | SLA {old_label} / {new_label} | makespan h | "
             "avg JCT h |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    means: dict[str, dict[str, list[float]]] = {}
    worse_sla = []
    for key, seeds in runs.items():
        names = sorted({n.rsplit(" [", 1)[0] for n in next(iter(seeds.values())) if " [" in n})
        for name in names:
            col = {lab: [seeds[s][f"{name} [{lab}]"] for s in seeds] for lab in labels}

            def spread(lab: str) -> str:
                v = [x["on"] for x in col[lab]]
                return f"{statistics.fmean(v):.3f} [{min(v):.3f}, {max(v):.3f}]"

            def mean(field: str) -> str:
                return " / ".join(f"{statistics.fmean(x[field] for x in col[lab]):.1f}" for lab in labels)

            sla = " / ".join(f"{min(x['sla'] for x in col[lab]):.4f}" for lab in labels)
            lines.append(f"| {key} | {name} | {spread(old_label)} | {spread(new_label)} | {sla} | "
                         f"{mean('makespan_h')} | {mean('jct_h')} |")
            for lab in labels:
                means.setdefault(name, {}).setdefault(lab, []).extend(x["on"] for x in col[lab])
            worse_sla += [f"{key} {name} seed {s}" for s in seeds
                          if seeds[s][f"{name} [{new_label}]"]["sla"] < 0.98 <= seeds[s][f"{name} [{old_label}]"]["sla"]]
    lines.append("")
    verdict = []
    for name in (*RULED, *(n for n in means if n not in RULED)):
        if name not in means:
            continue
        old, new = (statistics.fmean(means[name][lab]) for lab in labels)
        if name in RULED:
            verdict.append(new < old)
        lines.append(f"- {name}{'' if name in RULED else ' (not part of the rule)'}: mean always-on ratio "
                     f"{old:.4f} '{old_label}', {new:.4f} '{new_label}', over {len(means[name][old_label])} runs.")
    lines.append(f"- Runs whose SLA attainment fell under 0.98 only with '{new_label}': {', '.join(worse_sla) or 'none'}.")
    keep = all(verdict) and not worse_sla
    lines.append(f"- By the rule fixed before the run, {adopted} {'is' if keep else 'is not'} adopted.")
    return lines


def run_or_report(results: Path, stem: str, again: bool, run: Callable[[], dict],
                  table: Callable[[dict], list[str]]) -> None:
    """``run()`` and save ``<stem>.json`` under ``results`` (or, with ``again``, read the saved one),
    then write and print the table of it as ``<stem>.md``."""
    results.mkdir(exist_ok=True)
    path = results / f"{stem}.json"
    saved = json.loads(path.read_text()) if again else run()
    if not again:
        path.write_text(json.dumps(saved, indent=1) + "\n")
    text = "\n".join(table(saved))
    (results / f"{stem}.md").write_text(text + "\n")
    print(text)


def unseen_predictors(by_seed: Mapping[int, Mapping], p1_epochs: int, p2_epochs: int, seed: int):
    """Predictors for scenario (b) with every family unseen: one training per family of the seeds'
    jobs, on the first seed's truth (as ``energy_seeds.py unseen`` trains them)."""
    from gogh_flows.predict.data import MeasuredSet
    from gogh_flows.sim.holdout import train_each_unseen

    runs = [scs["gavel-physical"] for scs in by_seed.values()]
    family_of = MeasuredSet.from_table(runs[0].truth).family
    families = sorted({family_of[j.job_type] for sc in runs for j in sc.jobs})
    return train_each_unseen(runs[0].truth, families, p1_epochs=p1_epochs, p2_epochs=p2_epochs, seed=seed,
                             intervals=True)

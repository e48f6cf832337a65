"""Which no-observation prior, chosen on an inner split, is never worse than the per-type mean?

Issue 13 asks for P1's no-observation prediction to be no worse than each GPU type's
geometric mean on any held-out family, with the choice made on an inner split of the
training families. For each held-out family of Gavel's data this script

1. trains P1 on the other six families and predicts the held-out jobs (the outer test);
2. builds the candidates: P1, the per-type mean, the roofline prior (one efficiency
   fitted on the training jobs), log-space blends of P1 with either, the entry-wise median
   of the three, and P1 clipped to within a factor e^c of the per-type mean;
3. scores every candidate on the *inner* split: the out-of-family P1 of each training
   family (a P1 trained without it, as P2's inputs are made) and the baselines fitted
   without it, so the choice never sees the held-out family;
4. reports the inner choice's error on the held-out family beside every candidate's.

Metric: mean absolute log error of the isolated entries (a missing prediction counts 10x,
as in `gogh predictors evaluate`). Writes benchmarks/results/predictor_priors.{json,md}.

    .venv/bin/python benchmarks/predictor_priors.py [--truth PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from gogh_flows.predict import evaluate as ev
from gogh_flows.predict.baselines import PriorRow
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, train_p1
from gogh_flows.truth.gavel import read_gavel_json

OUT = Path(__file__).resolve().parent / "results"
BLENDS = (0.25, 0.5, 0.75)
CLIPS = (0.25, 0.5, 0.75, 1.0, 1.5)


def iso_male(pred: np.ndarray, truth: np.ndarray, g: int) -> float:
    ale, _, _ = ev._entry_errors(pred[:, :g].ravel(), truth[:, :g].ravel(), np.ones(truth[:, :g].size, dtype=bool))
    return float(np.mean(ale))


def baselines(full: MeasuredSet, layout: Layout, train: MeasuredSet, names, p1_rows: np.ndarray) -> dict:
    g = len(full.gpus)
    known = layout.truth(train, train.names)
    return {"p1": p1_rows,
            "type_mean": PriorRow.type_mean(known, len(names), g).rows,
            "roofline": PriorRow.roofline(known, ev.roofline_log(full, train.names), ev.roofline_log(full, names),
                                          g).rows}


def candidates(base: dict) -> dict[str, np.ndarray]:
    out = dict(base)
    for other in ("type_mean", "roofline"):
        p1 = np.where(np.isfinite(base["p1"]), base["p1"], base[other])  # "does not fit": the baseline's
        for w in BLENDS:
            out[f"{w:g} p1 + {1 - w:g} {other}"] = w * p1 + (1 - w) * base[other]
    out["median(p1, type_mean, roofline)"] = np.nanmedian(np.stack([base[k] for k in ("p1", "type_mean",
                                                                                    "roofline")]), axis=0)
    tm = base["type_mean"]
    p1 = np.where(np.isfinite(base["p1"]), base["p1"], tm)
    for c in CLIPS:
        out[f"p1 within x{np.exp(c):.2f} of type_mean"] = tm + np.clip(p1 - tm, -c, c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "gavel"
                                           / "simulation_throughputs.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    full = MeasuredSet.from_table(read_gavel_json(args.truth))
    layout = Layout(full.gpus, full.names)
    g, feats, cfg = len(full.gpus), dict(full.jobs), P1Config()
    report: dict = {"truth": args.truth, "families": {}}
    start = time.perf_counter()
    for fam in full.families:
        train, test = full.without([fam]), full.of_family(fam)
        p1 = train_p1(train, cfg)
        outer_truth = layout.truth(full, test)
        outer = {k: iso_male(v, outer_truth, g) for k, v in
                 candidates(baselines(full, layout, train, test, ev.p1_vectors(p1, layout, test, feats))).items()}
        oof = ev.out_of_family_p1(train, layout, feats, cfg)
        inner: dict[str, list[float]] = {}
        for f2 in train.families:
            names = train.of_family(f2)
            rows = oof[[train.names.index(n) for n in names]]
            for k, v in candidates(baselines(full, layout, train.without([f2]), names, rows)).items():
                inner.setdefault(k, []).append(iso_male(v, layout.truth(train, names), g))
        inner_mean = {k: float(np.mean(v)) for k, v in inner.items()}
        chosen = min(inner_mean, key=inner_mean.get)
        report["families"][fam] = {"outer": outer, "inner": inner_mean, "chosen": chosen}
        print(f"{fam}: inner choice {chosen!r} -> {outer[chosen]:.3f} (type_mean {outer['type_mean']:.3f}, "
              f"p1 {outer['p1']:.3f})", flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    fams = report["families"]
    keys = list(next(iter(fams.values()))["outer"])
    lines = ["Isolated entries, nothing observed; mean absolute log error on the held-out family. "
             "'inner choice' = the candidate with the lowest error on the inner split of the other six.", "",
             "| family | inner choice | its error | type_mean | p1 | never worse than type_mean? |",
             "|---|---|---:|---:|---:|---|"]
    for fam, r in fams.items():
        o = r["outer"]
        lines.append(f"| {fam} | {r['chosen']} | {o[r['chosen']]:.3f} | {o['type_mean']:.3f} | {o['p1']:.3f} | "
                     f"{'yes' if o[r['chosen']] <= o['type_mean'] else 'no'} |")
    mean_chosen = np.mean([r["outer"][r["chosen"]] for r in fams.values()])
    lines += ["", f"Mean over families: inner choice {mean_chosen:.3f}, type_mean "
              f"{np.mean([r['outer']['type_mean'] for r in fams.values()]):.3f}, p1 "
              f"{np.mean([r['outer']['p1'] for r in fams.values()]):.3f}.", "",
              "Every candidate on every held-out family (for reading, not for choosing):", "",
              "| candidate | " + " | ".join(fams) + " | mean |", "|---|" + "---:|" * (len(fams) + 1)]
    for k in keys:
        vals = [fams[f]["outer"][k] for f in fams]
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {np.mean(vals):.3f} |")
    OUT.mkdir(exist_ok=True)
    (OUT / "predictor_priors.json").write_text(json.dumps(report, indent=1) + "\n")
    (OUT / "predictor_priors.md").write_text("\n".join(lines) + f"\n\n{report['seconds']} s\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

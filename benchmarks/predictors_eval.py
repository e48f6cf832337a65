"""Figures behind docs/predictors.md: encoder comparison and placement-time latency.

    .venv/bin/python benchmarks/predictors_eval.py [encoders|latency|all]

* ``encoders``: P1 alone, leave-one-family-out on Gavel's measured data, once per job
  encoder (gru, ff, transformer). The encoder with the lowest mean isolated MAPE over the
  held-out families is the default (model selection by cross-validation over families).
  -> benchmarks/results/predictors_encoders.{json,md}
* ``tables [REPORT]``: markdown tables of a CLI report (default benchmarks/results/predictors_gavel.json).
* ``docs [REPORT]``: the same tables written into docs/predictors.md, between its markers.
* ``latency``: ``ThroughputPredictor.predict_table`` for 10 jobs x 8 GPU types with the
  shipped synthetic prior (models/synthetic), warm, with one observation per job.
  -> benchmarks/results/predictors_latency.json

The full leave-one-family-out report is the CLI's:

    gogh predictors evaluate --truth ../shared/data/gavel/simulation_throughputs.json \\
        --holdout-family all --seed 0 --json benchmarks/results/predictors_gavel.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.evaluate import p1_vectors, score
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import ENCODERS, P1Config, train_p1
from gogh_flows.truth.gavel import gavel_dir, read_gavel_json

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def encoders(seed: int = 0) -> dict:
    full = MeasuredSet.from_table(read_gavel_json(gavel_dir() / "simulation_throughputs.json"))
    layout = Layout(full.gpus, full.names)
    out: dict = {"families": {}, "mean": {}, "seconds": {}}
    for enc in ENCODERS:
        start = time.perf_counter()
        for fam in full.families:
            train = full.without([fam])
            test = full.of_family(fam)
            model = train_p1(train, P1Config(encoder=enc, seed=seed))
            vec = p1_vectors(model, layout, test, dict(full.jobs))
            truth = layout.truth(full, test)
            s = score(lambda i, obs: vec[i], truth, layout)
            out["families"].setdefault(fam, {})[enc] = {k: s[k] for k in ("isolated_mape", "colocated_mape")}
            print(f"{enc} {fam}: iso {s['isolated_mape']:.3f} co {s['colocated_mape']:.3f}", flush=True)
        out["seconds"][enc] = round(time.perf_counter() - start, 1)
        out["mean"][enc] = {
            k: float(np.mean([out["families"][f][enc][k] for f in full.families]))
            for k in ("isolated_mape", "colocated_mape")
        }
    out["chosen"] = min(ENCODERS, key=lambda e: out["mean"][e]["isolated_mape"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "predictors_encoders.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["| family | " + " | ".join(f"{e} iso / co" for e in ENCODERS) + " |",
             "|---|" + "---|" * len(ENCODERS)]
    for fam in [*full.families, "mean"]:
        row = out["mean"] if fam == "mean" else out["families"][fam]
        lines.append(f"| {fam} | " + " | ".join(
            f"{100 * row[e]['isolated_mape']:.1f}% / {100 * row[e]['colocated_mape']:.1f}%" for e in ENCODERS) + " |")
    lines.append(f"\nChosen by mean held-out isolated MAPE: **{out['chosen']}**; "
                 f"seconds per encoder (7 trainings): {out['seconds']}")
    (RESULTS / "predictors_encoders.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


def latency(repeat: int = 50) -> dict:
    from gogh_flows.catalog import gpu_types
    from gogh_flows.predict.io import load_p1, load_p2
    from gogh_flows.predict.service import ThroughputPredictor, observations_frame
    from gogh_flows.truth.synthetic import default_jobs

    p1, p2 = load_p1(REPO / "models/synthetic/p1"), load_p2(REPO / "models/synthetic/p2")
    jobs = dict(list(default_jobs().items())[::2][:10])
    gpus = [g.name for g in gpu_types()][:8]
    obs = observations_frame([{"job_type": n, "gpu_type": gpus[i % len(gpus)], "throughput": 1.0 + i}
                              for i, n in enumerate(jobs)])
    pred = ThroughputPredictor(p1, p2)
    pred.predict_table(jobs, gpus, obs)  # warm: features and embeddings cached
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        pred.predict_table(jobs, gpus, obs)
        times.append(1000 * (time.perf_counter() - t))
    out = {"jobs": len(jobs), "gpu_types": len(gpus), "repeat": repeat, "torch_threads": torch.get_num_threads(),
           "p50_ms": round(statistics.median(times), 2), "p90_ms": round(float(np.percentile(times, 90)), 2),
           "max_ms": round(max(times), 2)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "predictors_latency.json").write_text(json.dumps(out, indent=2) + "\n")
    print(out)
    return out


def tables(path: Path = RESULTS / "predictors_gavel.json", echo: bool = True) -> str:
    """:func:`render` of the report at ``path``, written beside it (``.md``)."""
    text = render(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(text)
    if echo:
        print(text)
    return text


def render(report: dict) -> str:
    """Markdown tables of a ``gogh predictors evaluate`` report: per family and method, the means
    over families and over job types, P2 against the baselines, by revealed GPU type, the
    intervals' coverage, the choices made on the inner split and the data check's findings."""
    from gogh_flows.predict.cli import percent
    from gogh_flows.predict.evaluate import METHODS

    cols = [("isolated_male", "iso"), ("isolated_male_1obs", "iso 1obs"), ("isolated_male_2obs", "iso 2obs"),
            ("colocated_male", "co"), ("colocated_male_1obs", "co 1obs"), ("isolated_ratio_1obs", "iso 1obs ratio"),
            ("isolated_mape", "iso MAPE"), ("isolated_mape_1obs", "iso 1obs MAPE"),
            ("colocated_mape_1obs", "co 1obs MAPE"), ("isolated_mape_1obs_siblings", "siblings MAPE")]

    def cell(key: str, value) -> str:
        if "mape" in key:
            return percent(value)
        return "n/a" if value is None else f"{value:.3f}" if "male" in key else f"{value:.2f}x"

    def block(rows: list[tuple[str, dict]]) -> list[str]:
        out = ["| family | method | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---:|" * len(cols)]
        for fam, by in rows:
            for m in METHODS:
                out.append(f"| {fam} | {m} | " + " | ".join(cell(k, by[m].get(k)) for k, _ in cols) + " |")
        return out

    lines = ["male: mean absolute log error (0.693 = a factor 2 on average); iso 1obs ratio: median of "
             "max(pred/true, true/pred); MAPE in %.", ""]
    lines += block(list(report["families"].items()))
    lines += ["", f"Means (over the {len(report['families'])} families; over the {len(report.get('jobs', {}))} job types, each equal):", ""]
    lines += block([("**mean, families**", report["mean"]), ("**mean, job types**", report["mean_over_jobs"])])
    fams = report["families"]
    duels = [("isolated_male_1obs", "type_mean", "ratio (observation x training mean ratio)"),
             ("colocated_male_1obs", "partner_mean", "partner-mean slowdown"),
             ("isolated_male_1obs", "roofline", "roofline ratio"),
             ("colocated_male_1obs", "roofline", "roofline ratio, co-located"),
             ("isolated_male_1obs", "p1_shifted", "P1 shifted to the observation")]
    lines += ["", "P2 against each baseline, 1 observation, by the log metric (families where P2's error is lower):", "",
              "| metric | baseline | P2 ahead on | families where it is not |", "|---|---|---:|---|"]
    for key, base, words in duels:
        behind = [f for f in fams if not fams[f]["p2"][key] < fams[f][base][key]]
        lines.append(f"| {key} | {words} | {len(fams) - len(behind)} of {len(fams)} | {', '.join(behind) or '-'} |")
    rev = report.get("isolated_male_1obs_by_revealed_type", {})
    if rev:
        gpus = list(next(iter(rev.values())))
        lines += ["", "Isolated, 1 observation, by the GPU type observed (mean absolute log error, mean over families):",
                  "", "| method | " + " | ".join(gpus) + " |", "|---|" + "---:|" * len(gpus)]
        lines += [f"| {m} | " + " | ".join(cell("male", rev[m][g]) for g in gpus) + " |" for m in METHODS]
    pooled = report.get("coverage_pooled", {})
    if pooled and any(pooled.values()):
        from gogh_flows.predict.evaluate import INTERVAL_PROTOCOLS, LEVELS, interval_name

        heads = [(p, lv) for p in INTERVAL_PROTOCOLS for lv in LEVELS]
        how = ("split conformal, calibrated on the inner split, each level's quantile raised there until the "
               "inner families left out in turn are covered as promised" if report.get("interval_quantile")
               else "split conformal, calibrated on the inner split")
        lines += ["", f"Intervals ({how}): share of every held-out entry "
                  f"inside the interval, pooled over the {len(fams)} families, and the interval's mean half-width as a "
                  "factor (x/÷):", "",
                  "| method | " + " | ".join(f"{p} {round(100 * lv)}%" for p, lv in heads) + " |",
                  "|---|" + "---:|" * len(heads)]
        for m in METHODS:
            cells = []
            for p, lv in heads:
                cov = pooled[m].get(interval_name(p, "cover", lv))
                widths = [report["families"][f][m].get(interval_name(p, "halfwidth", lv)) for f in fams]
                widths = [w for w in widths if w is not None and np.isfinite(w)]
                factor = f"x{np.exp(np.mean(widths)):.1f}" if widths else "n/a"
                cells.append("n/a" if cov is None else f"{100 * cov:.0f}% ({factor})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += level_tables(report)
    choices = choice_table(report)
    if choices:
        lines += ["", "Choices made on the inner split (the training families only; never the held-out one):", "",
                  *choices]
    anomalies = report.get("anomalies", {})
    entries = anomalies.get("entries", [])
    lines += ["", f"Data check: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} flagged, "
              + ("left out of this run." if anomalies.get("excluded") else "kept in this run (--exclude-anomalies "
                                                                             "leaves them out).")]
    lines += [f"- {e['detail']}" for e in entries[:12]]
    if len(entries) > 12:
        lines.append(f"- ... and {len(entries) - 12} more of the same kinds")
    return "\n".join(lines) + f"\n\nwall time of the evaluation: {report['seconds']} s\n"


DOCS = Path(__file__).resolve().parent.parent / "docs" / "predictors.md"
BEGIN = "<!-- generated by `benchmarks/predictors_eval.py docs` from benchmarks/results/predictors_gavel.json: begin -->"
END = "<!-- generated: end -->"


def docs(path: Path = RESULTS / "predictors_gavel.json", target: Path = DOCS) -> None:
    """Put the tables of ``path`` between the markers of docs/predictors.md, so the figures
    there are the report's own (tests/test_docs.py checks they still are)."""
    text = target.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{target} has no generated section; put the lines {BEGIN!r} and {END!r} where the "
                         "tables go")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    target.write_text(head + BEGIN + "\n\n" + tables(path, echo=False).rstrip("\n") + "\n\n" + END + tail)
    print(f"wrote the tables of {path} into {target}")


def level_tables(report: dict, methods: tuple[str, ...] = ("ensemble", "p2")) -> list[str]:
    """The intervals' quantile levels: the pooled held-out coverage of the intervals as reported
    (each level's quantile raised on the inner split until its nested coverage reaches the level)
    beside the intervals at the level itself (which no choice saw), and the ensemble's quantiles
    per held-out family with the nested coverage they were chosen by; empty for reports from
    before the levels were adjusted."""
    from gogh_flows.predict.evaluate import INTERVAL_PROTOCOLS, LEVELS, interval_name

    quantiles, plain = report.get("interval_quantile"), report.get("coverage_pooled_unadjusted")
    if not quantiles or not plain:
        return []
    heads = [(p, lv) for p in INTERVAL_PROTOCOLS for lv in LEVELS]
    pct = lambda v: "n/a" if v is None or not np.isfinite(v) else f"{100 * v:.1f}%"  # noqa: E731
    out = ["", "The same coverage with each level's quantile raised on the inner split (as above) and at the level "
           "itself (the split-conformal quantile; reported, not chosen on), pooled over the held-out entries:", "",
           "| method | quantile | " + " | ".join(f"{p} {round(100 * lv)}%" for p, lv in heads) + " |",
           "|---|---|" + "---:|" * len(heads)]
    for m in methods:
        for label, cov in (("raised", report["coverage_pooled"].get(m, {})), ("the level", plain.get(m, {}))):
            out.append(f"| {m} | {label} | " + " | ".join(pct(cov.get(interval_name(p, "cover", lv)))
                                                         for p, lv in heads) + " |")
    out += ["", "The ensemble's quantile per held-out family (80% / 90% interval), with the nested coverage of the "
            "inner families it was chosen by:", "",
            "| held-out family | " + " | ".join(INTERVAL_PROTOCOLS) + " |", "|---|" + "---|" * len(INTERVAL_PROTOCOLS)]
    for fam, by in quantiles.items():
        cells = []
        for p in INTERVAL_PROTOCOLS:
            c = by.get("ensemble", {}).get(p)
            cells.append("n/a" if not c else " / ".join(
                f"{c[k]['quantile']:.2f} ({pct(c[k]['nested_cover'])})" for k in ("80", "90") if k in c))
        out.append(f"| {fam} | " + " | ".join(cells) + " |")
    return out


def choice_table(report: dict) -> list[str]:
    """Per held-out family: P1's encoder and P2's epochs (each candidate's inner error), the
    ensemble's P2 weights per case, the siblings decay (each candidate's inner siblings MAPE); empty for
    reports written before these were chosen there."""
    enc = report.get("p1_encoder", {})
    if not enc:
        return []
    decays = report.get("siblings_decay", {})
    # ensemble_weights: the three-row trial of 2026-11-26 (predictors_gavel_ensemble3.json), each
    # case's weights of P2, the roofline row and the per-type mean row
    weights = report.get("ensemble_p2_weight") or report.get("ensemble_weights", {})
    reaches = report.get("ensemble_p2_reach", {})  # reports before 2026-11-26 (late): every job within reach
    baselines = report.get("ensemble_baseline", {})  # reports before 2026-11-28: the roofline with an observation
    epochs = report.get("p2_epochs", {})
    names = list(next(iter(enc.values()))["inner_male"])
    out = ["| held-out family | P1 encoder | " + " | ".join(f"{n} (inner male)" for n in names)
           + " | P2 epochs (inner male by epochs) | ensemble P2 weight, nothing observed (iso / co) "
           "| ensemble P2 weight, 1 observation (iso / co; with the roofline ratio unless named) | siblings decay (inner MAPE by decay) |",
           "|---|---|" + "---:|" * len(names) + "---|---|---|---|"]
    for fam, e in enc.items():
        errs = " | ".join("n/a" if e["inner_male"].get(n) is None else f"{e['inner_male'][n]:.3f}" for n in names)
        w = weights.get(fam, {})
        d = decays.get(fam)
        dec = "n/a (one job type)" if d is None else f"{d['chosen']:g} (" + ", ".join(
            f"{k}: {'n/a' if v is None else f'{100 * v:.1f}%'}" for k, v in d["inner_mape"].items()) + ")"
        ep = epochs.get(fam, {})
        ep_cell = "n/a" if not ep else f"{ep['chosen']}" + (" (" + ", ".join(
            f"{k}: {v:.3f}" for k, v in ep["inner_male"].items()) + ")" if ep.get("inner_male") else " (fixed)")
        def cell(case: str) -> str:
            v = w[case]
            if isinstance(v, dict):
                return "{p2:g}/{roofline:g}/{type_mean:g}".format(**v)
            r = reaches.get(fam, {}).get(case)
            b = baselines.get(fam, {}).get(case)
            with_base = f" with the {b.replace('_', '-')} row" if b == "partner_mean" and case.endswith("_1obs") else ""
            return (f"{v:g}" if r is None else f"{v:g} within {r:g}") + with_base

        if "isolated_1obs" in w:
            nothing = f"{cell('isolated')} / {cell('colocated')}"
            one = f"{cell('isolated_1obs')} / {cell('colocated_1obs')}"
        else:  # reports before 2026-11-26: one pair of weights against the roofline row, whatever was observed
            one = f"{w.get('isolated', 'n/a')} / {w.get('colocated', 'n/a')}"
            nothing = f"{one} (with the roofline)"
        out.append(f"| {fam} | {e['chosen']} | {errs} | {ep_cell} | {nothing} | {one} | {dec} |")
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("encoders", "all"):
        encoders()
    if what in ("latency", "all"):
        latency()
    if what == "tables":  # tables [REPORT.json]: the Gavel report by default
        tables(Path(sys.argv[2])) if len(sys.argv) > 2 else tables()
    if what == "docs":  # docs [REPORT.json]: its tables into docs/predictors.md
        docs(Path(sys.argv[2])) if len(sys.argv) > 2 else docs()

"""Does the retrained refiner help on a demo's own measurements, and does its trust scale?

Reads the measurements of one or more ``gogh demo`` runs (the state folders the summaries
name, ``$GOGH_HOME/demo-runs/seed*/gogh``) and replays each retraining of the demo offline:
after wave k, a challenger is fitted on waves 1..k as the ``refine_predictors`` flow fits it
(the shipped prior's data as base, the same epochs), and every measurement of wave k+1 is
predicted from waves 1..k without earlier measurements of its own entry. Beside it: P1 alone
(no refiner), the shipped refiner, the challenger with its corrections in full and at each
trust scale, and at the scale the flow's own procedure chooses (a trial refiner on the older
three quarters of waves 1..k, scored on the newest quarter; wave k+1 never takes part).
Three training seeds per point; MAPE over the seeds and points. Writes
``benchmarks/results/refiner_trust.{json,md}``.

    .venv/bin/python benchmarks/refiner_trust.py .gogh/demo-runs/seed0-*/gogh ...
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gogh_flows.demo import DEMO_FLEET, _measurements
from gogh_flows.flows.observations import observations_from_measurements
from gogh_flows.flows.retrain import base_measurements, fit_challenger
from gogh_flows.predict.data import zoo_jobs
from gogh_flows.predict.io import load_p1, load_p2, models_dir
from gogh_flows.predict.p2 import TRUST_SCALES, P2Config
from gogh_flows.predict.service import ThroughputPredictor

OUT = Path(__file__).resolve().parent / "results"
WAVE = 8  # runs per wave in `gogh demo` (its default --wave-size)
EPOCHS = 150  # as the demo's retraining
SEEDS = (0, 1, 2)


def scale_name(scale: float | None) -> str:
    return "in full" if scale is None else f"scale {scale:g}"


def replay(state: Path, prior: str = "synthetic") -> list[dict]:
    """One row per (retraining point, seed): every method's MAPE on the next wave."""
    rows = _measurements(state, f"sqlite:///{state / 'mlflow.db'}").sort("started_at")
    models = models_dir() / prior
    p1, shipped = load_p1(models / "p1"), load_p2(models / "p2")
    gpus = sorted(DEMO_FLEET)
    base = base_measurements("prior", prior, gpus)
    every = observations_from_measurements(rows)
    features = zoo_jobs(set(every["job_type"]) | set(every["partner"].drop_nulls()))
    out = []
    for k in range(1, rows.height // WAVE):
        train = observations_from_measurements(rows.head(WAVE * k))
        test = observations_from_measurements(rows.slice(WAVE * k, WAVE))

        def err(p2, seen=train, scored=test) -> float:
            return ThroughputPredictor(p1, p2).refine_error(features, seen, scored)["mape"]

        for seed in SEEDS:
            p2, _ = fit_challenger(p1, features, train, base=base, config=P2Config(epochs=EPOCHS, seed=seed),
                                   gpu_types=gpus, validation_fraction=0.25)  # as the demo's flow
            chosen = p2.trust_scale
            row = {"state": str(state), "after_wave": k, "seed": seed, "measurements": test.height,
                   "P1 alone": err(None), "shipped refiner": err(shipped),
                   "chosen scale": chosen, "challenger, chosen scale": err(replace(p2, trust_scale=chosen))}
            row.update({f"challenger, {scale_name(s)}": err(replace(p2, trust_scale=s)) for s in TRUST_SCALES})
            out.append(row)
            print(f"{state.parent.name} after wave {k} seed {seed}: P1 {row['P1 alone']:.3f}  challenger in "
                  f"full {row['challenger, in full']:.3f}  at chosen {scale_name(chosen)} "
                  f"{row['challenger, chosen scale']:.3f}", flush=True)
    return out


def main(states: list[str]) -> None:
    if not states:
        raise SystemExit("name the state folders of demo runs: $GOGH_HOME/demo-runs/seed*/gogh "
                         "(each summary.json's 'state', plus /gogh)")
    t0 = time.perf_counter()
    rows = [r for s in states for r in replay(Path(s))]
    methods = ["P1 alone", "shipped refiner", *(f"challenger, {scale_name(s)}" for s in TRUST_SCALES),
               "challenger, chosen scale"]
    mean = {m: float(np.mean([r[m] for r in rows if math.isfinite(r[m])])) for m in methods}
    wins = {m: sum(r[m] < r["P1 alone"] for r in rows) for m in methods}
    chosen = [scale_name(r["chosen scale"]) for r in rows]
    lines = ["# The retrained refiner on the demo's own measurements", "",
             f"`.venv/bin/python benchmarks/refiner_trust.py {' '.join(states)}` "
             f"({len(rows)} retrainings: {len(states)} demo runs x waves x seeds {SEEDS}; "
             f"{time.perf_counter() - t0:.0f} s). MAPE of the next wave's measurements, each predicted from "
             "the earlier waves without earlier measurements of its own entry.", "",
             "| method | mean MAPE | retrainings better than P1 alone |", "| --- | ---: | ---: |"]
    lines += [f"| {m} | {mean[m]:.4f} | {wins[m]} of {len(rows)} |" for m in methods]
    lines += ["", "Scales chosen by the flow's procedure: "
              + ", ".join(f"{c} x{chosen.count(c)}" for c in sorted(set(chosen))) + "."]
    OUT.mkdir(exist_ok=True)
    (OUT / "refiner_trust.json").write_text(json.dumps({"rows": rows, "mean": mean}, indent=2) + "\n")
    (OUT / "refiner_trust.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])

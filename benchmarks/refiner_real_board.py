"""Can a retrained refiner learn a real board from the fleet's runs of *other* jobs?

The demo's fleet is the synthetic one the shipped prior was trained on, so a retrained refiner
has nothing to learn there (README, "make demo"). A real board is different: on the H100 of
``../shared/data/h100/alone.csv`` the measured rates are 0.31x to 1.89x the synthetic
fleet's, job by job. This script asks whether the product's retraining would close that gap for a job type the board has
not run yet, from the board's measurements of the others: leave one job type out of the 15
measured; the fleet has measured the other 14 on the H100 (their real rates) and on an A100
(the synthetic fleet's rates, the board the prior knows); the held-out job has run on the A100
only. Its H100 rate is then predicted by

* ``P1 alone`` and the shipped ``champion`` (P1 + P2 of ``models/synthetic``), with nothing of
  the job measured and with its A100 run;
* a ``challenger`` retrained as ``refine_predictors`` retrains (``fit_refiner`` on the
  synthetic fleet's table plus the 28 measurements, the champion's ensemble and intervals
  kept), with the job's A100 run;
* both again given all the fleet's runs, as a placement is (the other jobs' H100 runs move a
  job through its measured siblings);
* the baselines: the ``synthetic fleet``'s own figure, and the ``ratio`` of the fleet's runs
  (the job's A100 rate x the geometric mean over the other 14 of H100 / A100);
* the challenger with the per-type site offsets ``refine_predictors`` now fits
  (``gogh_flows/predict/site.py``, from the 28 runs), for a job with nothing of it measured
  (given the other jobs' runs only) beside the challenger without them, and anchored on the
  job's A100 run (given all the fleet's runs) beside the same without.

    .venv/bin/python benchmarks/refiner_real_board.py [--data ../shared/data] [--epochs 300]

About 7 minutes on 2 cores (15 refiners). Writes ``benchmarks/results/refiner_real_board.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import polars as pl

from gogh_flows.predict.data import MeasuredSet, zoo_jobs
from gogh_flows.predict.io import load_p1, load_p2, models_dir
from gogh_flows.predict.p2 import P2Config
from gogh_flows.predict.service import SITE_KEY, ThroughputPredictor, fit_refiner, fit_site_offsets, observations_frame
from gogh_flows.truth.synthetic import synthetic_table

OUT = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GPUS = ["k80", "v100", "t4", "a100", "h100"]
INHERITED = ("ensemble", "intervals")  # what refine_predictors' challenger keeps of the champion


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="folder holding h100/alone.csv")
    ap.add_argument("--epochs", type=int, default=300, help="the challenger's epochs (refine_predictors' default)")
    args = ap.parse_args()
    board = pl.read_csv(args.data / "h100" / "alone.csv")
    measured = dict(zip(board["job_type"], board["throughput_steps_per_s"]))
    jobs = list(measured)
    features = zoo_jobs(jobs)
    p1, p2 = load_p1(models_dir() / "synthetic" / "p1"), load_p2(models_dir() / "synthetic" / "p2")
    champion, p1_alone = ThroughputPredictor(p1, p2), ThroughputPredictor(p1, None)
    fleet = synthetic_table(GPUS)  # the prior's training truth: the A100 rates, and the base data
    base = MeasuredSet.from_table(fleet)

    def on_h100(model: ThroughputPredictor, job: str, obs: pl.DataFrame | None) -> float:
        return model.predict_table({job: features[job]}, GPUS, obs).isolated(job, "h100")

    def run(job: str, gpu: str, rate: float) -> dict:
        return {"job_type": job, "gpu_type": gpu, "partner": None, "throughput": rate}

    rows = []
    for job in jobs:
        others = [j for j in jobs if j != job]
        seen = observations_frame([run(j, "h100", measured[j]) for j in others]
                                  + [run(j, "a100", fleet.isolated(j, "a100")) for j in others])
        own = observations_frame([run(job, "a100", fleet.isolated(job, "a100"))])
        refiner = fit_refiner(p1, features, seen, base=base, config=P2Config(epochs=args.epochs, seed=0), gpu_types=GPUS)
        refiner.trained_on.update({k: v for k, v in p2.trained_on.items() if k in INHERITED})
        challenger = ThroughputPredictor(p1, refiner)
        site = fit_site_offsets(challenger, features, seen)
        with_site = {a: ThroughputPredictor(p1, replace(refiner, trained_on={
            **refiner.trained_on, SITE_KEY: replace(site, anchored=a).to_dict()})) for a in (False, True)}
        ratio = math.exp(sum(math.log(measured[j] / fleet.isolated(j, "a100")) for j in others) / len(others))
        row = {"job_type": job, "measured": measured[job],
               "synthetic fleet": fleet.isolated(job, "h100"),
               "ratio": fleet.isolated(job, "a100") * ratio,
               "P1 alone": on_h100(p1_alone, job, None),
               "champion, nothing measured": on_h100(champion, job, None),
               "champion, A100 run": on_h100(champion, job, own),
               "challenger, A100 run": on_h100(challenger, job, own),
               # what a placement passes: every logged run, the other jobs' H100 runs among them
               # (the siblings step moves a job by its measured siblings)
               "champion, all the fleet's runs": on_h100(champion, job, pl.concat([seen, own])),
               "challenger, all the fleet's runs": on_h100(challenger, job, pl.concat([seen, own])),
               # a job new to the fleet: the other jobs' runs, none of its own
               "challenger, the other jobs' runs only": on_h100(challenger, job, seen),
               "challenger + site offsets, the other jobs' runs only": on_h100(with_site[False], job, seen),
               "challenger + site offsets (anchored), all the fleet's runs": on_h100(
                   with_site[True], job, pl.concat([seen, own])),
               "site offset of the H100": math.expm1(site.unmeasured.get("h100", 0.0))}
        rows.append(row)
        print(f"{job}: measured {row['measured']:.1f}, " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if k not in ("job_type", "measured")), flush=True)
    frame = pl.DataFrame(rows)
    methods = [c for c in frame.columns if c not in ("job_type", "measured", "site offset of the H100")]
    summary = {}
    for m in methods:
        err = (frame[m] / frame["measured"]).log().abs()
        summary[m] = {"male": float(err.mean()), "median_ratio": math.exp(float(err.median())),
                      "worst_ratio": float(math.exp(err.max()))}
    lines = ["| method | mean absolute log error | median ratio error | worst ratio error |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {m} | {s['male']:.3f} | {s['median_ratio']:.2f}x | {s['worst_ratio']:.2f}x |" for m, s in summary.items()]
    offsets = frame["site offset of the H100"]
    lines += ["", f"The H100's site offset the challenger learned from the other 14 jobs: {offsets.mean():+.1%} on "
              f"average ({offsets.min():+.1%} to {offsets.max():+.1%} over the 15 leave-outs)."]
    table = "\n".join(lines)
    print(table)
    OUT.mkdir(exist_ok=True)
    summary["site offset of the H100"] = {"mean": float(offsets.mean()), "min": float(offsets.min()),
                                          "max": float(offsets.max())}
    (OUT / "refiner_real_board.json").write_text(json.dumps({"summary": summary, "jobs": rows}, indent=2) + "\n")
    (OUT / "refiner_real_board.md").write_text(
        "# A real H100 predicted from the fleet's runs of the other jobs (benchmarks/refiner_real_board.py)\n\n"
        "Leave one of the 15 measured job types out; its H100 rate predicted. Ratio error: max(pred/true, true/pred).\n\n"
        + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

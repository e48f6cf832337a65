"""Decorated flows trained for real on the local GPUs: measured against predicted.

Runs four cases on ``GpuCluster(mode="local-cuda")`` (one dask-cuda worker per board):

* ``alone``: ResNet-50 (batch size 64) reporting every step, alone on a board;
* ``pair``: ResNet-50 (batch size 64) and Transformer (batch size 32) started together on
  one board (capacity 2), both reporting every step;
* ``failing``: an LM (batch size 10) body that raises after some steps (its measurement
  must still be logged, marked failed, with the steps it did);
* ``silent``: a Recommendation (batch size 512) body that reports nothing (timed as its
  declared work over the whole run, ``window="whole_run"``).

For each run it prints the measured steady-state throughput, board power and energy per
step beside three predictions: the placement's (the predictors), the synthetic fleet's
throughput and the power model's board power (``gogh_flows.power_model`` via
``truth.synthetic.step_profile``), and for the pair whether the two shares add up to the
board's energy. Figures are saved to ``benchmarks/results/gpu_check-<gpu>.json``.

    python benchmarks/gpu_check.py [--seconds 12] [--out benchmarks/results]

Needs an NVIDIA GPU with its driver, ``nvidia-ml-py`` and ``dask-cuda``; it reads the
board's power limit and never changes it (nor clocks or MIG). Without a GPU it says so and
exits with status 2: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
# the first flow run starts Prefect's temporary server, which migrates a fresh database first:
# on a fresh machine that outlasted Prefect's default wait (2026-11-27, an H100 machine)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

CASES = {
    "alone": ("ResNet-50", 64),
    "pair-a": ("ResNet-50", 64),
    "pair-b": ("Transformer", 32),
    "failing": ("LM", 10),
    "silent": ("Recommendation", 512),
}


def _flows(seconds: float, emulated: bool):
    from gogh_flows import GpuCluster, gogh_placed
    from gogh_flows.runtime.training import train_zoo

    # --emulated checks the script's own path on a machine without a GPU (bodies train on the
    # CPU; the figures are then the emulator's and the CPU's, not a GPU's)
    cluster = GpuCluster(fleet={"h100": 1}, capacity=2) if emulated else GpuCluster(mode="local-cuda", capacity=2)
    made = {}
    for case, (family, bs) in CASES.items():
        silent, failing = case == "silent", case == "failing"

        @gogh_placed(model=family, batch_size=bs, min_throughput=0.5, work_steps=200 if silent else 10**7,
                     cluster=cluster, job_name=None)
        def body(family: str = family, bs: int = bs, silent: bool = silent, failing: bool = failing) -> int:
            if silent:  # does its declared work, reports none of it
                return train_zoo(family, bs, steps=200, report=False)
            steps = train_zoo(family, bs, seconds=seconds / 2 if failing else seconds)
            if failing:
                raise RuntimeError(f"gpu_check: the failing case fails on purpose after {steps} steps")
            return steps

        made[case] = body.with_options(name=f"gpu-check-{case}")
    return made


def _predicted(job_type: str, gpu_type: str) -> dict[str, float | None]:
    from gogh_flows.energy import EnergyModel
    from gogh_flows.power_model import zoo_profile

    prof = zoo_profile(job_type, gpu_type)[1]
    power = EnergyModel().power_alone(gpu_type, prof.activity)
    return {"synthetic_throughput": prof.throughput, "model_power_w": power,
            "model_energy_per_step_j": power / prof.throughput if prof.throughput > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="seconds of training per run after its first step")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--emulated", action="store_true",
                    help="no GPU: run the same flows on an emulated H100 to check this script (nothing is measured)")
    args = ap.parse_args(argv)
    boards: list = []
    try:
        if args.emulated:
            raise LookupError("emulated")
        from gogh_flows.runtime.nvml import NvmlUnavailable, discover

        boards = discover()
    except LookupError:
        print("gpu_check: --emulated: the figures below are the emulator's, not a GPU's", file=sys.stderr)
    except NvmlUnavailable as exc:
        print(f"gpu_check: no NVIDIA GPU can be read here ({exc}); nothing to measure (--emulated checks the "
              "script itself)", file=sys.stderr)
        return 2
    if not boards and not args.emulated:
        print("gpu_check: NVML lists no GPU (check CUDA_VISIBLE_DEVICES); nothing to measure", file=sys.stderr)
        return 2
    from gogh_flows.flows.session import open_sessions

    flows = _flows(args.seconds, args.emulated)
    results: dict[str, Any] = {}
    flows["alone"]()  # also starts the pool, the Prefect server and MLflow: the first run pays for them
    pair = [threading.Thread(target=flows[c]) for c in ("pair-a", "pair-b")]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    try:
        flows["failing"]()
    except Exception as exc:  # noqa: BLE001 - expected: the case fails on purpose
        results["failing_error"] = str(exc)
    flows["silent"]()
    (session,) = open_sessions().values()
    rows = session.measurements.read()
    out: list[dict[str, Any]] = []
    for r in rows.iter_rows(named=True):
        extra = json.loads(r["extra"] or "{}")
        steps_in_window = float(extra.get("window_steps") or 0) or None
        row = {
            "flow": r["flow_name"], "job_type": r["job_type"], "gpu_id": r["gpu_id"], "gpu_type": r["gpu_type"],
            "status": r["status"], "window": r["window"], "partners": r["partners"], "steps": r["steps"],
            "throughput": r["throughput"], "predicted_throughput": r["predicted_throughput"],
            "mean_power_w": r["mean_power_w"], "energy_j": r["energy_j"],
            "energy_per_step_j": r["energy_j"] / steps_in_window if r["energy_j"] and steps_in_window else None,
            "startup_s": r["startup_s"], "startup_energy_j": r["startup_energy_j"], "run_energy_j": r["run_energy_j"],
            "board_run_energy_j": float(extra["board_run_energy_j"]) if extra.get("board_run_energy_j") else None,
            "energy_split": extra.get("energy_split"), "power_limit_w": extra.get("power_limit_w"),
            **_predicted(r["job_type"], r["gpu_type"]),
        }
        out.append(row)
    pair_rows = [x for x in out if x["flow"] in ("gpu-check-pair-a", "gpu-check-pair-b")]
    if len(pair_rows) == 2 and all(x["run_energy_j"] for x in pair_rows):
        results["pair_shares_j"] = sum(x["run_energy_j"] for x in pair_rows)
        results["pair_boards_j"] = [x["board_run_energy_j"] for x in pair_rows]
    names = {b.name for b in boards}
    gpu = "-".join(sorted(r["gpu_type"] for r in out[:1])) or "gpu"
    results.update({"boards": sorted(names), "seconds": args.seconds, "runs": out,
                    "command": "python benchmarks/gpu_check.py " + " ".join(argv or sys.argv[1:])})
    print(f"\n{'flow':<20} {'status':<9} {'window':<9} {'steps/s':>8} {'pred.':>7} {'synth.':>7} {'W':>6} {'model W':>8} "
          f"{'J/step':>7} {'model':>7} {'startup s':>9}")
    for x in out:
        def f(v: Any, spec: str = ".3g") -> str:
            return "-" if v is None else format(v, spec)

        print(f"{x['flow']:<20} {x['status']:<9} {x['window'] or '-':<9} {f(x['throughput']):>8} {f(x['predicted_throughput']):>7} "
              f"{f(x['synthetic_throughput']):>7} {f(x['mean_power_w'], '.0f'):>6} {f(x['model_power_w'], '.0f'):>8} "
              f"{f(x['energy_per_step_j']):>7} {f(x['model_energy_per_step_j']):>7} {f(x['startup_s'], '.1f'):>9}")
    if "pair_shares_j" in results:
        print(f"\npair: shares add to {results['pair_shares_j']:.0f} J; boards over each run's life "
              f"{', '.join(f'{b:.0f}' for b in results['pair_boards_j'])} J")
    path = Path(args.out) / f"gpu_check-{gpu}{'-emulated' if args.emulated else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Extra wall time ``@gogh_placed`` adds to a trivial flow run, warm (docs/performance.md).

Runs a plain ``@flow`` and the same function under ``@gogh_placed`` alternately on one
temporary Prefect server (so both see the same machine load), after warm-up, and reports
p50/p99 of each and of the per-pair difference. State lives in a temp dir.

    .venv/bin/python benchmarks/flow_overhead.py [--runs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--heartbeat", action="store_true",
                    help="keep Prefect's flow heartbeat (default: off, as DESIGN §8 advises; it "
                         "adds about a second to every flow run, placed or not, and hides the difference)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gogh-bench-"))
    os.environ.update({"PREFECT_HOME": str(tmp / "prefect"), "GOGH_HOME": str(tmp / "gogh"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "DO_NOT_TRACK": "true", "PREFECT_LOGGING_LEVEL": "WARNING",
                       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    from prefect import flow

    from gogh_flows import GpuCluster, gogh_placed
    from gogh_flows.flows.session import close_all

    def body(x: int) -> int:
        return x + 1

    plain = flow(name="trivial")(body)
    placed = gogh_placed(model="ResNet-18", batch_size=64, min_throughput=1.0, work_steps=100,
                         cluster=GpuCluster(fleet={"v100": 2, "t4": 2, "k80": 2, "a100": 2}))(
        flow(name="trivial-placed")(body))
    from contextlib import nullcontext

    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    ctx = nullcontext() if args.heartbeat else temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
    t_plain, t_placed = [], []
    with ctx:
        for i in range(3):  # warm: server, pool, registry, predictors, caches
            plain(x=i)
            placed(x=i)
        for i in range(args.runs):
            for fn, acc in ((plain, t_plain), (placed, t_placed)) if i % 2 == 0 else (
                    (placed, t_placed), (plain, t_plain)):
                t = time.perf_counter()
                fn(x=i)
                acc.append(time.perf_counter() - t)
    close_all()
    diff = [b - a for a, b in zip(t_plain, t_placed)]
    res = {
        "runs": args.runs, "cpu_count": os.cpu_count(), "heartbeat": args.heartbeat,
        "plain_p50_ms": 1e3 * statistics.median(t_plain), "plain_p99_ms": 1e3 * pct(t_plain, 0.99),
        "placed_p50_ms": 1e3 * statistics.median(t_placed), "placed_p99_ms": 1e3 * pct(t_placed, 0.99),
        "extra_p50_ms": 1e3 * statistics.median(diff), "extra_p99_ms": 1e3 * pct(diff, 0.99),
        "extra_of_medians_ms": 1e3 * (statistics.median(t_placed) - statistics.median(t_plain)),
    }
    OUT.mkdir(exist_ok=True)
    suffix = "_heartbeat" if args.heartbeat else ""
    (OUT / f"flow_overhead{suffix}.json").write_text(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                                                        for k, v in res.items()}, indent=2) + "\n")
    lines = ["| flow | p50 ms | p99 ms |", "| --- | ---: | ---: |",
             f"| plain `@flow` | {res['plain_p50_ms']:.0f} | {res['plain_p99_ms']:.0f} |",
             f"| `@gogh_placed` | {res['placed_p50_ms']:.0f} | {res['placed_p99_ms']:.0f} |",
             f"| extra, per pair of runs | {res['extra_p50_ms']:.0f} | {res['extra_p99_ms']:.0f} |"]
    (OUT / f"flow_overhead{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""One "host": a process of its own (own GOGH_HOME) placing decorated flow runs onto a shared pool.

Run by tests/test_multihost.py and benchmarks/reliability.py as
``python tests/hostproc/place_runs.py ADDRESS --runs N --threads T ...``; prints one JSON line
per run (gpu, status, error) and a final summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--model", default="ResNet-50")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--min-throughput", type=float, default=5.0)
    ap.add_argument("--hold-s", type=float, default=0.5)
    ap.add_argument("--wait-timeout-s", type=float, default=120.0)
    ap.add_argument("--start-file", help="wait until this file exists before starting (a common start)")
    ap.add_argument("--models", help="cycle through these zoo families (comma-separated) instead of --model")
    ap.add_argument("--exit-every", type=int, default=0, help="every K-th run's body calls sys.exit()")
    ap.add_argument("--solver-limit-s", type=float, default=2.0, help="the optimiser's time limit")
    ap.add_argument("--burst", type=int, default=0, help="start runs in bursts of this many, 1 s apart")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: SQLite under GOGH_HOME)")
    ap.add_argument("--refresh-s", type=float, default=30.0, help="how long a loaded champion is trusted")
    ap.add_argument("--linger-s", type=float, default=0.0,
                    help="stay this long after the runs, the session open (its mirror delivers lost runs' records)")
    ap.add_argument("--custom", action="store_true",
                    help="place a user model (a small torch module) instead of zoo families")
    ap.add_argument("--die-before-record", action="store_true",
                    help="the process dies (exit code 9) when its first run's body has returned, before that "
                         "run's record is logged: a placing process killed in that window")
    args = ap.parse_args(argv)

    if args.die_before_record:
        import os

        from gogh_flows.flows import decorator

        decorator.record_run = lambda *a, **k: os._exit(9)

    from gogh_flows import GpuCluster, PlacementPolicy, PredictorRegistry, current_placement, gogh_placed
    from gogh_flows.flows.session import close_all

    cluster = GpuCluster(mode="remote", address=args.address)
    policy = PlacementPolicy(poll_s=0.2, wait_timeout_s=args.wait_timeout_s,
                             solver_time_limit_s=args.solver_limit_s)
    registry = PredictorRegistry(tracking_uri=args.tracking_uri, refresh_s=args.refresh_s)
    families = args.models.split(",") if args.models else [args.model]

    def body(hold_s: float, exit_now: bool) -> str:
        where = current_placement()
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:  # report as it goes: a cancelled run stops here
            where.report(1)
            time.sleep(0.05)
        if exit_now:
            sys.exit(3)
        return where.gpu_id

    if args.custom:  # a model only this process can read the features of
        import torch
        from torch import nn

        class HostModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))

            def forward(self, x):
                return self.net(x)

        families = ["HostModel"]
        flows = {"HostModel": gogh_placed(model=HostModel(), example_inputs=torch.randn(16, 64), batch_size=16,
                                          min_throughput=args.min_throughput, work_steps=100, cluster=cluster,
                                          registry=registry, policy=policy)(body)}
    else:
        flows = {f: gogh_placed(model=f, batch_size=args.batch_size if not args.models else 32,
                                min_throughput=args.min_throughput, work_steps=100, cluster=cluster,
                                registry=registry, policy=policy)(body) for f in families}

    def hold(i: int) -> str:
        exit_now = bool(args.exit_every) and i % args.exit_every == args.exit_every - 1
        return flows[families[i % len(families)]](args.hold_s, exit_now)

    lock = threading.Lock()
    t0 = [time.monotonic()]

    def one(i: int) -> dict:
        if args.burst:  # bursts of --burst runs, one a second
            time.sleep(max(0.0, t0[0] + i // args.burst - time.monotonic()))
        try:
            gpu = hold(i)
            out = {"i": i, "gpu": gpu, "status": "completed"}
        except BaseException as exc:  # noqa: BLE001 - reported, not raised: the summary counts it
            out = {"i": i, "status": "failed", "error": f"{type(exc).__name__}: {exc}"[:400]}
        with lock:
            print(json.dumps(out), flush=True)
        return out

    if args.start_file:
        from pathlib import Path

        while not Path(args.start_file).exists():
            time.sleep(0.02)
    t0[0] = time.monotonic()
    with ThreadPoolExecutor(args.threads) as ex:
        results = list(ex.map(one, range(args.runs)))
    time.sleep(args.linger_s)
    close_all()
    print(json.dumps({"summary": True, "completed": sum(r["status"] == "completed" for r in results),
                      "failed": sum(r["status"] == "failed" for r in results)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

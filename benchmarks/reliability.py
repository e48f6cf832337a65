"""Load and faults on one pool shared by several placing processes (docs/reliability.md).

Starts, all on loopback and under a temp dir: a Prefect server (`prefect server start`), a
Dask scheduler with the ledger preloaded and 16 emulated GPUs as `dask worker` processes
(`--nworkers` behind nannies, capacity 2), then two host processes (own GOGH_HOME each,
tests/hostproc/place_runs.py) placing decorated flow runs in bursts. While runs are in
flight it injects faults: a worker SIGKILLed (its nanny restarts it), a worker group killed
for good, a placing process SIGKILLed after its claims (its running bodies are stopped), bodies
that call sys.exit(), one host solving with a 1 ms solver limit, a champion predictor version
whose artifacts are garbage, the hosts' MLflow server (`mlflow server`, loopback) stopped for
60 s and restarted, the Dask scheduler stopped (SIGSTOP) for two lease timeouts,
and a run of a deployment served by a Prefect runner cancelled from the
Prefect API while its body runs; afterwards every measurement must be in MLflow exactly once,
those of the killed placing process's runs included (handed in by their workers). Afterwards it reads every run's own record and reports:
runs completed, oversubscriptions (more bodies on a GPU than its capacity at any instant),
unknowing shares (a run next to a partner its decision did not see), measurements lost and
duplicated, and how long each fault's GPUs stayed blocked.

    .venv/bin/python benchmarks/reliability.py [--runs 500] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from runrecords import run_records  # noqa: E402
from gogh_flows.tracking.measurements import read_measurements  # noqa: E402

BIN = Path(sys.executable).parent
HOST = REPO / "tests" / "hostproc" / "place_runs.py"
SERVED = REPO / "tests" / "hostproc" / "served_flow.py"
OUT = REPO / "benchmarks" / "results"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready within {timeout:g} s")


class Bench:
    def __init__(self, tmp: Path, gpus: int, lease_timeout_s: float) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "PYTHONPATH": str(REPO),
                    "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": "40",
                    "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": "40", "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
                    "PREFECT_CLIENT_MAX_RETRIES": "9", "PREFECT_LOGGING_LEVEL": "WARNING",
                    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING", "GOGH_EMULATED": "1",
                    "GOGH_LEASE_TIMEOUT_S": str(lease_timeout_s), "GOGH_MODELS_DIR": str(REPO / "models"),
                    "GOGH_CACHE_DIR": str(tmp / "cache")}
        # the zoo's features extracted once, here, and read by every worker and host it starts
        os.environ["GOGH_CACHE_DIR"] = self.env["GOGH_CACHE_DIR"]
        from gogh_flows.truth.synthetic import default_jobs

        default_jobs()
        logs = tmp / "logs"
        logs.mkdir(parents=True)
        port = _port()
        self.env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        self._start("prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)])
        _wait(lambda: self._ok(f"http://127.0.0.1:{port}/api/health"), 180, "Prefect server")
        sched = tmp / "scheduler.json"
        self.scheduler = self._start("scheduler", [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                  "--no-dashboard", "--scheduler-file", str(sched),
                                  "--preload", "gogh_flows.runtime.ledger"])
        _wait(sched.exists, 60, "Dask scheduler")
        self.address = json.loads(sched.read_text())["address"]
        self.workers = {}
        half = gpus // 2
        for name, n in (("a100", half), ("v100", gpus - half)):  # nannies name workers a100-0 ...
            self.workers[name] = self._start(name, [
                str(BIN / "dask"), "worker", self.address, "--name", name, "--nworkers", str(n),
                "--nthreads", "2", "--resources", "slot=2", "--host", "127.0.0.1", "--no-dashboard"])
        from distributed import Client

        self.client = Client(self.address, timeout=60, set_as_default=False)
        self.client.wait_for_workers(gpus, timeout=300)
        from gogh_flows.runtime.leases import PoolLedger

        self.ledger = PoolLedger(self.client, register=False)

    def start_mlflow(self, port: int | None = None) -> None:
        """The hosts' tracking server; restarted on the same port, so their URI stays valid."""
        self.mlflow_port = port or _port()
        self.mlflow_uri = f"http://127.0.0.1:{self.mlflow_port}"
        self.mlflow = self._start(f"mlflow-{len(self.procs)}", [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port),
            "--backend-store-uri", f"sqlite:///{self.tmp}/mlflow.db",
            "--artifacts-destination", str(self.tmp / "mlartifacts"), "--workers", "1"])
        _wait(lambda: self._ok(f"{self.mlflow_uri}/health"), 180, "MLflow server")

    def stop_mlflow(self) -> None:
        os.killpg(self.mlflow.pid, signal.SIGTERM)
        self.mlflow.wait(timeout=60)

    @staticmethod
    def _ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback
                return r.status == 200
        except OSError:
            return False

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env=self.env, stdout=open(self.tmp / "logs" / f"{name}.log", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def host(self, name: str, *args: str) -> subprocess.Popen:
        home = self.tmp / name
        home.mkdir()
        p = subprocess.Popen([sys.executable, str(HOST), self.address, *args], cwd=str(home),
                             env={**self.env, "GOGH_HOME": str(home)}, stdout=subprocess.PIPE,
                             stderr=open(home / "stderr.log", "w"), text=True, start_new_session=True)
        return p

    def runner(self) -> subprocess.Popen:
        """A Prefect runner serving the deployment ``held/held`` onto the pool (a team's deployment)."""
        home = self.tmp / "runner"
        home.mkdir()
        p = subprocess.Popen([sys.executable, str(SERVED)], cwd=str(home),
                             env={**self.env, "GOGH_HOME": str(home), "GOGH_POOL_ADDRESS": self.address,
                                  "GOGH_SERVED_WAIT_S": "300", "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
                             stdout=open(home / "runner.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def worker_pid(self, name: str) -> int:
        """The OS pid of the worker process serving GPU ``name`` (a nanny's child)."""
        address = next(a for a, w in self.client.scheduler_info(n_workers=-1)["workers"].items()
                       if w["name"] == name)
        return self.client.run(os.getpid, workers=[address])[address]

    def leases_on(self, gpu_ids: set[str]) -> int:
        return sum(1 for x in self.ledger.state().leases if x.gpu_id in gpu_ids)

    def close(self) -> None:
        self.ledger.close()
        self.client.close()
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _lines(proc: subprocess.Popen, timeout: float) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(x) for x in out.splitlines() if x.startswith("{") and "summary" not in x]


def audit(records: list[dict], capacity: int = 2) -> dict:
    """Oversubscriptions and unknowing shares, from the runs' own records."""
    over, unknowing, shared = 0, 0, 0
    by_gpu: dict[str, list[dict]] = {}
    for r in records:
        by_gpu.setdefault(r["gpu"], []).append(r)
    for runs in by_gpu.values():
        for r in runs:
            if sum(1 for o in runs if o["start"] <= r["start"] < o["end"]) > capacity:
                over += 1
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                if a["start"] < b["end"] and b["start"] < a["end"]:
                    shared += 1  # the later placed of the two must have seen the other
                    if a["run"] not in b["saw"] and b["run"] not in a["saw"]:
                        unknowing += 1
    return {"oversubscriptions": over, "unknowing_shares": unknowing, "shared_pairs": shared}


def _garbage_champion(source, tmp: Path) -> int:
    """Register a copy of the champion P1, then overwrite its stored weights with garbage."""
    from gogh_flows.flows.predictors import models_dir

    copy = tmp / "p1-copy"
    shutil.copytree(models_dir() / "synthetic" / "p1", copy)
    block = source.block
    version = source.registry.register(block.p1_name, copy, alias=block.alias)
    run_id = source.registry._ready().get_model_version(block.p1_name, str(version)).run_id
    hit = [f for f in (tmp / "mlartifacts").rglob("*.safetensors") if run_id in str(f)]
    if not hit:
        raise SystemExit(f"no stored weights found for run {run_id} under {tmp / 'mlartifacts'}")
    for f in hit:
        f.write_bytes(b"not a safetensors file")
    return version


def _cancel_from_prefect(bench: Bench) -> dict:
    """What the UI's Cancel button does, to a run of ``held/held`` whose body is running."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    with get_client(sync_client=True) as pc:
        _wait(lambda: _deployed(pc, "held/held"), 300, "the runner's deployment")
        for attempt in range(6):  # the server, on SQLite, answers 503 when saturated: as a user would, retry
            try:
                run = run_deployment("held/held", parameters={"hold_s": 120}, timeout=0)
                break
            except Exception as exc:  # noqa: BLE001 - PrefectHTTPStatusError 503 past the client's retries
                if attempt == 5:
                    raise
                print(f"run_deployment refused ({exc.__class__.__name__}); retrying in 10 s", file=sys.stderr)
                time.sleep(10)
        run_id = str(run.id)
        _wait(lambda: (lease := bench.ledger.get(run_id)) is not None and lease.started_at is not None, 600,
              "the served run's body")
        t0 = time.monotonic()
        pc.set_flow_run_state(run.id, Cancelling())
        # the runner sees the Cancelling state and signals the flow run's process, which asks
        # the body to stop; timed apart: the first is Prefect's, the second gogh's
        _wait(lambda: bench.ledger.get(run_id).cancel if bench.ledger.get(run_id) else True, 180,
              "the stop request from the cancelled run's process")
        asked_s = time.monotonic() - t0
        _wait(lambda: bench.ledger.get(run_id) is None, 120, "the cancelled run's lease")
        freed_s = time.monotonic() - t0
        _wait(lambda: pc.read_flow_run(run.id).state.is_final(), 180, "the cancelled run's final state")
        state = pc.read_flow_run(run.id).state
    return {"fault": "a served flow run cancelled from Prefect while its body runs", "run": run_id,
            "final_state": state.type.value, "stop_asked_after_s": round(asked_s, 2),
            "gpu_blocked_s": round(freed_s, 2)}


def _prefect_states_after(run_ids: set[str], t0: float, timeout_s: float = 120.0) -> tuple[float | None, dict]:
    """The Prefect state of each lost placer's flow run, once all are final (or after ``timeout_s``).

    Longer than Prefect's 60 s SQLite busy timeout, so a server that stands still on a lock for
    that minute delays the figure instead of leaving a run unmarked in the report (run 10)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:
        deadline = time.monotonic() + timeout_s
        while True:
            states = {r: pc.read_flow_run(r.split("#")[0]).state for r in sorted(run_ids)}
            if all(s is not None and s.is_final() for s in states.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        done = all(s is not None and s.is_final() for s in states.values())
    return (round(time.monotonic() - t0, 2) if done else None,
            {r: s.type.value if s is not None else None for r, s in states.items()})


def _deployed(pc, name: str) -> bool:
    try:
        pc.read_deployment_by_name(name)
        return True
    except Exception:  # noqa: BLE001 - not served yet
        return False


def _mlflow_keys(uri: str) -> list[str]:
    """The measurement key of every complete measurement run in MLflow."""
    from mlflow import MlflowClient

    from gogh_flows.tracking.measurements import COMPLETE_TAG, KEY_TAG, MEASUREMENTS_EXPERIMENT

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(MEASUREMENTS_EXPERIMENT)
    keys, token = [], None
    while exp is not None:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token)
        keys += [r.data.tags.get(KEY_TAG, "") for r in page if r.data.tags.get(COMPLETE_TAG) == "true"]
        token = page.token
        if not token:
            break
    return keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=500, help="runs in all, split over the two hosts")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--threads", type=int, default=12, help="concurrent flow runs per host")
    ap.add_argument("--hold-s", type=float, default=0.5)
    ap.add_argument("--lease-timeout-s", type=float, default=10.0)
    ap.add_argument("--json", default=str(OUT / "reliability.json"))
    args = ap.parse_args()
    if args.runs < 2 or args.gpus < 4:
        raise SystemExit("--runs must be >= 2 and --gpus >= 4")
    tmp = Path(tempfile.mkdtemp(prefix="gogh-reliability-"))
    os.environ.update({"GOGH_HOME": str(tmp / "bench"), "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})
    t_start = time.time()
    bench = Bench(tmp, args.gpus, args.lease_timeout_s)
    # this process talks to the same Prefect server (to cancel a served run): before prefect is imported
    os.environ.update({k: bench.env[k] for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_CLIENT_MAX_RETRIES")})
    faults: list[dict] = []
    try:
        bench.start_mlflow()
        from gogh_flows.flows.blocks import PredictorRegistry
        from gogh_flows.flows.predictors import PredictorSource

        source = PredictorSource(PredictorRegistry(tracking_uri=bench.mlflow_uri))
        source.get(bounded=False)  # the shipped prior registered once, as a team's admin would
        per = args.runs // 2
        common = ["--threads", str(args.threads), "--hold-s", str(args.hold_s), "--burst", str(args.threads),
                  "--wait-timeout-s", "300", "--min-throughput", "1.0", "--tracking-uri", bench.mlflow_uri,
                  "--refresh-s", "2"]
        a = bench.host("host-a", "--runs", str(per), "--models", "ResNet-18,ResNet-50,A3C", "--exit-every", "50",
                       *common)
        b = bench.host("host-b", "--runs", str(args.runs - per), "--models", "Transformer,LM,Recommendation",
                       "--solver-limit-s", "0.001", *common)
        victim = bench.host("host-victim", "--runs", "4", "--threads", "4", "--hold-s", "8",
                            "--min-throughput", "1.0", "--wait-timeout-s", "300", "--tracking-uri", bench.mlflow_uri)
        bench.runner()
        _wait(lambda: bench.ledger.state().counts.get("claimed", 0) >= 20, 600, "the first claims")

        # 1. a worker SIGKILLed under a run: its nanny restarts it
        _wait(lambda: any(x.started_at is not None and x.worker.startswith("a100")
                          for x in bench.ledger.state().leases), 300, "a running body")
        busy = [x for x in bench.ledger.state().leases if x.started_at is not None and x.worker.startswith("a100")]
        if busy:
            gpu, run_id = busy[0].worker, busy[0].run_id
            t0 = time.monotonic()
            os.kill(bench.worker_pid(gpu), signal.SIGKILL)
            _wait(lambda: bench.ledger.get(run_id) is None, 60, "the killed worker's lease")
            faults.append({"fault": f"worker {gpu} SIGKILLed (restarted by its nanny)",
                           "gpu_blocked_s": round(time.monotonic() - t0, 2)})
        # 7. the scheduler stopped (SIGSTOP: its event loop stands still) for two lease timeouts
        _wait(lambda: any(x.started_at is not None for x in bench.ledger.state().leases), 300, "a running body")
        before = bench.ledger.state()
        in_flight = sorted(x.run_id for x in before.leases)  # claimed or running as it stopped
        os.kill(bench.scheduler.pid, signal.SIGSTOP)
        try:
            time.sleep(2 * args.lease_timeout_s)
        finally:
            os.kill(bench.scheduler.pid, signal.SIGCONT)
        time.sleep(5)  # the queued heartbeats and refreshes are read
        after = bench.ledger.state()
        faults.append({"fault": f"Dask scheduler stopped (SIGSTOP) for {2 * args.lease_timeout_s:g} s, then resumed",
                       "bodies_running_before": sum(1 for x in before.leases if x.started_at is not None),
                       "runs_in_flight": in_flight,
                       "leases_expired_by_it": after.counts.get("expired", 0) - before.counts.get("expired", 0)})
        # 2. the placing process with long runs SIGKILLed after its claims
        _wait(lambda: any(x.job_type.startswith("ResNet-50 (batch size 64)") and x.started_at is not None
                          for x in bench.ledger.state().leases), 600, "the victim's claims and a body of it running")
        victims = [x for x in bench.ledger.state().leases if x.job_type.startswith("ResNet-50 (batch size 64)")]
        mine = {x.run_id for x in victims}
        t0 = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        _wait(lambda: not mine & {x.run_id for x in bench.ledger.state().leases}, 120, "the victim's leases")
        blocked_s = time.monotonic() - t0
        crashed_s, states = _prefect_states_after(mine, t0)
        faults.append({"fault": "a placing process SIGKILLed after its claims",
                       "claims": len(mine), "gpu_blocked_s": round(blocked_s, 2),
                       "prefect_states": states, "prefect_final_after_s": crashed_s,
                       "bodies_running": sorted(x.run_id for x in victims if x.started_at is not None),
                       "note": "running bodies (8 s) are asked to stop at their next report; their workers "
                               "hand their measurements to the ledger, and host-a or host-b (same tracking "
                               "store) logs them; that process also marks every claimed run's flow run "
                               "Crashed (unstarted ones too)"})
        # 6. a flow run of a served deployment cancelled from Prefect while its body runs
        faults.append(_cancel_from_prefect(bench))
        # 4. a new champion whose artifacts are garbage: the hosts keep the last good version
        version = _garbage_champion(source, tmp)
        faults.append({"fault": f"champion moved to gogh-p1 v{version}, whose weights are garbage",
                       "claims_before": bench.ledger.state().counts.get("claimed", 0)})
        time.sleep(10)
        faults[-1]["claims_10s_after"] = bench.ledger.state().counts.get("claimed", 0)
        # 5. MLflow stopped for 60 s, then restarted on the same port
        claimed = bench.ledger.state().counts.get("claimed", 0)
        bench.stop_mlflow()
        time.sleep(60)
        during = bench.ledger.state().counts.get("claimed", 0) - claimed
        bench.start_mlflow(bench.mlflow_port)
        faults.append({"fault": "MLflow server stopped for 60 s and restarted", "claims_while_down": during})
        # 3. a whole worker group (nanny and its workers) killed for good
        time.sleep(5)
        before = {w["name"] for w in bench.client.scheduler_info(n_workers=-1)["workers"].values()}
        t0 = time.monotonic()
        os.killpg(bench.workers["v100"].pid, signal.SIGKILL)
        gone = {n for n in before if str(n).startswith("v100-")}
        _wait(lambda: bench.leases_on(gone) == 0, 120, "the dead workers' leases")
        faults.append({"fault": f"{len(gone)} v100 workers and their nanny SIGKILLed for good",
                       "gpu_blocked_s": round(time.monotonic() - t0, 2)})
        results = {"host-a": _lines(a, 3600), "host-b": _lines(b, 3600)}
        end_state = bench.ledger.state()
        left, counts = end_state.leases, {**end_state.counts, "undelivered_at_end": end_state.undelivered}
        mlflow_keys = _mlflow_keys(bench.mlflow_uri)
        degraded = sum((tmp / h / "stderr.log").read_text().count("cannot be loaded") for h in ("host-a", "host-b"))
    finally:
        bench.close()

    def table(*hosts: str) -> pl.DataFrame:
        return pl.concat([read_measurements(p) for h in hosts for p in (tmp / h).rglob("table") if (p / "parts").is_dir()],
                         how="diagonal_relaxed")

    # the hosts' own runs, and the victim's delivered by them. Each host's table also holds the
    # other's runs, pulled from their shared MLflow store (every 60 s): one row per measurement key
    # is the team's record, and a run measured twice is one run under two keys
    frame = table("host-a", "host-b").unique(subset="key", keep="first", maintain_order=True)
    delivered = frame.filter(pl.col("extra").str.contains('"logged_by"'))
    own = frame.filter(~pl.col("extra").str.contains('"logged_by"'))
    served = table("runner")
    keys = (frame["run_id"] + ":" + frame["gpu_id"]).to_list()
    # every body that ran, for the audit
    everything = pl.concat([frame, served], how="diagonal_relaxed").unique(subset="key", keep="first",
                                                                           maintain_order=True)
    records = [r for r in run_records(everything.filter(pl.col("extra").str.contains("body_started_at")))]
    victim_fault = next(f for f in faults if f["fault"].startswith("a placing process"))
    victim_fault["measurements_delivered"] = sorted(set(delivered["run_id"]) & set(victim_fault["bodies_running"]))
    stall = next(f for f in faults if f["fault"].startswith("Dask scheduler stopped"))
    stalled = frame.filter(pl.col("run_id").is_in(stall.pop("runs_in_flight")))
    stall["their_measurements"] = stalled.group_by("status").agg(pl.len().alias("runs"),
                                                                pl.col("steps").min().alias("min_steps")).to_dicts()
    cancel_fault = next(f for f in faults if "cancelled from Prefect" in f["fault"])
    rows = served.filter(pl.col("run_id") == cancel_fault["run"])
    cancel_fault["measurements"] = rows.height
    cancel_fault["measured"] = rows.select("status", "steps").to_dicts()
    runs = [r for rs in results.values() for r in rs]
    errors: dict[str, int] = {}
    for r in runs:
        if r["status"] == "failed":
            kind = r["error"].split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    never_ran = sum(n for k, n in errors.items() if k in ("PlacementTimeout", "InfeasibleRequirement"))
    # the Prefect server (SQLite) refusing to create or start a flow run ("database is locked"
    # after its client's retries): such a run never reached gogh's placement. Counted apart,
    # so that "lost" counts only runs that were placed and not measured.
    prefect_refused = errors.get("PrefectHTTPStatusError", 0)
    summary = {
        "runs": len(runs), "completed": sum(r["status"] == "completed" for r in runs), "failed_by_kind": errors,
        "measurements": own.height, "measurements_unique": own["run_id"].n_unique(),
        "prefect_api_refused": prefect_refused,
        "measurements_lost": len(runs) - never_ran - prefect_refused - own["run_id"].n_unique(),
        "measurements_duplicated": everything.height - everything["run_id"].n_unique(),
        # of runs whose placing process was killed: handed in by their workers, logged by a host
        "lost_placer_measurements_delivered": delivered.height,
        "ledger_counts": counts,
        # MLflow, after its 60 s outage: every measurement of the local tables, once
        "mlflow_measurements": len(mlflow_keys), "mlflow_unique": len(set(mlflow_keys)),
        "mlflow_missing": len(set(keys) - set(mlflow_keys)),
        # measurements a host could not mirror before it exited (MLflow was down then): durable
        # in its spool, mirrored by the next process on that home; counted apart from missing
        "mlflow_still_spooled": sum(len(list((tmp / h / "measurements" / "spool").glob("*.json")))
                                    for h in ("host-a", "host-b")),
        "mlflow_duplicated": len(mlflow_keys) - len(set(mlflow_keys)),
        "garbage_champion_warnings": degraded,
        **audit(records), "leases_left_at_end": len(left), "faults": faults,
        "wall_s": round(time.time() - t_start, 1), "gpus": args.gpus, "threads_per_host": args.threads,
        "lease_timeout_s": args.lease_timeout_s,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Everything a placed run needs from its process, opened once and shared by every run.

A Dask pool takes a second or two to start and an MLflow registry lookup tens of
milliseconds; a flow run should pay neither. So the pool, the ledger, the measurement log
and the loaded predictors are kept per process, keyed by the blocks that describe them,
and closed when the process exits.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
from filelock import FileLock

from gogh_flows.flows.blocks import GpuCluster, PredictorRegistry, state_dir
from gogh_flows.flows.measure import deliver_lost_placer_measurements
from mlflow.exceptions import MlflowException

from gogh_flows.predict.io import ModelFormatError, load_p1, load_p2
from gogh_flows.predict.service import ThroughputPredictor, observations_frame
from gogh_flows.runtime.pool import GpuPool, open_pool
from gogh_flows.tracking.backend import check_reachable, is_http
from gogh_flows.tracking.errors import TrackingUnavailableError, UnsafeArtifactError
from gogh_flows.tracking.measurements import MeasurementLog
from gogh_flows.tracking.registry import ModelRegistry
from gogh_flows.truth import load_truth
from gogh_flows.workloads.features import WorkloadFeatures
from gogh_flows.workloads.zoo import parse_job_kind, zoo_features

log = logging.getLogger("gogh_flows")

def models_dir() -> Path:
    """Shipped priors (data, not code): ``$GOGH_MODELS_DIR`` or the repository's models/."""
    return Path(os.environ.get("GOGH_MODELS_DIR", Path(__file__).resolve().parents[2] / "models"))


class FeatureStore:
    """Layer features by job type, shared across processes through small JSON files.

    A run placed by another process is a co-location partner here too, and its
    predictions need its features; zoo job types can be rebuilt from their name,
    user models cannot.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, WorkloadFeatures] = {}

    def _path(self, job_type: str) -> Path:
        return self.root / (hashlib.sha1(job_type.encode()).hexdigest()[:16] + ".json")

    def put(self, job_type: str, features: WorkloadFeatures) -> None:
        if job_type in self._mem:
            return
        self._mem[job_type] = features
        path = self._path(job_type)
        if not path.exists():  # unique temp name per process and thread; the rename is atomic
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"job_type": job_type, "features": features.to_dict()}))
            os.replace(tmp, path)

    def get(self, job_type: str) -> WorkloadFeatures:
        if job_type in self._mem:
            return self._mem[job_type]
        path = self._path(job_type)
        if path.exists():
            doc = json.loads(path.read_text())
            feats = WorkloadFeatures.from_dict(doc["features"])
        else:
            try:
                family, bs, kind = parse_job_kind(job_type)
            except (KeyError, ValueError) as exc:
                raise KeyError(f"no layer features recorded for job type {job_type!r}") from exc
            feats = zoo_features(family, bs, kind)
        self._mem[job_type] = feats
        return feats


@dataclass
class PredictorSource:
    """P1/P2 from the registry by alias, reloaded when the alias moves (checked every refresh_s)."""

    block: PredictorRegistry
    registry: ModelRegistry = field(init=False)
    _loaded: tuple[int | None, int | None] = (None, None)
    _predictor: ThroughputPredictor | None = None
    _checked_at: float = -1e18
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: why the predictors in use are not the registry's current champion (None when they are)
    degraded: str | None = None
    _using: str = ""
    #: champion versions (P1, P2) that could not be loaded, and why: not downloaded again
    #: while the alias stays on them, and said once, not at every refresh
    _refused: dict[tuple[int | None, int | None], str] = field(default_factory=dict)
    #: the open question to the registry: asked on a daemon thread, so a placement can stop
    #: waiting for it (and a process can exit while the registry stalls)
    _asking: Future | None = None
    _asked_at: float = 0.0
    _asking_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.registry = ModelRegistry(self.block.resolved_tracking_uri())

    def ensure_prior(self) -> None:
        """Register the shipped prior under the alias if the registry has nothing there yet."""
        if not self.block.prior:
            return
        base = models_dir() / self.block.prior
        pending = [(name, sub) for name, sub in ((self.block.p1_name, "p1"), (self.block.p2_name, "p2"))
                   if self.registry.version_for(name, self.block.alias) is None]
        if not pending:
            return
        # Flow runs started together (threads or processes on this machine) would otherwise
        # each see an empty alias and register the prior once each: one registers, the others
        # find the alias set once they get the lock.
        lock_dir = state_dir() / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_dir / f"registry-{self._uri_key()}.lock"), timeout=300):
            for name, sub in pending:
                if not (base / sub).is_dir():
                    raise FileNotFoundError(
                        f"shipped prior {base / sub} not found; set GOGH_MODELS_DIR to the models/ folder "
                        "of gogh-flows, or register the predictors yourself (gogh predictors train)")
                self.registry.ensure_registered(name, base / sub, alias=self.block.alias)

    def _uri_key(self) -> str:
        """Short name of the tracking URI for the files kept per registry (lock, model cache)."""
        return hashlib.sha1(self.block.resolved_tracking_uri().encode()).hexdigest()[:10]

    def _cache_root(self) -> Path:
        return state_dir() / "model-cache" / self._uri_key()

    def _fetch(self, name: str, version: int) -> Path:
        """A registered version, downloaded (and verified weights-only) once into the local cache."""
        dest = self._cache_root() / f"{name}-v{version}"
        if not (dest / "config.json").exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.parent / f".{dest.name}.{os.getpid()}.{threading.get_ident()}"
            shutil.rmtree(tmp, ignore_errors=True)
            self.registry.download(f"models:/{name}/{version}", dest=tmp)
            try:
                os.replace(tmp, dest)
            except OSError:  # another process cached it first
                shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def versions(self) -> dict[str, int | None]:
        return {"p1": self._loaded[0], "p2": self._loaded[1]}

    def get(self, *, force: bool = False, bounded: bool = True) -> ThroughputPredictor:
        """The champion, reloaded when its alias moved; never a stall, never a failed placement.

        MLflow unreachable: the predictors already loaded, else the newest versions cached
        locally, else the built-in prior. A champion that cannot be loaded (garbage or
        missing artifacts): the last good version, else the built-in prior. A registry that
        answers its health check but then does not answer within the block's ``timeout_s``:
        the same fall-back, while the question stays open in the background and its answer is
        used by the next placement (one placement waits for a stalled registry, not every
        one). Either way the reason is kept in ``degraded`` for the run's log, and the
        registry is asked again after ``refresh_s``. ``bounded=False`` (retraining) waits for
        the registry's answer however long it takes.
        """
        if not force and self._fresh():
            return self._predictor  # type: ignore[return-value]
        with self._asking_lock:
            if self._asking is not None and not self._asking.done() and force:
                wait_for_futures((self._asking,))  # a forced read must not be answered by an older question
            if self._asking is None or self._asking.done():
                self._asking, self._asked_at = _in_background(self._ask_registry, force), time.monotonic()
            asking, asked_at = self._asking, self._asked_at
        if not bounded:
            return asking.result()
        try:  # whoever asked first, the registry gets timeout_s from the question to answer
            return asking.result(timeout=max(0.0, asked_at + self.block.timeout_s - time.monotonic()))
        except FuturesTimeout:
            return self._stalled()

    def _fresh(self) -> bool:
        return self._predictor is not None and time.monotonic() - self._checked_at < self.block.refresh_s

    def _stalled(self) -> ThroughputPredictor:
        """The registry has not answered in time: place with what is at hand, without waiting for it."""
        # not under the lock: the open question holds it while it waits for the registry
        predictor, using = self._predictor, self._using
        if predictor is None:
            # the first question of this process is still open: the cache or the prior for
            # this placement only; the answer, when it comes, is kept
            predictor, _, using = self._fallback_predictor(self._stall_reason())
        return self._fall_back_to(predictor, using, self._stall_reason())

    def _stall_reason(self) -> str:
        return (f"the MLflow registry at {self.block.resolved_tracking_uri()} did not answer within "
                f"{self.block.timeout_s:g} s")

    def _ask_registry(self, force: bool) -> ThroughputPredictor:
        with self._lock:
            if not force and self._fresh():
                return self._predictor  # type: ignore[return-value]
            self._checked_at = time.monotonic()
            uri = self.block.resolved_tracking_uri()
            try:
                if is_http(uri):  # one short probe instead of MLflow's minutes of retries
                    check_reachable(uri, timeout=3.0)
                self.ensure_prior()
                v1 = self.registry.version_for(self.block.p1_name, self.block.alias)
                v2 = self.registry.version_for(self.block.p2_name, self.block.alias)
            except (TrackingUnavailableError, MlflowException, OSError) as exc:
                return self._fall_back(f"the MLflow registry at {uri} is unreachable ({_short(exc)})")
            if v1 is None:
                raise ValueError(
                    f"no version of {self.block.p1_name!r} has alias {self.block.alias!r} in {uri}; register "
                    "one (gogh predictors train + the registry) or set prior='synthetic' on the "
                    "PredictorRegistry block")
            if self._predictor is None or (v1, v2) != self._loaded:
                if (v1, v2) in self._refused:
                    return self._fall_back(self._refused[(v1, v2)])
                try:
                    p1 = load_p1(self._fetch(self.block.p1_name, v1))
                    p2 = load_p2(self._fetch(self.block.p2_name, v2)) if v2 is not None else None
                except (ModelFormatError, UnsafeArtifactError, FileNotFoundError, ValueError) as exc:
                    # garbage or missing artifacts: asking again will not help until the alias moves
                    self._refused[(v1, v2)] = (f"the champion ({self.block.p1_name} v{v1}, {self.block.p2_name} "
                                               f"v{v2}) cannot be loaded ({_short(exc)})")
                    return self._fall_back(self._refused[(v1, v2)])
                except (MlflowException, OSError) as exc:  # the registry failed to serve them: asked again
                    return self._fall_back(f"the champion ({self.block.p1_name} v{v1}, {self.block.p2_name} "
                                           f"v{v2}) could not be downloaded ({_short(exc)})")
                self._predictor = ThroughputPredictor(p1, p2)
                self._loaded = (v1, v2)
                self._using = f"the predictors already loaded (P1 v{v1}, P2 v{v2})"
                log.info("gogh: loaded predictors %s v%s, %s v%s (alias %s)", self.block.p1_name, v1,
                         self.block.p2_name, v2, self.block.alias)
            self.degraded = None
            return self._predictor

    def _fall_back(self, reason: str) -> ThroughputPredictor:
        """Keep what is loaded, else load the newest cached versions, else the prior (under the lock)."""
        if self._predictor is None:
            self._predictor, self._loaded, self._using = self._fallback_predictor(reason)
        return self._fall_back_to(self._predictor, self._using, reason)

    def _fallback_predictor(self, reason: str) -> tuple[ThroughputPredictor, tuple[int | None, int | None], str]:
        cached = self._newest_cached()
        if cached is not None:
            (d1, v1), (d2, v2) = cached
            return (ThroughputPredictor(load_p1(d1), load_p2(d2) if d2 is not None else None), (v1, v2),
                    f"the versions cached locally (P1 v{v1}, P2 v{v2})")
        base = models_dir() / (self.block.prior or "synthetic")
        if not (base / "p1").is_dir():
            raise RuntimeError(f"{reason}, and there is no cached version nor built-in prior at "
                               f"{base} to place with; set GOGH_MODELS_DIR to gogh-flows' models/")
        p2 = load_p2(base / "p2") if (base / "p2").is_dir() else None
        return ThroughputPredictor(load_p1(base / "p1"), p2), (None, None), f"the built-in prior {base.name!r}"

    def _fall_back_to(self, predictor: ThroughputPredictor, using: str, reason: str) -> ThroughputPredictor:
        message = (f"gogh: {reason}; placing with {using} until it is back (asked again every "
                   f"{self.block.refresh_s:g} s)")
        if message != self.degraded:
            log.warning(message)
        self.degraded = message
        return predictor

    def _newest_cached(self) -> tuple[tuple[Path, int], tuple[Path | None, int | None]] | None:
        """The newest P1 (and P2) versions downloaded before, verified then: the last good ones."""
        root = self._cache_root()

        def newest(name: str) -> tuple[Path, int] | None:
            found = []
            for d in root.glob(f"{name}-v*"):
                suffix = d.name[len(name) + 2:]
                if suffix.isdigit() and (d / "config.json").exists():
                    found.append((int(suffix), d))
            return (max(found)[1], max(found)[0]) if found else None

        p1 = newest(self.block.p1_name)
        if p1 is None:
            return None
        p2 = newest(self.block.p2_name)
        return p1, (p2 if p2 is not None else (None, None))


def _in_background(call, *args) -> Future:
    """``call(*args)`` on a daemon thread, its outcome in a future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="gogh-registry", daemon=True).start()
    return future


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."


class ObservationCache:
    """Logged measurements as P2 observations, re-read only when the table changed."""

    def __init__(self, log: MeasurementLog) -> None:
        self.log = log
        self._stamp: object = None
        self._frame = observations_from_measurements(pl.DataFrame())

    def get(self) -> pl.DataFrame:
        path = self.log.table_path
        stamp = path.stat().st_mtime_ns if path.exists() else None
        if stamp != self._stamp:
            self._frame = observations_from_measurements(self.log.read())
            self._stamp = stamp
        return self._frame


def observations_from_measurements(frame: pl.DataFrame) -> pl.DataFrame:
    """Measurements -> (job_type, gpu_type, partner, throughput): alone, or next to one partner.

    A run that saw two different partners over its life measured neither pair cleanly,
    so it is left out of the observations (it stays in the measurement table).
    """
    if frame.is_empty() or "throughput" not in frame.columns:
        return observations_frame()
    rows = []
    for r in frame.filter((pl.col("throughput") > 0) & (pl.col("steps") > 0)).iter_rows(named=True):
        partners = [p for p in (r.get("partners") or []) if p]
        if len(set(partners)) > 1:
            continue
        rows.append({"job_type": r["job_type"], "gpu_type": r["gpu_type"],
                     "partner": partners[0] if partners else None, "throughput": float(r["throughput"])})
    return observations_frame(rows)


@dataclass
class Environment:
    cluster: GpuCluster
    pool: GpuPool
    measurements: MeasurementLog
    observations: ObservationCache
    features: FeatureStore
    root: Path
    truth: object = None  # the emulated fleet's ground truth (None on real GPUs)
    mirror: object = None  # background MLflow writer (SpoolFlusher)
    released: threading.Condition = field(default_factory=threading.Condition)

    def notify_released(self) -> None:
        # one slot was freed: wake one waiting run (waking all of them makes every waiting
        # run re-solve at once; the others still retry every poll_s)
        with self.released:
            self.released.notify(1)

    def wait_for_release(self, timeout: float) -> None:
        """Sleep until a run of this process frees a slot, or ``timeout`` (other processes: polled)."""
        with self.released:
            self.released.wait(timeout)

    def close(self) -> None:
        try:
            if self.mirror is not None:
                self.mirror.stop()
            self.measurements.flush_spool()
        finally:
            self.pool.close()


class SpoolFlusher:
    """Writes deferred measurements to MLflow in the background.

    A run's measurement is durable before the run returns (parquet table + spool file);
    the MLflow mirror costs ~100-200 ms per run on SQLite, so it is written here instead
    of on the run's critical path. Whatever is left at exit is flushed by ``close``.
    """

    def __init__(self, log: MeasurementLog, interval_s: float = 0.5,
                 collect: Callable[[], object] | None = None, collect_every_s: float = 5.0) -> None:
        self.log = log
        self.interval_s = interval_s
        # also, every collect_every_s: log what the pool's ledger holds for this store
        # (measurements of runs whose placing process was lost)
        self._collect = collect
        self._collect_every_s = collect_every_s
        self._collected_at = -1e18
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gogh-mlflow-mirror", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        wait, failing = self.interval_s, False
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            self._collect_lost()
            try:
                self.log.flush_spool(raise_unreachable=True)  # an outage raises: backed off, said once
            except Exception as exc:  # keep spooled; retried with back-off, said once per outage
                if not failing:
                    log.warning("gogh: MLflow is unavailable, measurements stay in the local table and "
                                "spool and are mirrored when it is back: %s", _short(exc))
                failing, wait = True, min(30.0, max(wait * 2, 1.0))
                continue
            if failing:
                log.warning("gogh: MLflow is back; the spooled measurements were mirrored")
            failing, wait = False, self.interval_s

    def _collect_lost(self) -> None:
        if self._collect is None or time.monotonic() - self._collected_at < self._collect_every_s:
            return
        self._collected_at = time.monotonic()
        try:
            self._collect()
        except Exception as exc:  # noqa: BLE001 - the ledger keeps them; asked again next time
            log.debug("gogh: could not collect measurements from the pool's ledger: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)


_ENVS: dict[str, Environment] = {}
_SOURCES: dict[str, PredictorSource] = {}
_LOCK = threading.Lock()


def _truth_for(cluster: GpuCluster):
    if cluster.mode != "emulated":
        return None
    if cluster.truth == "synthetic":
        from gogh_flows.truth.synthetic import synthetic_table

        return synthetic_table(list(cluster.fleet), seed=cluster.seed)
    return load_truth(cluster.truth)


def environment(cluster: GpuCluster, tracking_uri: str) -> Environment:
    """The process-wide environment of a fleet (opened on first use)."""
    key = f"{cluster.key()}|{tracking_uri}|{state_dir()}"
    with _LOCK:
        env = _ENVS.get(key)
        if env is not None:
            return env
        root = state_dir()
        root.mkdir(parents=True, exist_ok=True)
        truth = _truth_for(cluster)
        lease = cluster.lease_timeout_s
        if cluster.mode == "emulated":
            pool = open_pool("emulated", fleet=cluster.fleet, truth=truth, capacity=cluster.capacity,
                             time_scale=cluster.time_scale, seed=cluster.seed, lease_timeout_s=lease)
        elif cluster.mode == "local-cuda":
            pool = open_pool("local-cuda", capacity=cluster.capacity, lease_timeout_s=lease)
        else:
            pool = open_pool("remote", address=cluster.address, lease_timeout_s=lease)
        measurements = MeasurementLog(tracking_uri, root / "measurements")
        # a shared pool outlives its placing processes: what a lost one's runs measured is
        # kept by the pool's ledger, and collected here (a local pool dies with its process)
        collect = (functools.partial(deliver_lost_placer_measurements, pool.ledger, measurements)
                   if cluster.mode == "remote" else None)
        env = Environment(cluster=cluster, pool=pool, measurements=measurements,
                          observations=ObservationCache(measurements),
                          features=FeatureStore(root / "jobs"), root=root, truth=truth,
                          mirror=SpoolFlusher(measurements, collect=collect))
        _ENVS[key] = env
        return env


def predictor_source(block: PredictorRegistry) -> PredictorSource:
    key = block.model_dump_json()
    with _LOCK:
        src = _SOURCES.get(key)
        if src is None:
            src = _SOURCES[key] = PredictorSource(block)
        return src


def close_all() -> None:
    """Close every pool this process opened (also runs at exit)."""
    with _LOCK:
        envs = list(_ENVS.values())
        _ENVS.clear()
        _SOURCES.clear()
    for env in envs:
        try:
            env.close()
        except Exception as exc:  # closing must not hide the real outcome of a program
            log.warning("gogh: closing a GPU pool failed: %s", exc)


atexit.register(close_all)


def open_environments() -> Mapping[str, Environment]:
    return dict(_ENVS)


__all__ = ["Environment", "FeatureStore", "ObservationCache", "PredictorSource", "close_all",
           "environment", "models_dir", "observations_from_measurements", "predictor_source"]

"""Measurements of placed flow runs: a local parquet table first, MLflow second, nothing lost.

Every measurement is what the refiner (P2) learns from, so losing one silently would bias
retraining toward whatever happened to be logged. Hence the order of writes:

1. the parquet table under `root/table` (the source of truth for retraining): one small file
   per measurement renamed into place, its key claimed atomically, merged in the background
   of later appends (``tracking.table``), so an append costs the same at any length, a crash
   leaves no half row, and concurrent writers (threads, processes) never drop each other's;
2. one MLflow run (for people: UI, comparison, search). If MLflow fails for any reason the
   measurement is written as JSON into `root/spool/` and retried by `flush_spool`.

Each measurement has a key, `run_id:gpu_id`, stored in the table and as an MLflow tag; it
makes logging and flushing idempotent, so a retried hook never produces duplicates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from filelock import FileLock
from mlflow.entities import Metric, Param, RunTag

from gogh_flows import durable
from gogh_flows.tracking.table import (
    PROVISIONAL,
    MeasurementTable,
    read_table_folder,
    unique_rows,
    with_schema,
)
from gogh_flows.tracking.backend import (
    as_uri,
    check_reachable,
    mlflow_client,
    default_artifact_location,
    get_or_create_experiment,
)

log = logging.getLogger(__name__)

MEASUREMENTS_EXPERIMENT = "gogh-measurements"
TABLE_DIR = "table"  # a folder of parquet files: tracking.table
LEGACY_TABLE = "measurements.parquet"  # the one-file table of earlier versions, taken in on open
SPOOL_DIR = "spool"
STATUSES = ("completed", "failed")
#: where a measurement's figures came from: the board (NVML), the emulator, the wall clock
#: alone (a GPU whose board cannot be read: no energy), or nothing (the run never reported
#: back, e.g. its worker died: only the placing process's wall time is known)
TELEMETRY = ("nvml", "emulated", "wallclock", "none")
#: what a measurement's throughput covers (see Measurement.window)
WINDOWS = ("steady", "whole_run", "emulated")
KEY_TAG = "gogh.measurement_key"
TABLE_PENDING = "table_pending"  # a spooled record the table could not take yet
#: extra key of a run whose partners changed after its placement (its prediction was for other company)
PARTNERS_CHANGED = "partners_changed"
#: extra key of a run placed at a trial limit (one level below the best its type measured): its
#: predicted throughput was the rate measured above that level, a hope to be checked, not a prediction
LIMIT_TRIAL = "limit_trial_w"
#: the partners as a JSON list (the ``partners`` param joins them with commas, for reading)
PARTNERS_JSON = "partners_json"
COMPLETE_TAG = "gogh.logged"  # set in the same batch as the metrics: marks a whole run
EMULATED_TIME_TAG = "gogh.emulated_time"  # "true": the run's times are the emulated GPU's, not wall time
_LOCK_TIMEOUT_S = 120.0
_MAX_EXTRA_KEY = 200
_MAX_EXTRA_VALUE = 5000
_EXTRA_KEY_RE = re.compile(r"^[A-Za-z0-9_\-. /:]+$")
# MLflow's SQLAlchemy store has a pool of 5 (+10 overflow) connections and makes a caller
# wait 30 s for one; dozens of threads finishing at once would time out and spool. A few
# writers per tracking URI at a time keep every write fast and nothing has to be retried.
MAX_CONCURRENT_MLFLOW_WRITES = 4
_gates: dict[str, threading.BoundedSemaphore] = {}
_gates_lock = threading.Lock()


def _gate(uri: str) -> threading.BoundedSemaphore:
    with _gates_lock:
        return _gates.setdefault(uri, threading.BoundedSemaphore(MAX_CONCURRENT_MLFLOW_WRITES))


@dataclass(frozen=True)
class Measurement:
    """One flow run on one GPU, as measured (a gang run spanning GPUs gives one per GPU)."""

    run_id: str  # the Prefect flow run id
    flow_name: str
    job_type: str
    family: str | None
    batch_size: int | None
    gpu_id: str
    gpu_type: str
    device: str
    partners: tuple[str, ...]  # job types co-located on the GPU during the run
    required_throughput: float
    predicted_throughput: float | None
    steps: float
    duration_s: float
    throughput: float
    mean_power_w: float | None
    energy_j: float | None
    status: str  # "completed" | "failed"
    telemetry: str  # one of TELEMETRY
    started_at: float  # epoch seconds
    flow_run_url: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: what ``duration_s``, ``throughput`` and ``energy_j`` cover: "steady" (after the warm-up,
    #: to the last report), "whole_run" (the body reported too little; start-up included, so
    #: the refiner does not learn from it) or "emulated" (emulated time, no start-up)
    window: str | None = None
    startup_s: float | None = None  # start of the run to the steady window
    startup_energy_j: float | None = None  # the run's share of the board's energy in that time
    run_energy_j: float | None = None  # the run's share of the whole run: what totals add up

    def __post_init__(self) -> None:
        for name in ("run_id", "flow_name", "job_type", "gpu_id", "gpu_type", "device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Measurement.{name} must be a non-empty string, got {value!r}")
        if self.status not in STATUSES:
            raise ValueError(f"Measurement.status must be one of {STATUSES}, got {self.status!r}")
        if self.telemetry not in TELEMETRY:
            raise ValueError(f"Measurement.telemetry must be one of {TELEMETRY}, got {self.telemetry!r}")
        if isinstance(self.partners, str):
            raise ValueError(f"Measurement.partners must be a sequence of job types, got the string {self.partners!r}")
        object.__setattr__(self, "partners", tuple(str(p) for p in self.partners))
        object.__setattr__(self, "extra", {str(k): str(v) for k, v in dict(self.extra or {}).items()})
        for k, v in self.extra.items():  # MLflow param limits: a record it refuses would sit in the spool
            if not _EXTRA_KEY_RE.match(k) or len(k) > _MAX_EXTRA_KEY or len(v) > _MAX_EXTRA_VALUE:
                raise ValueError(
                    f"Measurement.extra[{k[:40]!r}]: keys must be 1-{_MAX_EXTRA_KEY} characters among letters, "
                    f"digits, '_', '-', '.', ' ', '/', ':' and values at most {_MAX_EXTRA_VALUE} characters "
                    f"(MLflow param rules); got a key of {len(k)} and a value of {len(v)} characters"
                )
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"Measurement.batch_size must be a positive int or None, got {self.batch_size!r}")
        for name in ("required_throughput", "steps", "duration_s", "throughput", "started_at"):
            _check_number(name, getattr(self, name), optional=False)
        for name in ("predicted_throughput", "mean_power_w", "energy_j", "startup_s", "startup_energy_j",
                     "run_energy_j"):
            _check_number(name, getattr(self, name), optional=True)
        if self.window is not None and self.window not in WINDOWS:
            raise ValueError(f"Measurement.window must be one of {WINDOWS} or None, got {self.window!r}")

    @property
    def key(self) -> str:
        """Identity of a measurement: one flow run on one GPU."""
        return f"{self.run_id}:{self.gpu_id}"

    def to_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["partners"] = list(self.partners)
        row["extra"] = json.dumps(dict(self.extra), sort_keys=True)
        row["key"] = self.key
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Measurement:
        """Inverse of to_row (accepts a parquet row or a spooled JSON record)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in row.items() if k in names}
        extra = values.get("extra") or {}
        values["extra"] = json.loads(extra) if isinstance(extra, str) else dict(extra)
        values["partners"] = tuple(values.get("partners") or ())
        return cls(**values)


def _check_number(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"Measurement.{name} must be a finite number{' or None' if optional else ''}, got {value!r}")
    if value < 0:
        raise ValueError(f"Measurement.{name} must be >= 0, got {value!r}")


SCHEMA: dict[str, pl.DataType] = {
    "key": pl.String,
    "run_id": pl.String,
    "flow_name": pl.String,
    "job_type": pl.String,
    "family": pl.String,
    "batch_size": pl.Int64,
    "gpu_id": pl.String,
    "gpu_type": pl.String,
    "device": pl.String,
    "partners": pl.List(pl.String),
    "required_throughput": pl.Float64,
    "predicted_throughput": pl.Float64,
    "steps": pl.Float64,
    "duration_s": pl.Float64,
    "throughput": pl.Float64,
    "mean_power_w": pl.Float64,
    "energy_j": pl.Float64,
    "status": pl.String,
    "telemetry": pl.String,
    "started_at": pl.Float64,
    "flow_run_url": pl.String,
    "extra": pl.String,  # JSON object (keys vary between flows)
    "logged_at": pl.Float64,
    "window": pl.String,
    "startup_s": pl.Float64,
    "startup_energy_j": pl.Float64,
    "run_energy_j": pl.Float64,
}


def empty_table() -> pl.DataFrame:
    return pl.DataFrame(schema=SCHEMA)


def read_measurements(path: str | os.PathLike[str]) -> pl.DataFrame:
    """The measurement table at ``path``, without opening a tracking store: a ``MeasurementLog``'s
    root (``$GOGH_HOME/measurements``), its ``table`` folder, or a one-file table of an earlier
    version. One row per measurement, sorted by started_at (then key)."""
    path = Path(path)
    if path.is_file():
        frame = pl.read_parquet(path)
    elif (path / TABLE_DIR).is_dir() or (path / LEGACY_TABLE).is_file():
        frames = [read_table_folder(path / TABLE_DIR, SCHEMA)] if (path / TABLE_DIR).is_dir() else []
        if (path / LEGACY_TABLE).is_file():  # not yet taken in by a MeasurementLog
            frames.append(pl.read_parquet(path / LEGACY_TABLE))
        frame = pl.concat(frames, how="diagonal_relaxed")
    elif (path / "parts").is_dir() or (path / "segments").is_dir():
        frame = read_table_folder(path, SCHEMA)
    else:
        raise FileNotFoundError(f"no measurement table at {path}: give a MeasurementLog's root (e.g. "
                                f"$GOGH_HOME/measurements, holding {TABLE_DIR}/), its {TABLE_DIR}/ folder, or a "
                                f"{LEGACY_TABLE} file of an earlier version")
    return unique_rows(with_schema(frame, SCHEMA)).sort(["started_at", "key"])


class MeasurementLog:
    """Append-only measurement log: parquet table under `root`, mirrored to MLflow runs."""

    def __init__(
        self,
        tracking_uri: str,
        root: Path,
        experiment: str = MEASUREMENTS_EXPERIMENT,
        *,
        artifact_location: str | Path | None = None,
    ):
        if not tracking_uri:
            raise ValueError("tracking_uri is required, e.g. sqlite:///mlflow.db or http://127.0.0.1:5000")
        self.tracking_uri = str(tracking_uri)
        self.root = Path(root)
        self.experiment = experiment
        self.root.mkdir(parents=True, exist_ok=True)
        self.spool_dir.mkdir(exist_ok=True)
        self._artifact_location = as_uri(artifact_location)
        self.table = MeasurementTable(self.root / TABLE_DIR, SCHEMA, legacy=self.root / LEGACY_TABLE,
                                      lock_timeout_s=_LOCK_TIMEOUT_S)
        self._client = mlflow_client(self.tracking_uri)
        self._experiment_id: str | None = None
        self._table_refusal_said_at = -math.inf

    @property
    def table_path(self) -> Path:
        """The folder of the table's parquet files (see ``tracking.table``)."""
        return self.table.root

    @property
    def store(self) -> str:
        """A short name of where measurements go (tracking URI and experiment), safe to share: a
        hash, since a database URI can hold a password. A file-backed store is named with its
        host too: the same path on two machines is two stores."""
        where = self.tracking_uri
        if where.split(":", 1)[0].lower() in ("sqlite", "file") or "://" not in where:
            where = f"{socket.gethostname()}|{where}"
        return hashlib.sha1(f"{where}|{self.experiment}".encode()).hexdigest()[:16]

    @property
    def spool_dir(self) -> Path:
        return self.root / SPOOL_DIR

    def _spool_lock(self) -> FileLock:
        # A fresh FileLock per use: flock() on separate descriptors excludes threads of this
        # process as well as other processes. (The table needs none: tracking.table.)
        return FileLock(str(self.root / ".spool.lock"), timeout=_LOCK_TIMEOUT_S)

    # -- the parquet table ---------------------------------------------------------------
    def _append(self, m: Measurement) -> str | None:
        """Add `m` to the table: "added", "superseded" (it replaces its run's provisional record),
        or None when its key is already there (a retried log)."""
        return self.table.append({**m.to_row(), "logged_at": time.time()})

    def read(self, since: float | None = None) -> pl.DataFrame:
        """Every measurement, one row each, sorted by started_at (then key); no lock needed."""
        frame = self.table.read()
        if since is not None:
            frame = frame.filter(pl.col("started_at") >= since)
        return frame.sort(["started_at", "key"])

    def pull(self, *, since: float | None = None) -> int:
        """Take into the local table every measurement the tracking store has that it lacks;
        returns how many. ``since``: only runs that ended from then on (epoch seconds; a run's
        end, not its start, so that a run of days is not missed).

        The table is what retraining and placements learn from; MLflow is what the machines of
        a team share. A process placing on one machine, or a retraining run anywhere, saw only
        the measurements logged from its own ``$GOGH_HOME``: pulling makes the store's runs
        (another machine's too) part of it. Each is appended by its key, so a row the table has
        (its own, or pulled before) is not added twice.
        """
        check_reachable(self.tracking_uri)
        experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment is None:
            return 0
        query = f"tags.`{COMPLETE_TAG}` = 'true'"
        if since is not None:
            query += f" and attributes.end_time >= {int(since * 1000)}"
        added, token = 0, None
        while True:
            page = self._client.search_runs([experiment.experiment_id], filter_string=query,
                                            max_results=1000, page_token=token)
            for run in page:
                key = run.data.tags.get(KEY_TAG)
                if not key or self.table.settled(key):
                    continue
                try:
                    m = measurement_of_run(run)
                except (KeyError, ValueError, TypeError) as exc:  # not ours, or from another version
                    log.debug("MLflow run %s is not a readable measurement (%s); not pulled", run.info.run_id, exc)
                    continue
                if m.key == key and self._append(m):
                    added += 1
            token = page.token
            if not token:
                return added

    def measurements(self, since: float | None = None) -> list[Measurement]:
        """The table as Measurement objects (for code that wants typed records)."""
        return [Measurement.from_row(r) for r in self.read(since).iter_rows(named=True)]

    # -- MLflow -------------------------------------------------------------------------
    def _experiment_id_or_create(self) -> str:
        if self._experiment_id is None:
            location = self._artifact_location or default_artifact_location(self.tracking_uri, self.experiment)
            self._experiment_id = get_or_create_experiment(self._client, self.experiment, location)
        return self._experiment_id

    def _find_logged(self, m: Measurement) -> str | None:
        """MLflow run id already holding measurement `m`; partial leftovers are deleted, and so is
        a provisional record (telemetry "none") that `m`, the same run as its worker measured it,
        supersedes (as the table does: ``tracking.table``)."""
        runs = self._client.search_runs(
            [self._experiment_id_or_create()], filter_string=f"tags.`{KEY_TAG}` = '{_quote(m.key)}'", max_results=50
        )

        complete = [r for r in runs if r.data.tags.get(COMPLETE_TAG) == "true"]
        for run in runs:
            if run.data.tags.get(COMPLETE_TAG) != "true":  # a run whose write failed half-way
                self._delete(run.info.run_id)
        found = self._keep_one(complete)
        if found is not None and _provisional(found) and m.telemetry != PROVISIONAL[1]:
            self._delete(found.info.run_id)
            return None
        if found is None:
            return None
        if found.info.status == "RUNNING":  # metrics landed, termination did not
            self._terminate(found.info.run_id, m)
        return found.info.run_id

    def _delete(self, run_id: str) -> None:
        try:
            self._client.delete_run(run_id)
        except Exception as exc:  # noqa: BLE001 - leftovers are harmless, just untidy
            log.debug("could not delete MLflow run %s: %s", run_id, exc)

    def _terminate(self, run_id: str, m: Measurement) -> None:
        """End the MLflow run as the flow run ended (FAILED mirrors a failed flow run)."""
        status = "FAILED" if m.status == "failed" else "FINISHED"
        self._client.set_terminated(run_id, status, end_time=int((m.started_at + _wall_s(m)) * 1000))

    def _write_mlflow(self, m: Measurement, *, check_existing: bool) -> str:
        check_reachable(self.tracking_uri)
        with _gate(self.tracking_uri):
            return self._write_mlflow_now(m, check_existing=check_existing)

    def _write_mlflow_now(self, m: Measurement, *, check_existing: bool, again: bool = True) -> str:
        experiment_id = self._experiment_id_or_create()
        if check_existing:
            existing = self._find_logged(m)
            if existing is not None:
                return existing
        client = self._client
        run = client.create_run(
            experiment_id,
            start_time=int(m.started_at * 1000),
            run_name=f"{m.flow_name}:{m.job_type}@{m.gpu_type}",
            tags={KEY_TAG: m.key},
        )
        run_id = run.info.run_id
        try:
            client.log_batch(run_id, metrics=_metrics(m), params=_params(m), tags=_tags(m))
            self._terminate(run_id, m)
        except Exception:
            if not check_existing:
                raise
            # another host writing the same key at once deleted this run (as a half-written
            # leftover, or as the one not kept): its run holds the measurement, or will; if none
            # does yet, write once more (a second failure leaves the record spooled for the next flush)
            kept = self._settle(m, "")
            if kept:
                return kept
            if not again:
                raise
            return self._write_mlflow_now(m, check_existing=True, again=False)
        return self._settle(m, run_id) if check_existing else run_id

    def _settle(self, m: Measurement, mine: str) -> str:
        """The one MLflow run kept for ``m``'s key once this write is complete; any other complete
        run of the key is deleted.

        The search before the write and the write itself are two calls, and another process may
        write the same key in between (two hosts flushing spools that both hold a run handed out
        again by the pool's ledger): both wrote, and MLflow showed the measurement twice. Every
        write that searched first ends with this search, and all pick the same run by one rule
        (:func:`_kept_first`, as the search before the write does), so however such writes
        interleave, the last one to finish leaves one run. (A write of a key new to this
        process's table, ``log()`` without ``defer``, does not search: no other writer has it.)
        """
        runs = self._client.search_runs(
            [self._experiment_id_or_create()],
            filter_string=f"tags.`{KEY_TAG}` = '{_quote(m.key)}' and tags.`{COMPLETE_TAG}` = 'true'", max_results=50)
        keep = self._keep_one(runs)
        return mine if keep is None else keep.info.run_id

    def _keep_one(self, complete: list[Any]) -> Any | None:
        """Of a key's complete MLflow runs, the one kept (:func:`_kept_first`); the others are deleted."""
        keep = min(complete, key=_kept_first, default=None)
        for run in complete:
            if run is not keep:
                self._delete(run.info.run_id)
        return keep

    # -- spool --------------------------------------------------------------------------
    def _spool(self, m: Measurement, error: BaseException, *, table_pending: bool = False) -> Path:
        """``table_pending``: the table could not take the row; the flush adds it there first."""
        record = {**m.to_row(), "spooled_at": time.time(), "error": f"{type(error).__name__}: {error}",
                  **({TABLE_PENDING: True} if table_pending else {})}
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in m.key)[:120]
        name = f"{int(m.started_at * 1000):015d}-{safe}-{uuid.uuid4().hex[:8]}.json"
        durable.write_text(self.spool_dir / name, json.dumps(record, sort_keys=True, indent=1))
        return self.spool_dir / name

    def spooled(self) -> list[Path]:
        """Spooled measurements waiting for MLflow, oldest first."""
        return sorted(self.spool_dir.glob("*.json"))

    def flush_spool(self, *, raise_unreachable: bool = False) -> int:
        """Write spooled measurements to MLflow; remove each once written. Returns how many.

        A refused record stays spooled and the others are still tried; if the backend goes
        away again it stops and leaves the rest for the next call. Unreadable spool files are
        renamed `*.json.bad`, never deleted. An unreachable backend is logged and 0 returned,
        or, with ``raise_unreachable``, raised: for a caller that backs off and says an
        outage once (the background mirror).
        """
        if not self.spooled():
            return 0
        try:
            check_reachable(self.tracking_uri)
        except ConnectionError as exc:
            if raise_unreachable:
                raise
            log.warning("MLflow still unreachable; %d measurement(s) stay spooled in %s: %s",
                        len(self.spooled()), self.spool_dir, exc)
            return 0
        written = 0
        table_refused: OSError | None = None
        left = 0  # spooled measurements the table refused again
        with self._spool_lock():
            for path in self.spooled():
                try:
                    record = json.loads(path.read_text(encoding="utf-8"))
                    if not isinstance(record, dict):  # JSON, but not a record: it stopped every flush
                        raise TypeError(f"a JSON {type(record).__name__}, not an object")
                    m = Measurement.from_row(record)
                except (OSError, ValueError, TypeError) as exc:
                    bad = path.with_suffix(".json.bad")
                    os.replace(path, bad)
                    log.error("spooled measurement %s is unreadable (%s); kept as %s for inspection", path, exc, bad)
                    continue
                if record.get(TABLE_PENDING):
                    if table_refused is not None:
                        left += 1
                        continue  # the rest would be refused the same way: said once below
                    try:
                        self._append(m)  # a retry that finds it there is a no-op
                    except OSError as exc:
                        table_refused, left = exc, left + 1
                        continue
                try:
                    self._write_mlflow(m, check_existing=True)
                except Exception as exc:  # noqa: BLE001 - any failure: keep it spooled
                    log.warning("MLflow write of spooled measurement %s failed again (%s); %d left in %s",
                                m.key, exc, len(self.spooled()), self.spool_dir)
                    if isinstance(exc, ConnectionError):
                        break  # the backend is down again: the rest would fail the same way
                    continue  # this record alone was refused: do not let it block the others
                path.unlink()
                written += 1
        if table_refused is not None:
            # a full disk would fill faster with a line per row per flush: once a minute at most
            said = time.monotonic() - self._table_refusal_said_at >= 60.0
            log.log(logging.WARNING if said else logging.DEBUG,
                    "the table %s still cannot take %d spooled measurement(s) (%s); they stay spooled",
                    self.table_path, left, table_refused)
            if said:
                self._table_refusal_said_at = time.monotonic()
        return written

    def _table_unwritable(self, m: Measurement, error: OSError) -> str | None:
        """Where a measurement goes when the table cannot take it: the spool, whose flush adds it
        to the table and MLflow; failing that, MLflow now; failing both, an error that holds it."""
        try:
            path = self._spool(m, error, table_pending=True)
        except OSError as exc:
            spool_error = exc  # the except clause's own name does not outlive it
        else:
            log.error("measurement %s could not be added to the table %s (%s); spooled to %s: the next flush "
                      "adds it to the table and to MLflow", m.key, self.table_path, error, path)
            return None
        try:
            run_id = self._write_mlflow(m, check_existing=True)
        except Exception as mlflow_error:  # noqa: BLE001 - said, with the row, below
            raise MeasurementLost(
                f"measurement {m.key} could not be recorded: the table ({error}), the spool ({spool_error}) and "
                f"MLflow ({type(mlflow_error).__name__}: {mlflow_error}) all refused it. Its row, to add by hand "
                f"(MeasurementLog.log(Measurement.from_row(row))): {json.dumps(m.to_row(), default=str)}"
            ) from error
        log.error("measurement %s could not be added to the table %s (%s) nor spooled (%s); it is in MLflow run "
                  "%s only", m.key, self.table_path, error, spool_error, run_id)
        return run_id

    # -- the entry point ----------------------------------------------------------------
    def log(self, m: Measurement, *, defer: bool = False) -> str | None:
        """Record `m`: parquet table first, then MLflow; returns the MLflow run id, or None if spooled.

        Nothing that can still be kept is dropped: a table that cannot take the row (a full or
        read-only disk) sends it to the spool, whose flush adds it to the table and MLflow, or
        failing that to MLflow now; only when all three refuse is :class:`MeasurementLost`
        raised, holding the row. An MLflow error is never raised: the measurement is spooled.
        ``defer=True`` spools the MLflow write on purpose (durable, ~10 ms) for a background
        ``flush_spool()``: what a flow run does so MLflow is off its critical path.
        """
        if not isinstance(m, Measurement):
            raise TypeError(f"MeasurementLog.log expects a Measurement, got {type(m).__name__}")
        try:
            appended = self._append(m)
        except OSError as exc:  # a full or read-only disk: keep it elsewhere, never drop it
            return self._table_unwritable(m, exc)
        if defer:
            try:
                self._spool(m, DeferredWrite("written to MLflow in the background"))
                return None
            except OSError as exc:  # the spool cannot take it: write MLflow now, or the table runs ahead
                log.warning("measurement %s is in the table but could not be spooled for MLflow (%s); writing "
                            "MLflow now", m.key, exc)
        if not appended:
            log.info("measurement %s is already in %s; making sure MLflow has it too", m.key, self.table_path)
        try:
            # a superseding row replaces a run MLflow may have: look for it
            run_id = self._write_mlflow(m, check_existing=appended != "added")
        except Exception as exc:  # noqa: BLE001 - MLflow must never lose a measurement
            try:
                path = self._spool(m, exc)
            except OSError as spool_error:
                log.error("measurement %s is in the table %s but neither MLflow (%s: %s) nor the spool (%s) took "
                          "it: MLflow will lack it; log it again with MeasurementLog.log(m) (the table keeps one "
                          "row per key)", m.key, self.table_path, type(exc).__name__, exc, spool_error)
                return None
            log.warning("MLflow logging of measurement %s failed (%s: %s); spooled to %s, retry with flush_spool()",
                        m.key, type(exc).__name__, exc, path)
            return None
        if self.spooled():
            try:
                self.flush_spool()
            except Exception as exc:  # noqa: BLE001 - the measurement itself is safe already
                log.warning("flushing the measurement spool failed: %s", exc)
        return run_id


def _provisional(run: Any) -> bool:
    return run.data.tags.get("gogh.telemetry") == PROVISIONAL[1]


def _kept_first(run: Any) -> tuple[bool, str]:
    """Which of a key's complete MLflow runs is the one kept: a record with telemetry before a
    provisional one, then the smallest run id (every writer picks the same)."""
    return _provisional(run), run.info.run_id


class MeasurementLost(RuntimeError):
    """A measurement that neither the table, nor the spool, nor MLflow could take."""


class DeferredWrite(Exception):
    """Reason recorded on a measurement spooled on purpose (``log(defer=True)``)."""


def measurement_of_run(run: Any) -> Measurement:
    """The measurement an MLflow run of :class:`MeasurementLog` holds (its params, metrics and
    tags say every field; the start time to the millisecond)."""
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags

    def opt(name: str) -> str | None:
        value = params.get(name, "")
        return value if value != "" else None

    partners = json.loads(params[PARTNERS_JSON]) if PARTNERS_JSON in params else \
        [x for x in params.get("partners", "").split(",") if x]
    return Measurement(
        run_id=tags.get(RUN_ID_TAG, tags["prefect.flow_run_id"]), flow_name=params["flow_name"],
        job_type=params["job_type"],
        family=opt("family"), batch_size=int(params["batch_size"]) if opt("batch_size") else None,
        gpu_id=params["gpu_id"], gpu_type=params["gpu_type"], device=params["device"], partners=tuple(partners),
        required_throughput=float(params["required_throughput"]),
        predicted_throughput=float(params["predicted_throughput"]) if opt("predicted_throughput") else None,
        steps=metrics["steps"], duration_s=metrics["duration_s"], throughput=metrics["throughput"],
        mean_power_w=metrics.get("mean_power_w"), energy_j=metrics.get("energy_j"), status=tags["gogh.status"],
        telemetry=params["telemetry"], started_at=run.info.start_time / 1000.0,
        flow_run_url=tags.get("prefect.flow_run_url"),
        extra={k[len("extra."):]: v for k, v in params.items() if k.startswith("extra.")},
        window=opt("window"), startup_s=metrics.get("startup_s"), startup_energy_j=metrics.get("startup_energy_j"),
        run_energy_j=metrics.get("run_energy_j"),
    )


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _wall_s(m: Measurement) -> float:
    """The run's whole wall time (``duration_s`` is its steady window's)."""
    try:
        return float(m.extra["wall_s"])
    except (KeyError, ValueError):
        return m.duration_s


def _metrics(m: Measurement) -> list[Metric]:
    ts = int((m.started_at + _wall_s(m)) * 1000)
    values: dict[str, float | None] = {
        "throughput": m.throughput,
        "mean_power_w": m.mean_power_w,
        "energy_j": m.energy_j,
        "duration_s": m.duration_s,
        "steps": m.steps,
        "startup_s": m.startup_s,
        "startup_energy_j": m.startup_energy_j,
        "run_energy_j": m.run_energy_j,
    }
    # only for the rows whose rate the refiner learns (gogh_flows.flows.observations._steady_rows):
    # not a whole-run figure (start-up included), nor an emulated fleet's run timed by its body's
    # own reports (the machine's wall time, not the GPU's)
    emulated = m.telemetry == "emulated"
    learnable = (m.window == "steady" and not emulated) or m.window == "emulated" or (m.window is None and emulated)
    if (m.predicted_throughput is not None and m.throughput > 0 and PARTNERS_CHANGED not in m.extra
            and LIMIT_TRIAL not in m.extra and learnable):
        # Signed relative error of the placement's prediction: what P2 retraining reduces. Not
        # for a run whose partners changed after placement (it was predicted for other company),
        # nor for a run at a trial limit (its figure was the rate measured at the level above).
        values["prediction_rel_error"] = (m.predicted_throughput - m.throughput) / m.throughput
    return [Metric(k, float(v), ts, 0) for k, v in values.items() if v is not None]


def _params(m: Measurement) -> list[Param]:
    values = {
        "flow_name": m.flow_name,
        "job_type": m.job_type,
        "family": m.family if m.family is not None else "",
        "batch_size": "" if m.batch_size is None else str(m.batch_size),
        "gpu_type": m.gpu_type,
        "gpu_id": m.gpu_id,
        "device": m.device,
        "partners": ",".join(m.partners),
        PARTNERS_JSON: json.dumps(list(m.partners)),  # exact whatever the names hold (a comma)
        "required_throughput": repr(m.required_throughput),
        "predicted_throughput": "" if m.predicted_throughput is None else repr(m.predicted_throughput),
        "telemetry": m.telemetry,
        "window": m.window or "",
    }
    values.update({f"extra.{k}": v for k, v in m.extra.items()})
    return [Param(k, v) for k, v in values.items()]


#: the measurement's run id as logged (``<flow run id>#<attempt>`` from a flow run's second attempt)
RUN_ID_TAG = "gogh.run_id"


def _tags(m: Measurement) -> list[RunTag]:
    values = {
        # the flow run's own id: a retried attempt's measurement is keyed `<flow run id>#<attempt>`,
        # which filtering MLflow by the flow run's id did not find (a new-user review)
        "prefect.flow_run_id": m.run_id.split("#", 1)[0],
        RUN_ID_TAG: m.run_id,
        "gogh.status": m.status,
        "gogh.telemetry": m.telemetry,
        COMPLETE_TAG: "true",
    }
    if m.flow_run_url:
        values["prefect.flow_run_url"] = m.flow_run_url
    if m.telemetry == "emulated" and m.window in (None, "emulated"):
        # MLflow shows the run's start-to-end (wall time) as its duration, and `duration_s` is the
        # emulated GPU's (minutes for a body that ran a second): say so where it shows
        values[EMULATED_TIME_TAG] = "true"
        values["mlflow.note.content"] = (
            "Emulated fleet: this run's `duration_s` and `throughput` are in the emulated GPU's time; its start "
            "and end (MLflow's duration) are the wall time the flow run took. Energy is the emulator's.")
    elif m.telemetry == "emulated" and m.steps <= 0:
        # nothing ran: a body that raised (or was stopped) before its first step
        values["mlflow.note.content"] = (
            "Emulated fleet: the flow's body did no step (it ended before its first .advance() or "
            "report()); `duration_s` is the wall time it took on the machine that ran it.")
    elif m.telemetry == "emulated":
        # the body reported its own steps instead of running them on the emulated GPU: its rate
        # is this machine's, which no GPU type's figures describe
        values["mlflow.note.content"] = (
            "Emulated fleet, but the flow's body reported its own steps (current_placement().report()) "
            "rather than running them on the emulated GPU (.advance()): `duration_s` and `throughput` are "
            "wall time on the machine that ran it, not the emulated GPU's; energy is the emulator's power "
            "over that time.")
    return [RunTag(k, v) for k, v in values.items()]

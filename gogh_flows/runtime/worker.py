"""What runs on the Dask worker around each body: context, occupancy, telemetry.

Occupancy (which runs share which GPU right now) is kept in the worker's own
process, because only the worker sees its runs start and stop as they happen;
the emulator needs it to know a run's partner at every moment, and every
outcome reports the partners it saw. It is a module-level registry keyed by
device id rather than state on a plugin, so re-registering the configuration
plugin (another client connecting to a shared scheduler) cannot lose it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from gogh_flows.energy import EnergyModel
from gogh_flows.runtime.context import GpuContext, use_gpu
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.leases import WorkerLease
from gogh_flows.runtime.outcome import RunOutcome
from gogh_flows.runtime.run_limits import active_limiter
from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS, Meter, TelemetryReading, WallClockMeter, telemetry_for
from gogh_flows.truth.table import ThroughputTable

__all__ = ["PLUGIN_NAME", "RunNotStarted", "RunSpec", "RuntimeConfig", "execute", "occupancy"]

log = logging.getLogger("gogh_flows.runtime")

PLUGIN_NAME = "gogh-runtime"
TIME_SCALE_ENV = "GOGH_TIME_SCALE"


class RuntimeConfig(WorkerPlugin):
    """Emulator settings shipped once to every worker (instead of with every task)."""

    name = PLUGIN_NAME
    idempotent = False

    def __init__(self, truth: ThroughputTable | None = None, time_scale: float = 0.0,
                 energy: EnergyModel | None = None) -> None:
        self.truth = truth
        self.time_scale = float(time_scale)
        self.energy = energy


_default_lock = threading.Lock()
_default_truth: dict[tuple[str, ...], ThroughputTable] = {}


def _config() -> RuntimeConfig:
    """This worker's configuration, or the defaults when no pool registered one.

    A remote worker started by hand gets the synthetic truth for its own GPU
    type and ``GOGH_TIME_SCALE`` (default 0) from its environment.
    """
    try:
        from distributed import get_worker

        plugin = get_worker().plugins.get(PLUGIN_NAME)
    except ValueError:  # not on a worker (direct call in tests)
        plugin = None
    if isinstance(plugin, RuntimeConfig):
        return plugin
    return RuntimeConfig(None, time_scale_from_env())


def time_scale_from_env() -> float:
    """``$GOGH_TIME_SCALE`` of a worker started by hand (blank: 0, no sleeping): a finite number
    >= 0, refused by name (a bare "could not convert string to float" came back from the run)."""
    raw = os.environ.get(TIME_SCALE_ENV, "").strip() or "0"
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"${TIME_SCALE_ENV} on this worker must be a number >= 0 (wall seconds per emulated "
                         f"second; 0: no sleeping), got {raw!r}")
    return scale


def _default_truth_for(gpu_type: str) -> ThroughputTable:
    with _default_lock:
        key = (gpu_type,)
        if key not in _default_truth:
            from gogh_flows.truth.synthetic import synthetic_table

            _default_truth[key] = synthetic_table(key)
        return _default_truth[key]


@dataclass
class _Occupant:
    run_key: str
    job_type: str
    meter: Meter
    seen: dict[str, str]
    #: a partner came or went while it ran: its rate mixes two companies
    company_changed: bool = False


class Occupancy:
    """Runs executing on each GPU of this process, and who met whom."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._by_gpu: dict[str, dict[str, _Occupant]] = {}
        self._limits: dict[str, float | None] = {}  # each board's power limit in force, set by the last run to join
        self._chosen: dict[str, float | None] = {}  # ... and the limit that run's placement chose (the ledger's)
        #: where a real board's limit is set (per-run limits on): gpu id -> enact(limit W or None)
        self._enact: dict[str, Callable[[float | None], Any]] = {}

    def join(self, gpu_id: str, run_key: str, job_type: str, meter: Meter,
             power_limit_w: float | None = None, enact: Callable[[float | None], Any] | None = None) -> None:
        """A run starts on the board; its placement's limit becomes the board's (one per board).

        ``enact`` sets a real board's limit (:class:`~gogh_flows.runtime.run_limits.BoardLimiter`),
        called under the lock so that the board ends at the last join's limit; when the board
        empties it is called with ``None`` (back to the limit before)."""
        with self._lock:
            runs = self._by_gpu.setdefault(gpu_id, {})
            new = _Occupant(run_key, job_type, meter, {})
            for other in runs.values():
                other.seen[run_key] = job_type
                other.company_changed = True
                new.seen[other.run_key] = other.job_type
            runs[run_key] = new
            if enact is not None:
                self._enact[gpu_id] = enact
            # the limit in force: a real board's may be clamped (an administrator's cap, its range)
            self._limits[gpu_id] = in_force = self._enact_limit(gpu_id, power_limit_w)
            self._chosen[gpu_id] = power_limit_w
            self._notify(runs, in_force)

    def leave(self, gpu_id: str, run_key: str) -> tuple[str, ...]:
        """The run leaves the board: the job types it met there."""
        return self.leave_with_company(gpu_id, run_key)[0]

    def leave_with_company(self, gpu_id: str, run_key: str) -> tuple[tuple[str, ...], bool]:
        """The run leaves the board: the job types it met there, and whether a partner came or
        went while it ran (then its rate is neither its alone nor its pair figure)."""
        with self._lock:
            runs = self._by_gpu.get(gpu_id, {})
            gone = runs.pop(run_key, None)
            for other in runs.values():
                other.company_changed = True
            self._notify(runs, self._limits.get(gpu_id))
            if not runs:
                self._by_gpu.pop(gpu_id, None)
                self._limits.pop(gpu_id, None)  # an empty board goes back to its maximum
                self._chosen.pop(gpu_id, None)
                self._enact_limit(gpu_id, None)
                self._enact.pop(gpu_id, None)
            return (tuple(gone.seen.values()), gone.company_changed) if gone else ((), False)

    def lift_limit(self, gpu_id: str, expected: float) -> float | None:
        """Put a board limited at ``expected`` back to its full limit (its runs' meters are told);
        the limit its placement had chosen (what the ledger knows it by; a real board's in force may
        have been clamped), ``None`` when it no longer had ``expected`` (nothing changed: a join may
        have set another since the caller looked)."""
        with self._lock:
            limit = self._limits.get(gpu_id)
            runs = self._by_gpu.get(gpu_id)
            if limit is None or limit != expected or not runs:
                return None
            self._limits[gpu_id] = None
            chosen = self._chosen.pop(gpu_id, limit)
            self._enact_limit(gpu_id, None)
            self._notify(runs, None)
            return chosen

    def _enact_limit(self, gpu_id: str, limit_w: float | None) -> float | None:
        """Set the board's limit where a real board is behind it; the limit now in force (a real
        board's as set, None when it is not below its limit from before; else ``limit_w``)."""
        enact = self._enact.get(gpu_id)
        if enact is None:
            return limit_w
        try:
            return enact(limit_w)
        except Exception as exc:  # noqa: BLE001 - the runs go on at the board's limit, which they record
            if self._by_gpu.get(gpu_id):
                log.error("gogh: %s; the runs on %s go on at its current limit (recorded with their "
                          "measurements)", exc, gpu_id)
            else:
                log.error("gogh: %s; %s is left at that limit for every user of the machine until it is put "
                          "back (`sudo nvidia-smi -i <index> -pl <watts>`)", exc, gpu_id)
            return limit_w

    def limit(self, gpu_id: str) -> float | None:
        with self._lock:
            return self._limits.get(gpu_id)

    @staticmethod
    def _notify(runs: dict[str, _Occupant], limit_w: float | None) -> None:
        for occ in runs.values():
            occ.meter.set_partners(tuple(o.job_type for k, o in runs.items() if k != occ.run_key))
            set_limit = getattr(occ.meter, "set_power_limit", None)
            if set_limit is not None:
                set_limit(limit_w)

    def snapshot(self) -> dict[str, list[tuple[str, str]]]:
        """gpu_id -> [(run key, job type)] running now in this process."""
        with self._lock:
            return {g: [(k, o.job_type) for k, o in runs.items()] for g, runs in self._by_gpu.items()}


#: The process-wide registry (one per worker process; in-process workers share it, keyed by device).
occupancy = Occupancy()


@dataclass(frozen=True)
class RunSpec:
    """Everything the worker needs to know about one run besides the body."""

    device: GpuDevice
    mode: str
    emulated: bool
    run_key: str
    job_type: str | None = None
    run_id: str | None = None
    partners: Sequence[str] | Callable[[], Sequence[str]] | None = None
    check_worker: bool = True
    hold_lease: bool = False  # hold the ledger lease named run_id while the body runs
    #: with hold_lease: the run's measurement as (tracking store, row), built here when its
    #: placing process was lost, since nobody else is left to log it
    record_if_placer_lost: Callable[[RunOutcome], tuple[str, dict[str, Any]]] | None = None
    warmup_steps: float = DEFAULT_WARMUP_STEPS  # steps before the steady-state window opens
    power_limit_w: float | None = None  # the board limit the run's placement chose (None: maximum)
    #: the job's layer features: an emulated fleet whose truth lacks the job type (a user's own
    #: model) computes its figures from them on the synthetic fleet (:func:`_learn_job`)
    features: Any = None
    #: steps/s the run's placement promised it (None: no requirement): below it at a lowered board
    #: limit, the board goes back to its full limit (:class:`LimitGuard`)
    required_throughput: float | None = None
    #: seconds between the board's power samples (NVML) while the run is on it
    sample_interval_s: float = 0.1


class LimitGuard:
    """Lifts a run's board to its full limit (the maximum; on a real board, the limit it had before
    gogh changed it) when the run measures below its requirement under a lowered one.

    The placement chose the limit from the run's *predicted* rate and power draw; when those were
    optimistic the run would stay short of its requirement for its whole life (runs are not
    moved). The ledger is told (``on_lift``: the run's lease), which bumps the GPU's version, so
    a placement decided on the lower limit is refused and decides again. The guard looks at
    every report once the meter has a rate to go by (``rate_now``: the emulator's exact rate
    after the warm-up; on a measured board, the rate over as many steps again since the warm-up,
    the last limit change or the last partner change) and acts only while the board is limited
    (the limit in force: a real board's chosen limit that a cap or its range left at the limit
    from before is none), so it costs nothing at full power.
    """

    def __init__(self, device: GpuDevice, run: str, required: float, occupancy: Occupancy,
                 on_lift: Callable[[float], None] | None = None) -> None:
        self.device, self.run, self.required, self.occupancy = device, run, float(required), occupancy
        self.on_lift = on_lift  # told the limit lifted (the run's lease tells the ledger)
        self.lifted: list[tuple[float, float]] = []  # (limit W lifted, rate then)

    def __call__(self, meter: Any) -> None:
        try:
            self._look(meter)
        except Exception as exc:  # noqa: BLE001 - a guard must never fail the body it watches
            log.error("gogh: the power-limit guard of run %s on %s failed: %s: %s", self.run, self.device.id,
                      type(exc).__name__, exc)

    def _look(self, meter: Any) -> None:
        limit = self.occupancy.limit(self.device.id)
        if limit is None:
            return
        rate = meter.rate_now()
        if rate is None or rate >= self.required * (1 - 1e-9):
            return
        chosen = self.occupancy.lift_limit(self.device.id, expected=limit)
        if chosen is not None:
            self.lifted.append((limit, rate))  # the limit in force: what the rate was measured under
            log.warning("gogh: run %s measured %.4g steps/s on %s, below its required %.4g, at the board's "
                        "%g W limit: the board goes back to its full limit", self.run, rate, self.device.id,
                        self.required, limit)
            if self.on_lift is not None:
                self.on_lift(chosen)


class RunNotStarted(RuntimeError):
    """The body was not started: its lease was gone (lapsed, released, worker replaced) or a stop was asked."""


def _predicted_power(device: GpuDevice, job_type: str | None, truth: ThroughputTable | None,
                     energy: EnergyModel | None) -> float | None:
    """The run's board power alone by the power model: its weight on a shared board until measured.

    From the pool's truth table when it has the job, else from the zoo model's own features
    (one model, not the whole table: the run waits for this); ``None`` for a job of the
    user's own that the worker cannot see the features of.
    """
    try:
        model = energy or EnergyModel()
        activity = truth.activity(job_type, device.gpu_type) if truth is not None and job_type else None
        if activity is None and job_type:
            from gogh_flows.power_model import zoo_profile

            activity = zoo_profile(job_type, device.gpu_type)[1].activity
        return None if activity is None else model.power_alone(device.gpu_type, activity)
    except Exception as exc:  # noqa: BLE001 - without it a shared board is split by measured power or evenly
        log.debug("no predicted power for %s on %s: %s", job_type, device.id, exc)
        return None


def _scheduler_call(worker: Any) -> Callable[..., Any]:
    from distributed.utils import sync

    def call(op: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        return sync(worker.loop, getattr(worker.scheduler, op), callback_timeout=timeout_s, **kwargs)

    return call


def _shippable(exc: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception that cannot travel comes back as text
        return None
    return exc


def execute(fn: Callable[..., Any], args: tuple, kwargs: dict, spec: RunSpec) -> RunOutcome:
    """Run ``fn`` on this worker's GPU, measured, and return its :class:`RunOutcome`."""
    device = spec.device
    worker_name = None
    worker = None
    if spec.check_worker or spec.hold_lease:
        from distributed import get_worker

        worker = get_worker()
        worker_name = str(worker.name)
    if spec.check_worker:
        if worker_name != device.worker:
            # The scheduler restrictions make this impossible; if it ever
            # happens the measurements would be filed under the wrong GPU.
            raise RuntimeError(
                f"run {spec.run_key} for GPU {device.id!r} landed on worker {worker_name!r}, "
                f"not on its pinned worker {device.worker!r}"
            )
    config = _config()
    truth = config.truth
    if spec.emulated and truth is None:
        truth = _default_truth_for(device.gpu_type)
    if spec.emulated and truth is not None and spec.job_type and spec.features is not None \
            and not truth.knows(spec.job_type):
        _learn_job(truth, spec.job_type, spec.features)
    override = spec.partners
    if override is not None and not callable(override):
        fixed = tuple(override)
        override = lambda: fixed  # noqa: E731
    meter = telemetry_for(
        device, "emulated" if spec.emulated else spec.mode, job_type=spec.job_type, truth=truth,
        time_scale=config.time_scale, energy=config.energy, partners=override, warmup_steps=spec.warmup_steps,
        interval_s=getattr(spec, "sample_interval_s", 0.1),
        power_w=None if spec.emulated else _predicted_power(device, spec.job_type, truth, config.energy),
    )
    emulated = meter.source == "emulated"
    ctx = GpuContext(
        device=device, torch_device="cpu" if emulated else "cuda:0", mode=spec.mode,
        job_type=spec.job_type, run_id=spec.run_id, emulated=emulated, meter=meter,
    )
    job_label = spec.job_type or "unknown"
    value: Any = None
    error = tb = None
    exc_out: BaseException | None = None
    lease = None
    if spec.hold_lease:
        lease = WorkerLease(str(spec.run_id), _scheduler_call(worker), on_cancel=ctx.request_stop)
        try:
            why_not = None if lease.begin(str(worker_name), key=worker.get_current_task()) else (
                "its slot lease was no longer held (it lapsed, was released by its placing process, or was "
                "dropped when the worker was replaced)")
        except TimeoutError as exc:  # asyncio's too, since Python 3.11
            why_not = (f"the pool's scheduler did not answer whether it may start ({exc or 'timed out'}); "
                       "its lease lapses on its own")
        if why_not is not None:
            meter = _start_meter(meter, device, spec)
            not_started = RunNotStarted(f"run {spec.run_id} was not started on {device.id}: {why_not}; "
                                        "place the run again")
            return RunOutcome(value=None, telemetry=meter.stop(), partners=(), error=f"RunNotStarted: {not_started}",
                              gpu_id=device.id, gpu_type=device.gpu_type, job_type=spec.job_type,
                              run_id=spec.run_id, worker=worker_name, exception=not_started)
        ctx.placer_connected = lease.placer_connected
    meter = ctx.meter = _start_meter(meter, device, spec)
    limiter = None if emulated else active_limiter()
    if spec.power_limit_w is not None and not emulated and limiter is None:
        log.warning("gogh: power limit %g W chosen for run %s on %s is not applied: this pool does not set "
                    "per-run limits on real boards (GpuCluster(mode='local-cuda', run_power_limits=True) does, "
                    "with the permission `nvidia-smi -pl` needs); the board runs at its current limit (recorded "
                    "with the measurement)", spec.power_limit_w, spec.run_id or spec.run_key, device.id)
    # the board's limit per the ledger (the last claim on it) where the run holds a lease: a run
    # placed earlier at its own limit can start after a later claim re-chose the board's
    board_limit = lease.board_limit_w if lease is not None and lease.board_limit_known else spec.power_limit_w
    enact = (lambda w: limiter.lower(device, w)) if limiter is not None else None
    limits_enacted = emulated or enact is not None
    guard = None
    if spec.required_throughput is not None and limits_enacted:
        guard = meter.watch = LimitGuard(device, spec.run_id or spec.run_key, spec.required_throughput, occupancy,
                                         on_lift=lease.lift if lease is not None else None)
    occupancy.join(device.id, spec.run_key, job_label, meter, board_limit if limits_enacted else None, enact=enact)
    seen: tuple[str, ...] = ()
    changed = False
    body_start = time.time()
    try:
        with use_gpu(ctx):
            value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() and KeyboardInterrupt too: measured,
        # the slot freed, then handed back in the outcome and raised again by unwrap()
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tb = traceback.format_exc()
        # a thread worker of the placing process hands the exception over as it is (nothing is
        # pickled in between, as with a plain flow); one in another process must survive pickling
        in_process = worker is not None and str(getattr(worker, "address", "")).startswith("inproc://")
        exc_out = exc if in_process else _shippable(exc)
    finally:
        body_end = time.time()
        seen, changed = occupancy.leave_with_company(device.id, spec.run_key)
        reading: TelemetryReading = meter.stop()
        if guard is not None and guard.lifted:
            reading = dataclasses.replace(reading, limit_lifted_from_w=guard.lifted[0][0],
                                          limit_lifted_rate=guard.lifted[0][1])
    outcome = None
    try:
        if override is not None and emulated:
            seen = meter.seen_partners  # type: ignore[attr-defined]
        outcome = RunOutcome(
            value=value, telemetry=reading, partners=seen, error=error, gpu_id=device.id,
            gpu_type=device.gpu_type, job_type=spec.job_type, run_id=spec.run_id, worker=worker_name,
            traceback=tb, exception=exc_out, started_at=body_start, ended_at=body_end, company_changed=changed,
        )
    finally:
        if lease is not None:
            # the slot is freed with this worker's record of the run, which the ledger keeps until the
            # run is logged: by its placing process, or, if that is lost, by the next one
            lease.end(_record(spec, outcome) if outcome is not None else None)
    return outcome


_learn_lock = threading.Lock()
_learned: dict[str, Any] = {}  # features of the job types learned so far in this process


def _learn_job(truth: ThroughputTable, job_type: str, features: Any) -> None:
    """Add a job type the emulated truth lacks (a user's own model), from its features.

    Its figures come from the synthetic fleet, alone and next to every job the truth knows that
    is a zoo model (those have features); the table is extended in place, so the meters of its
    partners find the pair too. Once per job type and worker process.
    """
    from gogh_flows.predict.data import UnknownJobFeaturesError, zoo_jobs
    from gogh_flows.truth.synthetic import SyntheticFleet

    with _learn_lock:
        if truth.knows(job_type):
            return
        known: dict[str, Any] = {}
        for name in truth.job_types:
            if name in _learned:
                known[name] = _learned[name]
                continue
            try:
                known.update(zoo_jobs([name]))
            except UnknownJobFeaturesError:
                continue  # a Gavel type without zoo features: no pair with it is computed
        # on the table's own boards, seed and noise when it is a synthetic fleet's (a PCIe V100
        # runs a user's model slower too)
        spec = dict(truth.fleet or {})
        fleet = SyntheticFleet(gpu_types=truth.gpu_types, jobs={**known, job_type: features}, **spec)
        source = truth.source
        truth.absorb(ThroughputTable.from_rows(fleet.rows_for(job_type), source=f"synthetic({job_type})"))
        _learned[job_type] = features
        if source.startswith("synthetic"):
            log.info("gogh: the emulated fleet learned %r from its layer features (synthetic fleet)", job_type)
        else:  # two truths in one fleet: its figures are not comparable with the table's own
            log.warning("gogh: %r is not in the emulated fleet's table (%s); its figures come from the synthetic "
                        "fleet (from its layer features), which the table's own job types do not follow: "
                        "compare its runs with the others' with care", job_type, source)


def _record(spec: RunSpec, outcome: RunOutcome) -> tuple[str, dict[str, Any]] | None:
    """This worker's record of the run (tracking store, measurement row), for the ledger to keep."""
    if spec.record_if_placer_lost is None:
        return None  # a thread worker of the placing process: lost together, nothing to keep
    try:
        return spec.record_if_placer_lost(outcome)
    except Exception as exc:  # noqa: BLE001 - said; the run's outcome stands
        log.error("gogh: could not build this worker's record of run %s (kept in case its placing process is "
                  "lost): %s", spec.run_id, exc)
        return None


def describe_worker() -> dict[str, Any]:
    """What a remote worker advertises about its GPU (run on every worker by ``remote_pool``)."""
    import socket

    emulated = os.environ.get("GOGH_EMULATED", "").strip().lower() in ("1", "true", "yes", "on")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {
        "gpu_type": os.environ.get("GOGH_GPU_TYPE") or None,
        "emulated": emulated,
        "cuda_visible_devices": visible,
        "hostname": socket.gethostname(),
        "time": time.time(),
        **({} if emulated or not visible else _pinned_board(visible.split(",")[0])),
    }


def _start_meter(meter: Meter, device: GpuDevice, spec: RunSpec) -> Meter:
    """``meter`` started; a real board's meter that fails to start (NVML refusing after the probe
    passed) gives way to the wall clock, said, so the run goes on and its lease is ended as
    usual rather than held until it lapses."""
    try:
        meter.start()
        return meter
    except Exception as exc:  # noqa: BLE001 - any NVML error; an emulated meter does not fail here
        if meter.source == "emulated":
            raise
        log.warning("gogh: measuring run %s on %s through NVML failed to start (%s: %s); it is timed by the "
                    "wall clock instead, its energy unknown", spec.run_id or spec.run_key, device.id,
                    type(exc).__name__, exc)
        fallback = WallClockMeter(warmup_steps=spec.warmup_steps)
        fallback.start()
        return fallback


def _pinned_board(entry: str) -> dict[str, str | None]:
    """The NVML UUID of the board this worker's first CUDA device is: NVML's numbering is not
    CUDA's, so the pool measures and limits by UUID (:mod:`.nvml`). Asked once per process and
    entry when NVML answered; asked again while it did not (a driver that was not up yet)."""
    from gogh_flows.runtime.nvml import resolve_cuda_entry

    known = _PINNED.get(entry)
    if known is None:
        uuid, note = resolve_cuda_entry(entry)
        known = {"nvml_uuid": uuid, "pin_note": note}
        if uuid is not None or note is not None:
            _PINNED[entry] = known
    return known


_PINNED: dict[str, dict[str, str | None]] = {}

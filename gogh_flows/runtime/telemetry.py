"""What a run measured: throughput, power, energy, memory, utilisation.

Two sources produce the same :class:`TelemetryReading`, so everything
downstream (MLflow logging, the retraining data) never asks where a number came
from, only ``reading.source``:

* ``"nvml"``: a background thread samples the board through NVML (power,
  utilisation, memory) and energy comes from the board's energy counter when it
  has one (Volta and newer), otherwise from integrating the sampled power.
* ``"emulated"``: the truth table and the energy model say what the run would
  have drawn (see :mod:`gogh_flows.runtime.emulation`).

Throughput and energy describe the run's **steady state**: the stretch between
the report at which ``warmup_steps`` steps have been done and the last report
(:class:`StepWindow`), the way Zeus measures between ``begin_window`` and
``end_window``. Building the model, the CUDA context and autotuning happen before
it and are recorded apart (``startup_s``, ``startup_energy_j``): counted in the
throughput, they made a fresh worker's first run look 2.5x slower than it ran,
and the refiner learned that. A body that reports too little for a window (one
report, none and the declared work counted at the end, or its reports all within
``MIN_WINDOW_S`` of each other after the warm-up) is measured over the whole run,
and says so (``window="whole_run"``).

NVML readings of a board shared by several runs are split between them
(:mod:`gogh_flows.runtime.board`): ``attributed_energy_j`` is the run's share,
``energy_j`` the board's over the same window, so summing runs never counts a
shared stretch twice.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gogh_flows.energy import EnergyModel
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.truth.table import ThroughputTable

__all__ = [
    "DEFAULT_WARMUP_STEPS",
    "MIN_WINDOW_S",
    "Meter",
    "StepCounter",
    "StepWindow",
    "WallClockMeter",
    "NvmlSampler",
    "TelemetryReading",
    "nvml_fallback_warned",
    "telemetry_for",
]

log = logging.getLogger("gogh_flows.runtime")


#: Steps a run does before its steady-state window opens, unless the decorator says otherwise:
#: the first steps pay for cuDNN autotuning, lazy allocation and caches warming up.
DEFAULT_WARMUP_STEPS = 5


#: The shortest steady window measured as one (s): below it the reports' own timing is the
#: figure, not the steps (NVML's power samples are 100 ms apart; a step is rarely under 1 ms).
MIN_WINDOW_S = 0.01


@dataclass(frozen=True)
class StepWindow:
    """The steady-state stretch of a run: from the report that completed the warm-up to the last.

    Times are the meter's clock; steps are the body's cumulative count at each end.
    """

    start_t: float
    start_steps: float
    end_t: float
    end_steps: float

    @property
    def steady(self) -> bool:
        """Whether there is a stretch to measure: two reports apart in steps, and at least
        :data:`MIN_WINDOW_S` apart in time. Reports called in a burst (a body that reports its
        steps at the end) span microseconds, and their ratio was logged as the run's throughput
        (98,000 steps/s for a run of 5: a Prefect review); the whole run measures it then."""
        return self.end_t - self.start_t >= MIN_WINDOW_S and self.end_steps > self.start_steps

    @property
    def duration_s(self) -> float:
        return self.end_t - self.start_t

    @property
    def steps(self) -> float:
        return self.end_steps - self.start_steps


@dataclass(frozen=True)
class TelemetryReading:
    """One run's measurements.

    ``window`` says what ``duration_s``, ``throughput`` and the energies cover: ``"steady"``
    (from the end of the warm-up to the last report; ``window_steps`` in ``duration_s``),
    ``"whole_run"`` (the body reported too little for a window: start to stop), or
    ``"emulated"`` (emulated seconds of ``advance()``, which have no start-up).
    ``steps`` is every step the body did, warm-up included; ``throughput`` is
    ``window_steps / duration_s`` (0 when nothing was reported). ``wall_s`` is always the
    whole run's wall time.

    Energies: ``energy_j`` is the board's over the window (both occupants' when shared),
    ``attributed_energy_j`` the run's own share of it; ``run_energy_j`` is the run's share of
    the whole run (start-up and tail included: what totals add up) and ``board_run_energy_j``
    the board's. ``startup_s``/``startup_energy_j`` cover the start of the run to the window.
    ``mean_power_w`` is the board's mean power over the window. ``energy_method`` is
    ``"counter"`` (NVML energy counter), ``"integrated"`` (sampled power) or ``"model"``
    (emulated); ``energy_split`` says how a shared board's energy was divided
    (``"alone"``, ``"model"``, ``"measured"``, ``"equal"``, or several joined by ``+``).
    """

    source: str
    duration_s: float
    steps: float
    throughput: float
    mean_power_w: float | None
    energy_j: float | None
    max_memory_bytes: int | None
    mean_utilisation: float | None
    wall_s: float | None = None
    attributed_energy_j: float | None = None
    energy_method: str | None = None
    samples: int = 0
    window: str = "whole_run"
    window_steps: float | None = None
    startup_s: float | None = None
    startup_energy_j: float | None = None
    run_energy_j: float | None = None
    board_run_energy_j: float | None = None
    energy_split: str | None = None
    power_limit_w: float | None = None  # the board's power limit during the run (NVML, or the emulator's)
    #: how much the board's limit slowed the run (1: not at all): the emulator's own factor, so
    #: what is learned from the run can be brought back to full power (flows/observations.py)
    limit_slowdown: float | None = None
    #: the board limit (W) the worker's guard lifted because this run measured below its
    #: requirement under it (None: not lifted); see runtime/worker.py LimitGuard
    limit_lifted_from_w: float | None = None
    #: the run's rate (steps/s) the guard measured at that limit: what the next placement of its
    #: job type learns the limit gives (flows/observations.py ``limit_evidence_from_measurements``)
    limit_lifted_rate: float | None = None

    def as_metrics(self) -> dict[str, float]:
        """The numeric fields that are set, flat, for a metrics logger."""
        out: dict[str, float] = {}
        for name in ("duration_s", "steps", "throughput", "mean_power_w", "energy_j", "max_memory_bytes",
                     "mean_utilisation", "wall_s", "attributed_energy_j", "window_steps", "startup_s",
                     "startup_energy_j", "run_energy_j", "board_run_energy_j", "power_limit_w"):
            value = getattr(self, name)
            if value is not None:
                out[name] = float(value)
        return out


@runtime_checkable
class Meter(Protocol):
    """What measures one run: started before the body, stopped after it."""

    source: str

    def start(self) -> None: ...

    def report(self, steps: float = 1.0) -> None: ...

    def advance(self, steps: float, between: Callable[[], None] | None = None) -> None: ...

    def set_partners(self, partners: tuple[str, ...]) -> None: ...

    @property
    def partners(self) -> tuple[str, ...]:
        """Job types sharing the GPU now."""

    @property
    def steps(self) -> float:
        """Steps reported (or advanced) so far: the body's own count of its work.

        Callers decide from it whether the body reported anything; a meter that did not
        declare it made the decorator add the declared work a second time (doubled steps).
        """

    def stop(self) -> TelemetryReading: ...


class StepCounter:
    """The part every meter shares: the body's progress count, its steady-state window, and
    who shares the GPU.

    ``report`` may be called from the body's threads while the worker's occupancy
    tracking calls ``set_partners`` from others, so both go through ``_lock``. The window
    opens at the report that brings the count to ``warmup_steps`` (the first report when
    0) and ends at the latest report; :meth:`_on_report` lets a meter mark its energy
    account at those instants.
    """

    def __init__(self, lock: threading.Lock | threading.RLock | None = None, *,
                 clock: Callable[[], float] | None = None, warmup_steps: float = DEFAULT_WARMUP_STEPS) -> None:
        import time

        if not warmup_steps >= 0:
            raise ValueError(f"warmup_steps must be a number of steps >= 0, got {warmup_steps!r}")
        self._lock = lock or threading.Lock()
        self._clock = clock or time.monotonic
        self.warmup_steps = float(warmup_steps)
        self._steps = 0.0
        self._partners: tuple[str, ...] = ()
        self._window_start: tuple[float, float] | None = None
        self._last_report: tuple[float, float] | None = None
        self._since: tuple[float, float] | None = None  # (time, steps) of the board's last limit change
        #: called after each report, outside the meter's lock (the worker's limit guard)
        self.watch: Callable[[Any], None] | None = None

    def report(self, steps: float = 1.0) -> None:
        # a NaN or a negative count would reach the measurement and lose it (its record refuses
        # a non-finite count) or make it meaningless: refused here, where the body sees it
        try:
            count = float(steps)
        except (TypeError, ValueError):
            count = math.nan
        if not (math.isfinite(count) and count >= 0):
            raise ValueError(f"report() takes the number of steps done since the last report, a finite number "
                             f">= 0, got {steps!r}")
        with self._lock:
            self._steps += count
            now = self._clock()
            opened = self._window_start is None and self._steps >= self.warmup_steps
            if opened:
                self._window_start = (now, self._steps)
            self._last_report = (now, self._steps)
            self._on_report(now, opened)
        if self.watch is not None:
            self.watch(self)

    def _limit_changed(self) -> None:
        """The board's limit changed: a rate from now on is the new limit's (as after a partner
        came or went, :meth:`set_partners`)."""
        with self._lock:
            self._since = (self._clock(), self._steps)

    def rate_now(self) -> float | None:
        """Steps/s since the warm-up and the board's last limit change, once ``warmup_steps`` more
        steps were reported over a measurable time (``None`` before): evidence enough to act on."""
        with self._lock:
            if self._window_start is None or self._last_report is None:
                return None
            t0, s0 = max(self._window_start, self._since or self._window_start)
            t1, s1 = self._last_report
            if s1 - s0 < max(1.0, self.warmup_steps) or t1 <= t0:
                return None
            return (s1 - s0) / (t1 - t0)

    def _on_report(self, now: float, opened: bool) -> None:
        """Called under the lock after each report; ``opened``: this report opened the window."""

    def advance(self, steps: float, between: Callable[[], None] | None = None) -> None:
        self.report(steps)  # a real GPU did the work itself; advancing only counts it (nothing to interrupt)

    def set_partners(self, partners: tuple[str, ...]) -> None:
        with self._lock:
            if tuple(partners) != self._partners:  # a rate from now on is the new company's
                self._since = (self._clock(), self._steps)
            self._partners = tuple(partners)

    @property
    def partners(self) -> tuple[str, ...]:
        return self._partners

    @property
    def steps(self) -> float:
        return self._steps

    def window(self) -> StepWindow | None:
        """The steady-state window so far, or ``None`` while the warm-up is not done."""
        with self._lock:
            if self._window_start is None or self._last_report is None:
                return None
            return StepWindow(*self._window_start, *self._last_report)

    def _timing(self, t0: float, t1: float) -> tuple[StepWindow | None, dict[str, Any]]:
        """The steady window (``None`` when there is none) and the reading's timing fields for a
        run from ``t0`` to ``t1``: the window's when there is one, the whole run's otherwise."""
        win = self.window()
        if win is not None and win.steady:
            return win, {"window": "steady", "duration_s": win.duration_s, "window_steps": win.steps,
                         "throughput": win.steps / win.duration_s, "startup_s": win.start_t - t0}
        wall = t1 - t0
        return None, {"window": "whole_run", "duration_s": wall, "window_steps": self._steps,
                      "throughput": self._steps / wall if wall > 0 else 0.0}


class WallClockMeter(StepCounter):
    """Steps over wall time, and nothing else: a GPU whose board cannot be read.

    A remote worker without NVML still ran the body on a real GPU, so its throughput is
    real; what it drew is unknown, and is left ``None`` rather than made up.
    """

    source = "wallclock"

    def __init__(self, clock: Callable[[], float] | None = None, *,
                 warmup_steps: float = DEFAULT_WARMUP_STEPS) -> None:
        super().__init__(clock=clock, warmup_steps=warmup_steps)
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = self._clock()

    def stop(self) -> TelemetryReading:
        if self._t0 is None:
            raise RuntimeError("WallClockMeter.stop() called before start()")
        t1 = self._clock()
        _, timing = self._timing(self._t0, t1)
        return TelemetryReading(source="wallclock", steps=self._steps, mean_power_w=None, energy_j=None,
                                max_memory_bytes=None, mean_utilisation=None, wall_s=t1 - self._t0, **timing)


# The sampler lives in nvml.py (it needs pynvml, imported lazily); it is
# re-exported here because this is where users look for telemetry.
def __getattr__(name: str):
    if name == "NvmlSampler":
        from gogh_flows.runtime.nvml import NvmlSampler

        return NvmlSampler
    raise AttributeError(name)


_warn_lock = threading.Lock()
_warned = False


def nvml_fallback_warned() -> bool:
    """Whether this process already warned that NVML is unavailable."""
    return _warned


def _warn_fallback(reason: str) -> None:
    # One warning per process: a fleet of runs on a driverless host would
    # otherwise repeat the same line for every run.
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    log.warning("NVML unavailable (%s): runs on this GPU are timed by the wall clock; their power "
                "and energy are not measured (install nvidia-ml-py and the NVIDIA driver to measure "
                "them)%s", reason, _no_cuda_note())


def _no_cuda_note() -> str:
    """A worker declared as a GPU on a host where PyTorch sees none: a body that puts its tensors
    on ``current_placement().device`` (``cuda:0``) will fail, and one that does not is measured
    on the CPU as if on the GPU. Said with the NVML warning, once, rather than hidden by a
    ``cpu`` device that would make such measurements look valid."""
    try:  # a note on a warning: a torch that cannot load (broken CUDA libraries) must not fail the run
        import torch

        if torch.cuda.is_available():
            return ""
    except Exception:  # noqa: BLE001
        return ""
    return ("; PyTorch sees no CUDA device in this process either: bodies using current_placement().device "
            "('cuda:0') will fail, and what runs here is measured on the CPU under this GPU's name. Run GPU "
            "workers where CUDA is visible (CUDA_VISIBLE_DEVICES), or use GpuCluster(mode='emulated') to try "
            "the pool without GPUs")


def telemetry_for(
    device: GpuDevice,
    mode: str,
    *,
    job_type: str | None = None,
    truth: ThroughputTable | None = None,
    time_scale: float = 0.0,
    energy: EnergyModel | None = None,
    interval_s: float = 0.1,
    partners: Callable[[], Sequence[str]] | None = None,
    warmup_steps: float = DEFAULT_WARMUP_STEPS,
    power_w: float | None = None,
) -> Meter:
    """The meter for one run on ``device``: NVML unless the mode is ``"emulated"``.

    When NVML cannot be used (no ``pynvml``, no driver, device not found) the body
    still ran on a real GPU, so it is timed by the wall clock (``source="wallclock"``,
    no energy) after one warning per process: an emulated figure would replace a real
    throughput with a made-up one, and needs a truth table the worker may not have.
    ``partners`` (emulated only) overrides the tracked co-located job types, for
    partners the pool does not run itself. ``warmup_steps`` opens the steady-state window;
    ``power_w`` is the run's predicted board power alone, used to split a shared board's
    energy until the run's own power alone has been measured.
    """
    from gogh_flows.runtime.emulation import EmulatedMeter

    def emulated() -> Meter:
        return EmulatedMeter(device, job_type=job_type, truth=truth, time_scale=time_scale, energy=energy,
                             partners=partners, warmup_steps=warmup_steps)

    if mode == "emulated":
        return emulated()
    from gogh_flows.runtime.nvml import NvmlSampler, NvmlUnavailable, probe

    try:
        probe(device)
    except NvmlUnavailable as exc:
        _warn_fallback(str(exc))
        return WallClockMeter(warmup_steps=warmup_steps)
    return NvmlSampler(device, interval_s=interval_s, warmup_steps=warmup_steps, power_w=power_w, energy=energy)

"""What a run measured: throughput, power, energy, memory, utilisation.

Two sources produce the same :class:`TelemetryReading`, so everything
downstream (MLflow logging, the retraining data) never asks where a number came
from, only ``reading.source``:

* ``"nvml"``: a background thread samples the board through NVML (power,
  utilisation, memory) and energy comes from the board's energy counter when it
  has one (Volta and newer), otherwise from integrating the sampled power.
* ``"emulated"``: the truth table and the energy model say what the run would
  have drawn (see :mod:`gogh_flows.runtime.emulation`).

NVML readings are *device* figures: when two runs share a GPU, both see the
board's whole power. ``attributed_energy_j`` is the run's own share where it can
be known (alone all along, or emulated); it is ``None`` otherwise rather than a
guess.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from gogh_flows.energy import EnergyModel
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.truth.table import ThroughputTable

__all__ = [
    "Meter",
    "StepCounter",
    "WallClockMeter",
    "NvmlSampler",
    "TelemetryReading",
    "nvml_fallback_warned",
    "telemetry_for",
]

log = logging.getLogger("gogh_flows.runtime")


@dataclass(frozen=True)
class TelemetryReading:
    """One run's measurements.

    ``duration_s`` is emulated seconds for emulated runs that called
    ``advance()``, wall seconds otherwise (``wall_s`` is always wall time).
    ``throughput`` is ``steps / duration_s`` (0 when nothing was reported).
    ``mean_power_w`` and ``energy_j`` are the device's (both occupants' when
    shared); ``mean_utilisation`` is a fraction in [0, 1]; ``energy_method`` is
    ``"counter"`` (NVML energy counter), ``"integrated"`` (sampled power) or
    ``"model"`` (energy model, emulated).
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

    def as_metrics(self) -> dict[str, float]:
        """The numeric fields that are set, flat, for a metrics logger."""
        out: dict[str, float] = {}
        for name in ("duration_s", "steps", "throughput", "mean_power_w", "energy_j", "max_memory_bytes",
                     "mean_utilisation", "wall_s", "attributed_energy_j"):
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

    def advance(self, steps: float) -> None: ...

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
    """The part every meter shares: the body's progress count and who shares the GPU.

    ``report`` may be called from the body's threads while the worker's occupancy
    tracking calls ``set_partners`` from others, so both go through ``_lock``.
    """

    def __init__(self, lock: threading.Lock | threading.RLock | None = None) -> None:
        self._lock = lock or threading.Lock()
        self._steps = 0.0
        self._partners: tuple[str, ...] = ()

    def report(self, steps: float = 1.0) -> None:
        with self._lock:
            self._steps += float(steps)

    def advance(self, steps: float) -> None:
        self.report(steps)  # a real GPU did the work itself; advancing only counts it

    def set_partners(self, partners: tuple[str, ...]) -> None:
        with self._lock:
            self._partners = tuple(partners)

    @property
    def partners(self) -> tuple[str, ...]:
        return self._partners

    @property
    def steps(self) -> float:
        return self._steps


class WallClockMeter(StepCounter):
    """Steps over wall time, and nothing else: a GPU whose board cannot be read.

    A remote worker without NVML still ran the body on a real GPU, so its throughput is
    real; what it drew is unknown, and is left ``None`` rather than made up.
    """

    source = "wallclock"

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        super().__init__()
        self._clock = clock or time.monotonic
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = self._clock()

    def stop(self) -> TelemetryReading:
        if self._t0 is None:
            raise RuntimeError("WallClockMeter.stop() called before start()")
        wall = self._clock() - self._t0
        return TelemetryReading(source="wallclock", duration_s=wall, steps=self._steps,
                                throughput=self._steps / wall if wall > 0 else 0.0, mean_power_w=None,
                                energy_j=None, max_memory_bytes=None, mean_utilisation=None, wall_s=wall)


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
                "them)", reason)


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
) -> Meter:
    """The meter for one run on ``device``: NVML unless the mode is ``"emulated"``.

    When NVML cannot be used (no ``pynvml``, no driver, device not found) the body
    still ran on a real GPU, so it is timed by the wall clock (``source="wallclock"``,
    no energy) after one warning per process: an emulated figure would replace a real
    throughput with a made-up one, and needs a truth table the worker may not have.
    ``partners`` (emulated only) overrides the tracked co-located job types, for
    partners the pool does not run itself.
    """
    from gogh_flows.runtime.emulation import EmulatedMeter

    def emulated() -> Meter:
        return EmulatedMeter(device, job_type=job_type, truth=truth, time_scale=time_scale, energy=energy,
                             partners=partners)

    if mode == "emulated":
        return emulated()
    from gogh_flows.runtime.nvml import NvmlSampler, NvmlUnavailable, probe

    try:
        probe(device)
    except NvmlUnavailable as exc:
        _warn_fallback(str(exc))
        return WallClockMeter()
    return NvmlSampler(device, interval_s=interval_s)

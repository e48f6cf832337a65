"""NVML access: finding the boards, and sampling one while a run executes.

``pynvml`` (package ``nvidia-ml-py``) is imported only when a function here is
called, so the package imports on machines without a driver. Every NVML
failure is turned into :class:`NvmlUnavailable` with the reason, because the
callers' answer is always the same: fall back, and say why.

NVML enumerates *all* boards whatever ``CUDA_VISIBLE_DEVICES`` says, so a board
is found by its UUID or physical index, never by the CUDA ordinal a process sees.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.telemetry import StepCounter, TelemetryReading

__all__ = ["NvmlBoard", "NvmlSampler", "NvmlUnavailable", "discover", "load_pynvml", "probe"]


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (module, driver or device missing)."""


def load_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"the pynvml module is not installed ({exc}); install nvidia-ml-py") from exc


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class NvmlBoard:
    """A board as NVML reports it."""

    index: int
    name: str
    uuid: str


def discover(nvml: ModuleType | None = None) -> list[NvmlBoard]:
    """Every board NVML sees, restricted to ``CUDA_VISIBLE_DEVICES`` when that is set."""
    nvml = nvml or load_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses; the fake and real modules differ in detail
        raise NvmlUnavailable(f"nvmlInit failed: {type(exc).__name__}: {exc}") from exc
    try:
        boards = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            boards.append(NvmlBoard(i, _text(nvml.nvmlDeviceGetName(h)), _text(nvml.nvmlDeviceGetUUID(h))))
    except Exception as exc:
        raise NvmlUnavailable(f"listing devices failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _shutdown(nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        boards = [b for b in boards if str(b.index) in wanted or b.uuid in wanted]
    return boards


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - shutting down is best effort
        pass


def _handle(nvml: ModuleType, device: GpuDevice | None) -> Any:
    if device is not None and device.uuid:
        return nvml.nvmlDeviceGetHandleByUUID(device.uuid)
    if device is not None and device.cuda_index is not None:
        return nvml.nvmlDeviceGetHandleByIndex(device.cuda_index)
    # A worker pinned with CUDA_VISIBLE_DEVICES sees its board first in that list.
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(first)
    return nvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)


def probe(device: GpuDevice | None, nvml: ModuleType | None = None) -> None:
    """Raise :class:`NvmlUnavailable` unless ``device`` can be sampled through NVML."""
    nvml = nvml or load_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise NvmlUnavailable(f"nvmlInit failed: {type(exc).__name__}: {exc}") from exc
    try:
        _handle(nvml, device)
    except Exception as exc:
        raise NvmlUnavailable(f"no NVML handle for {device.id if device else 'the visible GPU'}: "
                              f"{type(exc).__name__}: {exc}") from exc
    finally:
        _shutdown(nvml)


class NvmlSampler(StepCounter):
    """Samples one board in a background thread between :meth:`start` and :meth:`stop`.

    Power (``nvmlDeviceGetPowerUsage``, mW) is sampled every ``interval_s`` plus
    once at start and at stop, so even a short run has a bracket to integrate.
    Energy comes from ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the
    driver loaded; Volta and newer) when the board has it and it advanced;
    otherwise from the trapezoid integral of the power samples. Metrics the
    board does not support are left ``None``.
    """

    source = "nvml"

    def __init__(self, device: GpuDevice | None = None, *, interval_s: float = 0.1,
                 nvml: ModuleType | None = None, clock=time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.device = device
        self.interval_s = interval_s
        self._nvml = nvml
        super().__init__()
        self._clock = clock
        self._shared = False
        self._power: list[tuple[float, float]] = []  # (t, W)
        self._util: list[float] = []
        self._max_mem: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy0_mj: float | None = None
        self._t0 = 0.0

    # -- partners: the board's figures are the run's own only if it was never shared --
    def set_partners(self, partners: tuple[str, ...]) -> None:
        super().set_partners(partners)  # takes the (non-reentrant) lock itself
        with self._lock:
            self._shared = self._shared or bool(partners)

    # -- sampling ------------------------------------------------------------------
    def start(self) -> None:
        nvml = self._nvml = self._nvml or load_pynvml()
        nvml.nvmlInit()
        self._h = _handle(nvml, self.device)
        self._t0 = self._clock()
        self._energy0_mj = self._energy_mj()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="gogh-nvml-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _energy_mj(self) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._h))
        except Exception:  # NotSupported before Volta, or on some boards
            return None

    def _sample(self) -> None:
        nvml, h, t = self._nvml, self._h, self._clock()
        try:
            watts = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except Exception:
            watts = None
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        except Exception:
            util = None
        try:
            used = int(nvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            used = None
        with self._lock:
            if watts is not None:
                self._power.append((t, watts))
            if util is not None:
                self._util.append(util)
            if used is not None:
                self._max_mem = used if self._max_mem is None else max(self._max_mem, used)

    def stop(self) -> TelemetryReading:
        if self._thread is None:
            raise RuntimeError("NvmlSampler.stop() called before start()")
        self._stop.set()
        self._thread.join()
        self._sample()
        t1 = self._clock()
        energy1 = self._energy_mj()
        _shutdown(self._nvml)
        duration = max(t1 - self._t0, 0.0)
        with self._lock:
            power, steps = list(self._power), self._steps
        integrated = sum((p0 + p1) / 2 * (t1_ - t0_) for (t0_, p0), (t1_, p1) in zip(power, power[1:]))
        if len(power) == 1:
            integrated = power[0][1] * duration
        energy: float | None
        if self._energy0_mj is not None and energy1 is not None and energy1 > self._energy0_mj:
            energy, method = (energy1 - self._energy0_mj) / 1000.0, "counter"
        elif power:
            energy, method = integrated, "integrated"
        else:
            energy, method = None, None
        if power and duration > 0 and len(power) > 1:
            mean_power = integrated / (power[-1][0] - power[0][0]) if power[-1][0] > power[0][0] else power[0][1]
        elif power:
            mean_power = sum(p for _, p in power) / len(power)
        else:
            mean_power = None
        return TelemetryReading(
            source="nvml",
            duration_s=duration,
            steps=steps,
            throughput=steps / duration if duration > 0 else 0.0,
            mean_power_w=mean_power,
            energy_j=energy,
            max_memory_bytes=self._max_mem,
            mean_utilisation=sum(self._util) / len(self._util) if self._util else None,
            wall_s=duration,
            attributed_energy_j=None if self._shared else energy,
            energy_method=method,
            samples=len(power),
        )

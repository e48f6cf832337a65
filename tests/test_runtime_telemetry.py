"""NVML telemetry against a fake ``pynvml`` module, and the fallback to emulation."""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Callable

import pytest

from gogh_flows.runtime import GpuDevice, telemetry_for
from gogh_flows.runtime import telemetry as telemetry_mod
from gogh_flows.runtime.emulation import EmulatedMeter
from gogh_flows.runtime.telemetry import WallClockMeter
from gogh_flows.runtime.nvml import NvmlSampler, NvmlUnavailable, discover, probe


def fake_pynvml(*, names=("Tesla V100-SXM2-16GB",), power_w: Callable[[float], float] | float = 150.0,
                energy_j: Callable[[float], float] | None = None, init_error: str | None = None,
                clock: Callable[[], float] = time.monotonic, util: int = 75,
                mem_used: int = 2 * 2**30) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's ``pynvml`` with the calls the runtime makes.

    ``power_w(t)`` is the board power at clock time ``t``; ``energy_j(t)`` the
    energy counter (``None``: the board has no counter, NVML says NotSupported).
    """
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    for sub in ("NVMLError_LibraryNotFound", "NVMLError_NotSupported", "NVMLError_NotFound",
                "NVMLError_DriverNotLoaded"):
        setattr(m, sub, type(sub, (NVMLError,), {}))
    m.NVMLError = NVMLError
    m.live = 0
    power = power_w if callable(power_w) else (lambda t: power_w)
    if energy_j is None and not callable(power_w):
        energy_j = lambda t: power_w * t  # noqa: E731 - constant power: counter = P * t

    def init():
        if init_error:
            raise getattr(m, init_error)(f"fake {init_error}")
        m.live += 1

    def shutdown():
        m.live -= 1

    def by_index(i):
        if not 0 <= i < len(names):
            raise m.NVMLError_NotFound(f"no device {i}")
        return ("handle", i)

    def by_uuid(u):
        return by_index(int(u.removeprefix("GPU-")))

    def energy(h):
        if energy_j is None:
            raise m.NVMLError_NotSupported("no energy counter before Volta")
        return int(round(energy_j(clock()) * 1000))

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex, m.nvmlDeviceGetHandleByUUID = by_index, by_uuid
    m.nvmlDeviceGetName = lambda h: names[h[1]].encode()  # old pynvml returns bytes
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1]}"
    m.nvmlDeviceGetPowerUsage = lambda h: int(round(power(clock()) * 1000))
    m.nvmlDeviceGetTotalEnergyConsumption = energy
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=10)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=mem_used, total=16 * 2**30)
    return m


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


V100 = GpuDevice("v100-0", "v100", "v100-0", cuda_index=0)


def test_sampler_uses_the_energy_counter_when_the_board_has_one():
    clock = FakeClock()
    nvml = fake_pynvml(power_w=150.0, clock=clock)
    sampler = NvmlSampler(V100, interval_s=0.005, nvml=nvml, clock=clock)
    sampler.start()
    sampler.report(40)
    time.sleep(0.03)  # let the background thread take a few samples
    clock.t = 10.0
    sampler.report(10)
    reading = sampler.stop()
    assert reading.source == "nvml" and reading.energy_method == "counter"
    assert reading.duration_s == 10.0 and reading.steps == 50 and reading.throughput == 5.0
    assert reading.energy_j == pytest.approx(1500.0)
    assert reading.mean_power_w == pytest.approx(150.0)
    assert reading.attributed_energy_j == pytest.approx(1500.0)  # alone all along
    assert reading.mean_utilisation == pytest.approx(0.75) and reading.max_memory_bytes == 2 * 2**30
    assert reading.samples >= 2 and nvml.live == 0  # every nvmlInit was shut down


def test_sampler_integrates_power_when_there_is_no_counter():
    clock = FakeClock()
    nvml = fake_pynvml(names=["Tesla K80"], power_w=lambda t: 100.0 + 10.0 * t, clock=clock)
    sampler = NvmlSampler(GpuDevice("k80-0", "k80", "k80-0", uuid="GPU-0"), interval_s=0.005,
                          nvml=nvml, clock=clock)
    sampler.start()
    for t in (2.5, 5.0, 7.5):  # samples at arbitrary times: the trapezoid is exact for linear power
        clock.t = t
        time.sleep(0.02)
    clock.t = 10.0
    sampler.set_partners(("b",))  # shared at some point: no per-run attribution from NVML
    reading = sampler.stop()
    # integral of 100 + 10 t over [0, 10] = 1000 + 500 J
    assert reading.energy_method == "integrated"
    assert reading.energy_j == pytest.approx(1500.0)
    assert reading.mean_power_w == pytest.approx(150.0)
    assert reading.attributed_energy_j is None


def test_sampler_leaves_unsupported_metrics_empty():
    nvml = fake_pynvml(power_w=80.0)

    def unsupported(h):
        raise nvml.NVMLError_NotSupported("not on this board")

    nvml.nvmlDeviceGetUtilizationRates = nvml.nvmlDeviceGetMemoryInfo = unsupported
    sampler = NvmlSampler(V100, interval_s=0.01, nvml=nvml)
    sampler.start()
    reading = sampler.stop()
    assert reading.mean_utilisation is None and reading.max_memory_bytes is None
    assert reading.mean_power_w == pytest.approx(80.0)


def test_sampler_refuses_bad_use():
    with pytest.raises(ValueError, match="interval_s"):
        NvmlSampler(V100, interval_s=0)
    with pytest.raises(RuntimeError, match="before start"):
        NvmlSampler(V100).stop()


def test_discover_and_probe(monkeypatch):
    nvml = fake_pynvml(names=["Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA A100-SXM4-80GB"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [b.name for b in discover(nvml)] == ["Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA A100-SXM4-80GB"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0")
    assert [(b.index, b.uuid) for b in discover(nvml)] == [(0, "GPU-0"), (2, "GPU-2")]
    probe(GpuDevice("t4-0", "t4", "w", cuda_index=1), nvml)
    with pytest.raises(NvmlUnavailable, match="no NVML handle for t4-9"):
        probe(GpuDevice("t4-9", "t4", "w", cuda_index=9), nvml)
    assert nvml.live == 0


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(telemetry_mod, "_warned", False)


def test_nvml_init_error_warns_once_and_falls_back(monkeypatch, caplog, fresh_warning):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="NVMLError_LibraryNotFound"))
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"):
        meters = [telemetry_for(V100, "local-cuda", job_type="a") for _ in range(3)]
    assert all(isinstance(m, WallClockMeter) for m in meters)
    warnings = [r.getMessage() for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert "NVMLError_LibraryNotFound" in warnings[0]
    assert "timed by the wall clock" in warnings[0] and "energy are not measured" in warnings[0]


def test_missing_pynvml_module_falls_back(monkeypatch, caplog, fresh_warning):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"):
        meter = telemetry_for(V100, "remote")
    assert meter.source == "wallclock"
    assert "install nvidia-ml-py" in caplog.text


def test_working_nvml_gives_a_sampler_and_emulated_mode_never_touches_it(monkeypatch, fresh_warning):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert isinstance(telemetry_for(V100, "local-cuda"), NvmlSampler)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert isinstance(telemetry_for(V100, "emulated"), EmulatedMeter)
    assert not telemetry_mod.nvml_fallback_warned()

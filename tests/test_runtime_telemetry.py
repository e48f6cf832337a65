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

    class Handle:  # like pynvml's: a new object on every lookup, its repr naming its address
        def __init__(self, i: int) -> None:
            self.i = i

        def __getitem__(self, k: int):
            return ("handle", self.i)[k]

    def by_index(i):
        if not 0 <= i < len(names):
            raise m.NVMLError_NotFound(f"no device {i}")
        return Handle(i)

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
    m.nvmlDeviceGetPowerManagementLimit = lambda h: 700_000  # mW, read only: never set in tests
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
    clock.t = 2.0
    sampler.report(40)  # the warm-up (5 steps) is done: the steady window opens here
    time.sleep(0.03)  # let the background thread take a few samples
    clock.t = 12.0
    sampler.report(10)
    reading = sampler.stop()
    assert reading.source == "nvml" and reading.energy_method == "counter"
    assert reading.window == "steady" and reading.duration_s == 10.0 and reading.window_steps == 10
    assert reading.steps == 50 and reading.throughput == 1.0
    assert reading.energy_j == pytest.approx(1500.0)
    assert reading.startup_s == 2.0 and reading.startup_energy_j == pytest.approx(300.0)
    assert reading.run_energy_j == pytest.approx(1800.0) and reading.wall_s == 12.0
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
    # a partner the worker knows of but that is not measured on this board (another process's
    # job) cannot take a share: the run is the board's only measured occupant
    sampler.set_partners(("b",))
    reading = sampler.stop()
    # integral of 100 + 10 t over [0, 10] = 1000 + 500 J; no report: the whole run, marked so
    assert reading.energy_method == "integrated" and reading.window == "whole_run"
    assert reading.energy_j == pytest.approx(1500.0)
    assert reading.mean_power_w == pytest.approx(150.0)
    assert reading.attributed_energy_j == pytest.approx(1500.0) and reading.energy_split == "alone"


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


def test_a_gpu_worker_where_pytorch_sees_no_gpu_says_so(monkeypatch, caplog, fresh_warning):
    """A remote worker on a host without CUDA gave bodies device 'cuda:0' without a word beyond the
    NVML fallback: the warning now says that bodies using it will fail and what runs is measured on
    the CPU under the GPU's name."""
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"):
        telemetry_for(V100, "remote")
    assert "PyTorch sees no CUDA device" in caplog.text and "mode='emulated'" in caplog.text
    caplog.clear()
    monkeypatch.setattr(telemetry_mod, "_warned", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="gogh_flows.runtime"):
        telemetry_for(V100, "remote")
    assert "NVML unavailable" in caplog.text and "PyTorch sees no CUDA" not in caplog.text


def test_working_nvml_gives_a_sampler_and_emulated_mode_never_touches_it(monkeypatch, fresh_warning):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert isinstance(telemetry_for(V100, "local-cuda"), NvmlSampler)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert isinstance(telemetry_for(V100, "emulated"), EmulatedMeter)
    assert not telemetry_mod.nvml_fallback_warned()


# -- replays of what a real H100 showed (issue: start-up counted, shared energy doubled) ------
def _replay_clock_and_board(power: Callable[[float], float], energy: Callable[[float], float]):
    clock = FakeClock()
    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=power, energy_j=energy, clock=clock)
    return clock, nvml


def _step_to(clock: FakeClock, sampler: NvmlSampler, t: float) -> None:
    clock.t = t
    sampler.board.sample()  # what the board's thread does every interval


def test_first_run_replay_logs_steady_throughput_and_startup_apart():
    # a fresh worker: 18 s building the model, the CUDA context and cuDNN's autotuning at 150 W,
    # then 293 steps in 12 s (24.4 steps/s by the body's own clock) at 487 W
    power = lambda t: 150.0 if t < 18.0 else 487.0  # noqa: E731
    energy = lambda t: 150.0 * min(t, 18.0) + 487.0 * max(0.0, t - 18.0)  # noqa: E731
    clock, nvml = _replay_clock_and_board(power, energy)
    sampler = NvmlSampler(GpuDevice("h100-0", "h100", "h100-0", cuda_index=0), interval_s=3600, nvml=nvml,
                          clock=clock)
    sampler.start()
    for i in range(1, 37):
        _step_to(clock, sampler, i * 0.5)  # start-up, sampled twice a second
    steps = 293
    for k in range(1, steps + 1):
        clock.t = 18.0 + 12.0 * k / steps
        sampler.report()
        if k % 12 == 0:
            sampler.board.sample()
    clock.t = 30.5  # the body returns a little after its last step
    reading = sampler.stop()
    body_rate = (steps - 5) / (12.0 * (steps - 5) / steps)  # the steps after the warm-up, by its own clock
    assert reading.window == "steady"
    assert reading.throughput == pytest.approx(body_rate, rel=0.05)
    assert reading.throughput == pytest.approx(24.4, rel=0.05)
    assert steps / reading.wall_s < 10  # what the old rule logged: 2.5x too low
    assert reading.startup_s == pytest.approx(18.0 + 12.0 * 5 / steps)
    assert reading.startup_energy_j == pytest.approx(energy(reading.startup_s), rel=1e-6)
    assert reading.attributed_energy_j == pytest.approx(487.0 * reading.duration_s, rel=1e-6)
    assert reading.mean_power_w == pytest.approx(487.0, rel=1e-6)
    assert reading.run_energy_j == pytest.approx(energy(30.5), rel=1e-6)  # nothing lost: tail included
    assert reading.steps == steps and reading.power_limit_w == 700.0


def test_overlapping_runs_split_the_board_energy_never_doubling_it():
    # run A alone 0-5 s (300 W), B joins 5-17 s (board 507 W), A alone again 17-20 s
    def power(t: float) -> float:
        return 507.0 if 5.0 <= t < 17.0 else (300.0 if t < 20.0 else 71.0)

    def energy(t: float) -> float:
        return 300.0 * min(t, 5.0) + 507.0 * max(0.0, min(t, 17.0) - 5.0) + 300.0 * max(0.0, min(t, 20.0) - 17.0)

    clock, nvml = _replay_clock_and_board(power, energy)
    h100 = GpuDevice("h100-0", "h100", "h100-0", cuda_index=0)
    a = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, power_w=300.0, warmup_steps=0)
    b = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, power_w=250.0, warmup_steps=0)
    a.start()
    assert a.board.runs == 1
    t = 0.0
    while t < 20.0 - 1e-9:
        t = round(t + 0.25, 6)
        clock.t = t
        if t == 5.0:
            b.start()
            assert b.board is a.board  # one sampler per board, whoever runs on it
        if t == 17.0:
            rb = b.stop()
        a.report()
        if 5.0 < t < 17.0:
            b.report()
        a.board.sample()
    ra = a.stop()
    board_total = energy(20.0)
    assert ra.run_energy_j + rb.run_energy_j == pytest.approx(board_total, rel=0.01)
    assert ra.board_run_energy_j == pytest.approx(board_total, rel=1e-6)
    shared = 507.0 * 12.0
    assert rb.board_run_energy_j == pytest.approx(shared, rel=1e-6)  # the board's, kept apart
    assert rb.run_energy_j < 0.6 * shared  # no run carries the whole board's energy of a shared stretch
    # A was measured alone (300 W); B had only the model (250 W), scaled by the model's error on A (1.0)
    assert rb.run_energy_j == pytest.approx(shared * 250.0 / 550.0, rel=0.02)
    assert "measured" not in rb.energy_split and "model" in rb.energy_split and "alone" in ra.energy_split


def test_two_runs_started_together_share_one_sampler_across_threads():
    import threading

    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=400.0)
    h100 = GpuDevice("h100-0", "h100", "h100-0", cuda_index=0)
    readings: list = []
    spans: list[tuple[float, float]] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        m = NvmlSampler(h100, interval_s=0.002, nvml=nvml)
        barrier.wait()
        t0 = time.perf_counter()
        m.start()
        for _ in range(20):
            m.report()
            time.sleep(0.002)
        readings.append(m.stop())
        spans.append((t0, time.perf_counter()))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first, last = min(r.wall_s for r in readings), max(r.wall_s for r in readings)
    assert len(readings) == 4 and first > 0 and last > 0
    # every share is part of one board's energy; the board's energy over the union of the runs
    # (first start to last stop: on a loaded machine the threads start apart) is at most 400 W
    # times that union, so the shares cannot add up to 4x it
    union = max(b for _, b in spans) - min(a for a, _ in spans)
    total = sum(r.run_energy_j for r in readings)
    assert total <= 400.0 * union * 1.05
    assert nvml.live == 0


def test_a_board_without_power_readings_still_splits_its_counter_energy():
    # MIG handles and some boards answer no power: the counter alone must still be split, never
    # divided by a zero weight
    clock = FakeClock()
    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=0.0, energy_j=lambda t: 300.0 * t, clock=clock)

    def no_power(h):
        raise nvml.NVMLError_NotSupported("no power readings here")

    nvml.nvmlDeviceGetPowerUsage = no_power
    h100 = GpuDevice("h100-0", "h100", "h100-0", cuda_index=0)
    a = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, warmup_steps=0)
    b = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, warmup_steps=0)
    a.start()
    for t in range(1, 11):
        clock.t = float(t)
        if t == 3:
            b.start()
        a.report()
        b.report() if t > 3 else None
        a.board.sample()
    rb = b.stop()
    ra = a.stop()
    assert ra.run_energy_j + rb.run_energy_j == pytest.approx(3000.0)
    assert ra.energy_method == "counter" and ra.mean_power_w is None
    assert rb.energy_split == "equal"  # no power alone measured, no prediction given


def test_a_failed_counter_read_loses_no_energy_and_keeps_the_shares_whole():
    clock = FakeClock()
    fail_at = {4.0}

    def energy(t: float) -> float:
        if t in fail_at:
            raise RuntimeError("transient NVML error")
        return 400.0 * t

    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=lambda t: 400.0, energy_j=energy, clock=clock)
    h100 = GpuDevice("h100-0", "h100", "h100-0", cuda_index=0)
    a = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, power_w=300.0, warmup_steps=0)
    b = NvmlSampler(h100, interval_s=3600, nvml=nvml, clock=clock, power_w=100.0, warmup_steps=0)
    a.start()
    b.start()
    for t in range(1, 9):
        clock.t = float(t)
        a.report()
        b.report()
        a.board.sample()
    ra, rb = a.stop(), b.stop()
    # the counter's reading after the gap covers it: 8 s x 400 W, split 3:1 by the model
    assert ra.run_energy_j + rb.run_energy_j == pytest.approx(3200.0)
    assert ra.run_energy_j == pytest.approx(2400.0) and ra.energy_method == "counter+integrated"


def test_a_body_reporting_nan_or_a_negative_count_is_told_at_once():
    """report(nan) once lost the run's whole record (its row refused the count); report(-3) was kept."""
    from gogh_flows.runtime.telemetry import WallClockMeter

    meter = WallClockMeter()
    meter.start()
    meter.report(10)
    for bad in (float("nan"), -3, float("inf"), "ten"):
        with pytest.raises(ValueError, match="report\\(\\) takes the number of steps .* >= 0"):
            meter.report(bad)
    assert meter.stop().steps == 10


def test_advanced_and_reported_steps_on_the_emulated_fleet_keep_the_true_rate(caplog):
    """A body that advance()d 50 steps and report()ed 50 logged twice the truth's rate, and was learned."""
    from gogh_flows.runtime import current_gpu, emulated_pool

    def body():
        current_gpu().advance(50)
        current_gpu().report(50)

    job = "ResNet-50 (batch size 64)"
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"), emulated_pool("t4=1") as pool:
        outcome = pool.run(body, gpu_id="t4-0", job_type=job)
        truth_rate = pool.run(lambda: current_gpu().advance(100), gpu_id="t4-0", job_type=job).telemetry.throughput
        # under a lowered limit, the slowdown the refiner undoes is the advanced steps' alone too
        capped = pool.run(body, gpu_id="t4-0", job_type=job, power_limit_w=60.0).telemetry
        alone = pool.run(lambda: current_gpu().advance(100), gpu_id="t4-0", job_type=job,
                         power_limit_w=60.0).telemetry
    t = outcome.telemetry
    assert t.steps == 100 and t.window_steps == 50
    assert t.throughput == pytest.approx(truth_rate)
    assert "both advance()d (50 steps, emulated) and report()ed (50 steps)" in caplog.text
    assert alone.limit_slowdown > 1 and capped.limit_slowdown == pytest.approx(alone.limit_slowdown)


def test_reports_in_a_burst_are_measured_over_the_whole_run():
    """A body that worked 2 s and then reported its ten steps in a row was logged at 98,000
    steps/s, over a window of microseconds (a Prefect review): such a window is no window."""
    clock = iter([0.0, 2.0, 2.00001, 2.00002, 2.00003, 2.00004, 2.00005, 2.00006, 2.00007, 2.00008, 2.00009,
                  2.0001, 2.0001])
    meter = WallClockMeter(clock=lambda: next(clock), warmup_steps=5)
    meter.start()
    for _ in range(10):
        meter.report(1)
    reading = meter.stop()
    assert reading.window == "whole_run" and reading.throughput == pytest.approx(10 / 2.0001)
    # reports 10 ms apart and more are a window
    t = iter([0.0] + [1.0 + 0.01 * i for i in range(11)] + [1.1])
    steady = WallClockMeter(clock=lambda: next(t), warmup_steps=5)
    steady.start()
    for _ in range(10):
        steady.report(1)
    reading = steady.stop()
    assert reading.window == "steady" and reading.throughput == pytest.approx(100.0)

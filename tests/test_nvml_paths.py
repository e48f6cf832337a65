"""Real-GPU paths with a fake NVML: which board a worker is, readings that stop, limits put back.

A GPU machine is not lent to every session, so these paths are exercised here through
stand-ins for ``pynvml`` and ``dask_cuda`` that keep the real modules' shapes (what a
reviewer reading the code for a mixed H100 + L4 machine found, 2026-12-07).
"""

from __future__ import annotations

import sys
import types

import pytest
from test_power_cap import W, fake_nvml, never_the_real_setter  # noqa: F401 - fixture
from test_runtime import FakeLocalCUDACluster
from test_runtime_telemetry import FakeClock, fake_pynvml

from gogh_flows.runtime import power_cap as pc
from gogh_flows.runtime import run_limits as rl
from gogh_flows.runtime import worker as worker_mod
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.nvml import NvmlSampler, NvmlUnavailable, discover, resolve_cuda_entry
from gogh_flows.runtime.pool import _remote_device


def _with_pci(nvml: types.ModuleType, buses: list[str]) -> types.ModuleType:
    """NVML index i sits on PCI bus ``buses[i]`` (NVML's numbering need not follow the bus)."""
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=buses[h[1]].encode())
    return nvml


# -- which board ---------------------------------------------------------------------------------
class RecordingCUDACluster(FakeLocalCUDACluster):
    asked: list = []

    def __init__(self, *, CUDA_VISIBLE_DEVICES, **kwargs):
        RecordingCUDACluster.asked.append(list(CUDA_VISIBLE_DEVICES))
        super().__init__(CUDA_VISIBLE_DEVICES=CUDA_VISIBLE_DEVICES, **kwargs)


def test_a_local_cuda_pool_gives_dask_cuda_its_boards_by_uuid_not_by_nvml_index(monkeypatch):
    """CUDA reads an index in its own order (FASTEST_FIRST by default), not NVML's: on a mixed
    machine the worker named for the L4 would compute on the H100 while NVML measured the L4."""
    from gogh_flows.runtime.pool import local_cuda_pool

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(names=["NVIDIA L4", "NVIDIA H100 80GB HBM3"]))
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=RecordingCUDACluster))
    RecordingCUDACluster.asked.clear()
    with local_cuda_pool(capacity=1) as pool:
        assert RecordingCUDACluster.asked == [["GPU-0", "GPU-1"]]
        assert {d.id: d.uuid for d in pool.devices} == {"l4-0": "GPU-0", "h100-0": "GPU-1"}


def test_a_cuda_index_is_read_in_pci_bus_order_and_said_to_be_a_guess_on_a_mixed_machine(monkeypatch, caplog):
    # NVML lists the H100 first, but the L4 sits on the lower PCI bus: CUDA's PCI_BUS_ID order is L4, H100
    nvml = _with_pci(fake_pynvml(names=["NVIDIA H100 80GB HBM3", "NVIDIA L4"]),
                     ["00000000:3B:00.0", "00000000:18:00.0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        assert [b.name for b in discover(nvml)] == ["NVIDIA L4"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text and "name boards by UUID" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        assert [b.uuid for b in discover(nvml)] == ["GPU-1"]
        assert resolve_cuda_entry("1", nvml) == ("GPU-0", None)
    assert caplog.text == ""
    # a UUID is exact, and CUDA's shortened form of one (a unique prefix) is taken too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0")
    assert [b.name for b in discover(nvml)] == ["NVIDIA H100 80GB HBM3"]
    assert nvml.live == 0


def test_mig_instances_are_refused_with_the_reason(monkeypatch):
    nvml = fake_pynvml(names=["NVIDIA A100-SXM4-80GB"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4f6c7a2e-0b1d-5c3e-9a8f-1e2d3c4b5a69")
    with pytest.raises(NvmlUnavailable, match="MIG instance.*per board, not per MIG instance.*Name whole GPUs"):
        discover(nvml)
    uuid, note = resolve_cuda_entry("MIG-4f6c7a2e", nvml)
    assert uuid is None and "pin workers to whole GPUs" in note


def test_a_remote_worker_is_measured_by_the_uuid_it_resolved_and_a_guess_is_said_once(caplog):
    info = {"resources": {"slot": 2}, "host": "10.0.0.7"}
    env = {"cuda_visible_devices": "1", "nvml_uuid": "GPU-abc", "pin_note": "CUDA index 1 is read ... a guess"}
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        for _ in range(3):  # rediscovery asks again and again: said once
            device = _remote_device("tcp://10.0.0.7:1", "l4-0", info, env)
    assert device.uuid == "GPU-abc" and device.cuda_index == 1
    assert caplog.text.count("CUDA index 1 is read ... a guess") == 1
    plain = _remote_device("tcp://10.0.0.7:2", "l4-1", info, {"cuda_visible_devices": "GPU-def"})
    assert plain.uuid == "GPU-def"


def test_a_worker_resolves_its_cuda_index_to_the_nvml_board_it_is(monkeypatch):
    nvml = _with_pci(fake_pynvml(names=["NVIDIA L4", "NVIDIA L4"]), ["00000000:AF:00.0", "00000000:18:00.0"])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("GOGH_EMULATED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(worker_mod, "_PINNED", {})
    described = worker_mod.describe_worker()
    # one model: PCI order is CUDA's order, no warning; CUDA's device 0 is NVML's index 1
    assert described["nvml_uuid"] == "GPU-1" and described["pin_note"] is None


# -- readings that stop ----------------------------------------------------------------------------
def _h100_failing(watts: float, down, times) -> NvmlSampler:
    """A started sampler of a ``watts`` H100 whose counter and power both raise while ``down(t)``,
    sampled at each of ``times`` with one step reported there."""
    clock = FakeClock()

    def alive(t: float) -> float:
        if down(t):
            raise RuntimeError("NVMLError_GpuIsLost: GPU is lost")
        return t

    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=lambda t: watts + 0 * alive(t),
                       energy_j=lambda t: watts * alive(t), clock=clock)
    sampler = NvmlSampler(GpuDevice("h100-0", "h100", "w", uuid="GPU-0"), interval_s=3600, nvml=nvml, clock=clock,
                          warmup_steps=0)
    sampler.start()
    for t in times:
        clock.t = t
        sampler.report(1)
        sampler.board.sample()
    sampler.clock = clock
    return sampler


def test_a_board_that_stops_answering_leaves_the_runs_energy_unknown_not_small(caplog):
    """A GPU lost mid-run made every later stretch count 0 J: 133 J for a 650 W, 1 s run."""
    sampler = _h100_failing(650.0, lambda t: t > 2.0, (1.0, 2.0, 3.0, 4.0, 5.0))
    sampler.clock.t = 6.0
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        reading = sampler.stop()
    assert reading.steps == 5 and reading.throughput is not None  # what the body did stays measured
    assert reading.energy_j is None and reading.run_energy_j is None and reading.mean_power_w is None
    assert reading.energy_method is None
    assert "NVML gave no power or energy reading on h100-0 for 3.0 s of this run's 6.0 s" in caplog.text
    assert "GpuIsLost" in caplog.text


def test_one_lost_sample_between_good_ones_is_still_measured():
    clock = FakeClock()

    def power(t: float) -> float:
        if t == 3.0:
            raise RuntimeError("transient")
        return 100.0

    nvml = fake_pynvml(names=["Tesla K80"], power_w=power, energy_j=None, clock=clock)  # no counter
    sampler = NvmlSampler(GpuDevice("k80-0", "k80", "w", uuid="GPU-0"), interval_s=3600, nvml=nvml, clock=clock)
    sampler.start()
    for t in (1.0, 2.0, 3.0, 4.0):
        clock.t = t
        sampler.board.sample()
    clock.t = 5.0
    reading = sampler.stop()
    assert reading.energy_method == "integrated" and reading.energy_j == pytest.approx(500.0)


def test_a_meter_that_fails_to_start_gives_way_to_the_wall_clock(monkeypatch, caplog):
    class Refusing:
        source = "nvml"

        def start(self):
            raise RuntimeError("NVMLError_Unknown")

    spec = types.SimpleNamespace(run_id="r1", run_key="k", warmup_steps=5)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        meter = worker_mod._start_meter(Refusing(), GpuDevice("h100-0", "h100", "w"), spec)
    assert meter.source == "wallclock"
    assert "measuring run r1 on h100-0 through NVML failed to start" in caplog.text


# -- limits put back, and never raised -------------------------------------------------------------
def test_closing_a_pool_puts_back_what_a_killed_worker_left_and_forgets_its_exit_hook(
        monkeypatch, never_the_real_setter):  # noqa: F811
    """An exit hook left registered after close later undid a limit an administrator set."""
    from gogh_flows.runtime.pool import local_cuda_pool

    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"], limits_w=(100, 700))
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with local_cuda_pool(capacity=1, run_power_limits=True):
        assert len(never_the_real_setter) == 1
        nvml.limit_mw[0] = 250 * W  # as a worker killed outright with its board lowered would leave it
    assert nvml.limit_mw[0] == 700 * W  # put back as the pool closed
    assert never_the_real_setter == []  # and nothing left for the process's exit
    nvml.limit_mw[0] = 400 * W  # an administrator, later
    rl.restore_if_still_changed({"GPU-0": 300.0}, nvml)  # a board above the limit gogh found: not gogh's
    assert nvml.limit_mw[0] == 400 * W


def test_a_cap_never_raises_a_board_an_administrator_limited_lower(caplog):
    nvml = fake_nvml(["NVIDIA L4"], limits_w=(40, 72), default_w=72, current_w=50)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        (plan,) = pc.plan_power_caps([0], power_cap_fraction=1.0, nvml=nvml)
    assert plan.cap_w == 50 and plan.restore_w == 50
    assert "already limited to 50 W, below the cap of 72 W asked; it is left at 50 W" in caplog.text


def test_the_sampling_interval_reaches_the_runs_meter(monkeypatch):
    from gogh_flows.runtime.pool import local_cuda_pool

    seen = []
    real = worker_mod.telemetry_for

    def spy(*args, **kwargs):
        seen.append(kwargs.get("interval_s"))
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_mod, "telemetry_for", spy)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(names=["Tesla T4"]))
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    with pytest.raises(ValueError, match="interval_s .* must be > 0"):
        local_cuda_pool(interval_s=0)
    with local_cuda_pool(capacity=1, interval_s=0.25) as pool:
        pool.run(lambda: None, gpu_id="t4-0", job_type="a")
    assert seen == [0.25]


def test_a_short_outage_the_energy_counter_spans_keeps_the_runs_energy():
    """Counter and power both failing for a moment: the counter's next reading covers the gap, so
    the energy is exact (only the mean power, from the samples, has a hole and is left unknown)."""
    reading = _h100_failing(300.0, lambda t: 2.0 < t < 3.0, (1.0, 2.0, 2.25, 2.5, 3.0, 4.0)).stop()
    assert reading.run_energy_j == pytest.approx(1200.0) and reading.energy_method == "counter+integrated"
    assert reading.mean_power_w is None


def test_a_sampler_that_cannot_find_its_board_leaves_no_nvml_init_behind():
    nvml = fake_pynvml(names=["Tesla T4"])
    sampler = NvmlSampler(GpuDevice("t4-5", "t4", "w", cuda_index=5), nvml=nvml)
    with pytest.raises(NvmlUnavailable, match="t4-5's CUDA index '5' names no board NVML lists"):
        sampler.start()
    assert nvml.live == 0

"""Optional GPU power caps (issue 18, item 6), against a fake NVML only.

The real ``nvmlDeviceSetPowerManagementLimit`` changes a board for every user of the
machine: no test may reach it. Every test here runs with a fake ``pynvml`` in
``sys.modules``, and the real module's setter (when it is installed) is replaced by one
that fails the test.
"""

from __future__ import annotations

import sys
import types

import pytest

from gogh_flows.runtime import power_cap as pc
from gogh_flows.runtime.devices import GpuDevice
from test_runtime import FakeLocalCUDACluster

W = 1000  # NVML speaks milliwatts


def fake_nvml(names=("NVIDIA H100 80GB HBM3",), *, limits_w=(200, 700), default_w=700, current_w=None,
              refuse: str | None = None) -> types.ModuleType:
    """A stand-in for ``pynvml`` with the power-management calls; records every Set call.

    ``refuse`` names the NVMLError subclass the setter raises (e.g. ``"NVMLError_NoPermission"``).
    """
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    for sub in ("NVMLError_NoPermission", "NVMLError_NotSupported", "NVMLError_NotFound",
                "NVMLError_LibraryNotFound"):
        setattr(m, sub, type(sub, (NVMLError,), {}))
    m.NVMLError = NVMLError
    m.live = 0
    m.set_calls = []  # (index, milliwatts)
    m.limit_mw = {i: int((current_w or default_w) * W) for i in range(len(names))}

    def init():
        m.live += 1

    def shutdown():
        m.live -= 1

    def by_index(i):
        if not 0 <= i < len(names):
            raise m.NVMLError_NotFound(f"no device {i}")
        return ("handle", i)

    def by_uuid(u):
        return by_index(int(str(u).removeprefix("GPU-")))

    def set_limit(h, mw):
        if refuse:
            raise getattr(m, refuse)("Insufficient Permissions" if "Permission" in refuse else "Not Supported")
        low, high = limits_w
        if not low * W <= mw <= high * W:
            raise m.NVMLError("Invalid Argument")
        m.set_calls.append((h[1], mw))
        m.limit_mw[h[1]] = mw

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex, m.nvmlDeviceGetHandleByUUID = by_index, by_uuid
    m.nvmlDeviceGetName = lambda h: names[h[1]]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1]}"
    m.nvmlDeviceGetIndex = lambda h: h[1]
    m.nvmlDeviceGetPowerManagementLimitConstraints = lambda h: (limits_w[0] * W, limits_w[1] * W)
    m.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: default_w * W
    m.nvmlDeviceGetPowerManagementLimit = lambda h: m.limit_mw[h[1]]
    m.nvmlDeviceSetPowerManagementLimit = set_limit
    # what the telemetry of a pool's worker asks (tests that open a pool)
    m.nvmlDeviceGetPowerUsage = lambda h: 150 * W
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: 0
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50, memory=10)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30, total=16 * 2**30)
    return m


@pytest.fixture(autouse=True)
def never_the_real_setter(monkeypatch):
    """The real NVML setter fails the test; the caps' records start empty; exit hooks are recorded.

    Yields the exit hooks gogh registered (the power-cap module's and the pool's ``atexit``
    are replaced by a recorder, so this test process never restores fake boards at its exit).
    """
    from gogh_flows.runtime import pool as pool_module

    try:
        import pynvml as real
    except Exception:  # noqa: BLE001 - not installed: nothing to guard
        real = None
    if real is not None and not hasattr(real, "set_calls"):
        def refuse(*args, **kwargs):
            raise AssertionError("a test reached the real nvmlDeviceSetPowerManagementLimit")

        monkeypatch.setattr(real, "nvmlDeviceSetPowerManagementLimit", refuse)
    monkeypatch.setattr(pc, "_IN_FORCE", {})
    hooks: list = []

    def register(fn, *args, **kwargs):
        hooks.append((fn, args, kwargs))
        return fn

    def unregister(fn):
        hooks[:] = [hook for hook in hooks if hook[0] != fn]

    recorder = types.SimpleNamespace(register=register, unregister=unregister)
    monkeypatch.setattr(pc, "atexit", recorder)
    monkeypatch.setattr(pool_module, "atexit", recorder)
    yield hooks


# -- what may be asked -------------------------------------------------------------------
@pytest.mark.parametrize("w, f, message", [
    (250, 0.5, "not both"),
    (0, None, "power_cap_w must be > 0 watts"),
    (-5, None, "power_cap_w must be > 0 watts"),
    (None, 0, r"power_cap_fraction must be in \(0, 1\]"),
    (None, 1.5, r"power_cap_fraction must be in \(0, 1\]"),
    ("300", None, "power_cap_w must be a number"),
    (float("nan"), None, "power_cap_w must be a number"),
])
def test_a_malformed_request_is_refused(w, f, message):
    with pytest.raises(ValueError, match=message):
        pc.check_cap_request(w, f)


def test_gpu_cluster_block_validates_caps():
    from gogh_flows.flows.blocks import GpuCluster

    assert GpuCluster().power_cap_w is None and GpuCluster().power_cap_fraction is None  # off by default
    assert GpuCluster(mode="local-cuda", power_cap_w=300).power_cap_w == 300
    assert GpuCluster(mode="local-cuda", power_cap_fraction=0.8).power_cap_fraction == 0.8
    with pytest.raises(ValueError, match="not both"):
        GpuCluster(mode="local-cuda", power_cap_w=300, power_cap_fraction=0.8)
    with pytest.raises(ValueError, match="greater than 0"):
        GpuCluster(mode="local-cuda", power_cap_w=0)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        GpuCluster(mode="local-cuda", power_cap_fraction=1.2)
    with pytest.raises(ValueError, match="power caps apply to mode='local-cuda' only"):
        GpuCluster(mode="remote", address="tcp://10.0.0.5:8786", power_cap_w=300)
    with pytest.raises(ValueError, match="power caps apply to mode='local-cuda' only"):
        GpuCluster(power_cap_fraction=0.5)


# -- the range check ---------------------------------------------------------------------
def test_a_cap_outside_the_range_is_refused_naming_it_before_anything_changes():
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    with pytest.raises(pc.PowerCapError) as info:
        pc.plan_power_caps([0, 1], power_cap_w=150, nvml=nvml)
    assert str(info.value) == (
        "cannot cap GPU 0 (NVIDIA H100 80GB HBM3) at 150 W: it accepts power limits from 200 W to 700 W "
        "(default 700 W). Choose a cap in that range; no board was changed.")
    with pytest.raises(pc.PowerCapError, match=r"at 70 W \(0.1 of its default 700 W\): it accepts power "
                                               r"limits from 200 W to 700 W"):
        pc.plan_power_caps([0], power_cap_fraction=0.1, nvml=nvml)
    with pytest.raises(pc.PowerCapError, match="from 200 W to 700 W"):
        pc.plan_power_caps([0], power_cap_w=701, nvml=nvml)
    assert nvml.set_calls == [] and nvml.live == 0


def test_the_plan_reads_range_default_and_current_limit():
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], current_w=650)
    plan = pc.plan_power_caps(["GPU-0", 1], power_cap_fraction=0.5, nvml=nvml)
    assert [(c.board, c.index, c.cap_w, c.restore_w) for c in plan] == [("GPU-0", 0, 350, 650), ("GPU-1", 1, 350, 650)]
    assert plan[0].limits == pc.PowerLimits(min_w=200, max_w=700, default_w=700, current_w=650)
    assert nvml.set_calls == [] and nvml.live == 0  # planning changes nothing


def test_no_cap_asked_opens_no_nvml_at_all():
    assert pc.plan_power_caps([0, 1]) == []  # no module passed, none loaded


# -- set and restore -------------------------------------------------------------------------
def test_capped_block_sets_and_restores_and_records_the_cap_in_force():
    nvml = fake_nvml(current_w=690)
    device = GpuDevice(id="h100-0", gpu_type="h100", worker="0", cuda_index=0, uuid="GPU-0")
    with pc.power_capped(0, power_cap_w=300, nvml=nvml) as in_force:
        assert in_force == 300
        assert nvml.limit_mw[0] == 300 * W
        assert pc.power_cap_in_force(device) == 300
        assert pc.power_cap_in_force("GPU-0") == pc.power_cap_in_force(0) == pc.power_cap_in_force() == 300
    assert nvml.set_calls == [(0, 300 * W), (0, 690 * W)]  # back to what it was, not to the default
    assert pc.power_cap_in_force(device) is None
    assert nvml.live == 0


def test_the_previous_limit_is_back_when_the_body_raises():
    nvml = fake_nvml()
    with pytest.raises(ZeroDivisionError), pc.power_capped(0, power_cap_fraction=0.5, nvml=nvml):
        _ = 1 / 0
    assert nvml.set_calls == [(0, 350 * W), (0, 700 * W)]
    assert pc.power_cap_in_force(0) is None


def test_the_atexit_backstop_is_registered_and_restores_once(never_the_real_setter):
    nvml = fake_nvml()
    with pc.power_capped(0, power_cap_w=400, nvml=nvml):
        at_exit, args, _ = never_the_real_setter[-1]
        at_exit(*args)  # the interpreter exits while the block runs
        assert nvml.set_calls == [(0, 400 * W), (0, 700 * W)]
    assert nvml.set_calls == [(0, 400 * W), (0, 700 * W)]  # the block's end does not restore twice


def test_no_cap_asked_changes_nothing():
    nvml = fake_nvml()
    with pc.power_capped(0, nvml=nvml) as in_force:
        assert in_force is None
    assert nvml.set_calls == [] and pc.power_cap_in_force(0) is None


def test_nvml_refusal_says_nvmls_answer_and_what_to_do():
    nvml = fake_nvml(refuse="NVMLError_NoPermission")
    with pytest.raises(pc.PowerCapError) as info, pc.power_capped(0, power_cap_w=300, nvml=nvml):
        pytest.fail("the body must not run without its cap")
    assert str(info.value) == (
        "NVML refused to set the power limit of GPU 0 (NVIDIA H100 80GB HBM3) to 300 W: NVMLError_NoPermission: "
        "Insufficient Permissions. Changing a board's power limit needs root, as `nvidia-smi -pl` does: run the "
        "pool as a user allowed to, ask the machine's administrator to set the cap (`sudo nvidia-smi -i 0 -pl "
        "300`), or leave power_cap_w / power_cap_fraction unset.")
    assert pc.power_cap_in_force(0) is None and nvml.live == 0
    unsupported = fake_nvml(refuse="NVMLError_NotSupported")
    with pytest.raises(pc.PowerCapError, match="NVMLError_NotSupported: Not Supported. this board does not let"), \
            pc.power_capped(0, power_cap_w=300, nvml=unsupported):
        pass


# -- the worker plugin ---------------------------------------------------------------------
def test_worker_plugin_caps_its_own_board_and_restores_at_teardown(monkeypatch):
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"] * 2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    plan = pc.plan_power_caps([0, 1], power_cap_w=500, nvml=nvml)
    plugin = pc.PowerCapPlugin({"0": plan[0], "1": plan[1]})
    worker = types.SimpleNamespace(name=1)
    plugin.setup(worker)
    assert nvml.set_calls == [(1, 500 * W)] and pc.power_cap_in_force(1) == 500
    assert pc.power_cap_in_force(0) is None
    plugin.teardown(worker)
    assert nvml.set_calls == [(1, 500 * W), (1, 700 * W)] and pc.power_cap_in_force(1) is None
    plugin.teardown(worker)  # a second teardown does nothing
    assert len(nvml.set_calls) == 2
    stranger = pc.PowerCapPlugin({"0": plan[0]})
    stranger.setup(types.SimpleNamespace(name="someone-else"))  # not in the plan: left alone
    assert len(nvml.set_calls) == 2


@pytest.fixture
def fake_gpus(monkeypatch):
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"], limits_w=(100, 700))
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_local_cuda_pool_is_uncapped_by_default(fake_gpus, never_the_real_setter):
    from gogh_flows.runtime.pool import local_cuda_pool

    with local_cuda_pool(capacity=1) as pool:
        assert len(pool.devices) == 2
        assert pc.PLUGIN_NAME not in pool.client.run(lambda dask_worker: list(dask_worker.plugins),
                                                     workers=None).popitem()[1]
    assert fake_gpus.set_calls == []
    assert never_the_real_setter == []  # no exit hook either
    assert pc.power_cap_in_force(0) is None


def test_local_cuda_pool_caps_every_board_and_restores_when_it_closes(fake_gpus, never_the_real_setter):
    from gogh_flows.runtime.pool import local_cuda_pool

    with local_cuda_pool(capacity=1, power_cap_fraction=0.5) as pool:
        assert sorted(fake_gpus.set_calls) == [(0, 350 * W), (1, 350 * W)]
        assert {d.id: pc.power_cap_in_force(d) for d in pool.devices} == {"h100-0": 350, "a100-0": 350}
        # the opener's backstop for a worker killed outright is registered while the pool lives
        # (the workers, threads of this process here, register their own)
        assert len(_backstops(never_the_real_setter)) == 1
    assert sorted(fake_gpus.set_calls[2:]) == [(0, 700 * W), (1, 700 * W)]
    assert pc.power_cap_in_force(0) is None and pc.power_cap_in_force(1) is None
    # it ran as the pool closed, found nothing left to restore, and is no longer the process's exit's
    assert len(fake_gpus.set_calls) == 4 and _backstops(never_the_real_setter) == []


def _backstops(hooks: list) -> list:
    """The pool opener's exit hooks for capped boards among the hooks registered."""
    return [fn for fn, _, _ in hooks if getattr(fn, "func", None) is pc.restore_if_still_capped]


def test_local_cuda_pool_refuses_an_out_of_range_cap_before_starting(fake_gpus):
    from gogh_flows.runtime.pool import local_cuda_pool

    with pytest.raises(pc.PowerCapError, match=r"cannot cap GPU 0 \(NVIDIA H100 80GB HBM3\) at 900 W: it accepts "
                                                r"power limits from 100 W to 700 W"):
        local_cuda_pool(power_cap_w=900)
    assert fake_gpus.set_calls == []


def test_local_cuda_pool_fails_with_nvmls_refusal_and_leaves_no_board_changed(monkeypatch):
    from gogh_flows.runtime.pool import local_cuda_pool

    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"], refuse="NVMLError_NoPermission")
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(pc.PowerCapError, match=r"NVMLError_NoPermission.*needs root, as `nvidia-smi -pl` does"):
        local_cuda_pool(power_cap_w=300)
    assert nvml.set_calls == [] and nvml.limit_mw == {0: 700 * W}


def test_the_exit_backstop_restores_a_board_a_killed_worker_left_capped():
    nvml = fake_nvml()
    plan = pc.plan_power_caps([0], power_cap_w=300, nvml=nvml)
    nvml.limit_mw[0] = 300 * W  # a worker capped it and was killed before its teardown
    pc.restore_if_still_capped(plan, nvml)
    assert nvml.set_calls == [(0, 700 * W)]
    nvml.set_calls.clear()
    pc.restore_if_still_capped(plan, nvml)  # already back: nothing to do
    assert nvml.set_calls == []

"""Per-run power limits on real boards (issue 12, item 3), against a fake NVML only.

Like tests/test_power_cap.py: the real ``nvmlDeviceSetPowerManagementLimit`` changes a board for
every user of the machine, so the autouse fixture there (imported below) makes the real setter
fail the test and records exit hooks instead of registering them.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types

import pytest

from gogh_flows.energy import EnergyModel
from gogh_flows.runtime import current_gpu
from gogh_flows.runtime import power_cap as pc
from gogh_flows.runtime import run_limits as rl
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.worker import Occupancy, RunSpec, _predicted_power, execute
from test_power_cap import W, fake_nvml, never_the_real_setter  # noqa: F401 - the autouse guard
from test_runtime import FakeLocalCUDACluster

H100 = GpuDevice("h100-0", "h100", "0", cuda_index=0, uuid="GPU-0")


@pytest.fixture(autouse=True)
def no_exit_hooks(monkeypatch):
    """The limiter's own atexit is recorded, not registered: this process never touches fake boards at exit."""
    hooks: list = []
    monkeypatch.setattr(rl, "atexit", types.SimpleNamespace(register=hooks.append,
                                                            unregister=lambda fn: hooks.remove(fn)))
    monkeypatch.setattr(rl, "_active", None)
    return hooks


def test_a_board_takes_each_limit_and_goes_back_to_the_one_before(no_exit_hooks):
    nvml = fake_nvml(limits_w=(100, 700), current_w=650)
    limiter = rl.BoardLimiter(nvml, restore=rl.plan_run_limits(["GPU-0"], nvml))
    assert nvml.live == 0  # the plan only read it
    assert limiter.enact(H100, 300.0) == 300 and nvml.limit_mw[0] == 300 * W
    assert len(no_exit_hooks) == 1 and nvml.live == 1  # restored at exit if nothing else does
    assert limiter.enact(H100, 250.0) == 250
    assert limiter.enact(H100, None) == 650  # the limit in force before gogh, not the maximum
    assert limiter.enact(H100, None) == 650 and nvml.set_calls == [(0, 300 * W), (0, 250 * W), (0, 650 * W)]
    limiter.enact(H100, 200.0)
    limiter.restore_all()
    assert nvml.limit_mw[0] == 650 * W and nvml.live == 0 and no_exit_hooks == []


def test_a_limit_outside_what_the_board_may_take_is_clamped_and_said_once(caplog):
    nvml = fake_nvml(limits_w=(150, 250), default_w=250)  # a PCIe board; the catalog's type goes to 300 W
    limiter = rl.BoardLimiter(nvml)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        assert limiter.enact(H100, 120.0) == 150
        assert limiter.enact(H100, 120.0) == 150
    assert caplog.text.count("power limit 120 W chosen for GPU 0 (NVIDIA H100 80GB HBM3) is outside the 150-250 W "
                             "it may take (its range, and never above its limit from before); set to 150 W") == 1


def test_an_administrators_cap_stays_a_cap():
    nvml = fake_nvml(limits_w=(100, 700), current_w=300)  # capped at 300 W before the pool started
    limiter = rl.BoardLimiter(nvml, restore={"GPU-0": 300.0})
    assert limiter.enact(H100, 450.0) == 300  # a placement's 450 W does not lift the cap
    assert limiter.enact(H100, 200.0) == 200
    assert limiter.enact(H100, None) == 300


def test_a_worker_restarted_after_a_crash_puts_the_board_back_to_the_limit_from_before(caplog):
    """The pool's opener read 700 W before any change; a worker was killed with its board at 200 W.
    Its replacement must not take 200 W for the limit to put back."""
    nvml = fake_nvml(limits_w=(100, 700), current_w=200)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        rl.BoardLimiter(nvml, restore={"0": 700.0}).check("0")
    assert nvml.limit_mw[0] == 700 * W
    assert "GPU 0 (NVIDIA H100 80GB HBM3) was at 200 W, not its 700 W from before the pool started" in caplog.text
    nvml.limit_mw[0] = 250 * W  # and the opener's exit puts back a board a killed worker left changed
    rl.restore_if_still_changed({"0": 700.0}, nvml)
    assert nvml.limit_mw[0] == 700 * W
    rl.restore_if_still_changed({"0": 700.0}, nvml)  # already back: no call
    assert nvml.set_calls[-1] == (0, 700 * W) and len(nvml.set_calls) == 2


@pytest.mark.parametrize("refuse, says", [
    ("NVMLError_NoPermission", r"needs root, as `nvidia-smi -pl` does: run the pool's dask-cuda workers as a user "
                               r"allowed to, or leave run_power_limits off"),
    ("NVMLError_NotSupported", r"does not let its power limit be changed: leave run_power_limits off"),
])
def test_a_refusal_says_nvmls_answer_and_what_to_do(refuse, says):
    nvml = fake_nvml(refuse=refuse)
    with pytest.raises(pc.PowerCapError, match=rf"NVML refused to set the power limit of GPU 0 \(NVIDIA H100 80GB "
                                                rf"HBM3\) to 300 W: {refuse}: .*\. .*{says}"):
        rl.BoardLimiter(nvml).enact(H100, 300.0)


class _LimitReader:
    """A meter that records what its board's limit is whenever the occupancy says it changed."""

    def __init__(self, nvml):
        self.nvml, self.seen = nvml, []

    def set_partners(self, partners):
        pass

    def set_power_limit(self, limit_w):
        self.seen.append(self.nvml.limit_mw[0] / W)


def test_the_board_holds_the_last_joins_limit_and_is_put_back_when_empty():
    nvml = fake_nvml(limits_w=(100, 700))
    limiter, occ = rl.BoardLimiter(nvml), Occupancy()
    first, second = _LimitReader(nvml), _LimitReader(nvml)
    occ.join("h100-0", "r1", "a", first, 300.0, enact=lambda w: limiter.enact(H100, w))
    occ.join("h100-0", "r2", "b", second, 400.0, enact=lambda w: limiter.enact(H100, w))
    assert nvml.limit_mw[0] == 400 * W and first.seen == [300, 400] and second.seen == [400]
    occ.leave("h100-0", "r2")
    assert nvml.limit_mw[0] == 400 * W  # one run is left: the board keeps the limit it was placed under
    occ.leave("h100-0", "r1")
    assert nvml.limit_mw[0] == 700 * W and occ.limit("h100-0") is None


def test_runs_that_start_and_end_together_leave_the_board_as_it_was():
    """16 runs on one board, 8 threads at once, each joining at its own limit and leaving: every
    change goes through the occupancy's lock, so the board is back at its limit when the last leaves."""
    nvml = fake_nvml(limits_w=(100, 700), current_w=600)
    limiter, occ = rl.BoardLimiter(nvml), Occupancy()
    go = threading.Barrier(8)

    def runs(k):
        go.wait()
        for i in range(2):
            key = f"r{k}-{i}"
            occ.join("h100-0", key, "a", _LimitReader(nvml), 200.0 + 50 * k, enact=lambda w: limiter.enact(H100, w))
            occ.leave("h100-0", key)

    threads = [threading.Thread(target=runs, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert nvml.limit_mw[0] == 600 * W and occ.snapshot() == {}
    assert {mw for _, mw in nvml.set_calls} >= {200 * W, 550 * W, 600 * W}
    # and while runs overlap, the board holds the last join's limit: replay the calls in order
    last: dict[str, float] = {}
    occ2 = Occupancy()
    limiter2 = rl.BoardLimiter(nvml)
    for k, w in enumerate((300.0, 250.0, 400.0)):
        occ2.join("h100-0", f"s{k}", "a", _LimitReader(nvml), w, enact=lambda x: limiter2.enact(H100, x))
        last["now"] = nvml.limit_mw[0] / W
        assert last["now"] == w
    occ2.leave("h100-0", "s2")
    assert nvml.limit_mw[0] / W == 400.0  # runs left: the board keeps the last join's limit
    occ2.leave("h100-0", "s0"), occ2.leave("h100-0", "s1")
    assert nvml.limit_mw[0] == 600 * W


def test_a_real_run_with_a_limit_runs_under_it_and_records_its_slowdown(monkeypatch):
    nvml = fake_nvml(limits_w=(100, 700))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    limiter = rl.BoardLimiter()
    monkeypatch.setattr(rl, "_active", limiter)
    job = "ResNet-50 (batch size 64)"
    spec = RunSpec(device=H100, mode="local-cuda", emulated=False, run_key="k", run_id="run-1", job_type=job,
                   check_worker=False, power_limit_w=160.0)

    def body():
        current_gpu().advance(10)
        return nvml.limit_mw[0] / W

    outcome = execute(body, (), {}, spec)
    assert outcome.value == 160  # the body ran under its placement's limit
    assert nvml.limit_mw[0] == 700 * W  # and the board is back once it was empty
    reading = outcome.telemetry
    assert reading.source == "nvml" and reading.power_limit_w == 160
    p0 = _predicted_power(H100, job, None, None)
    # the fake board draws 150 W, close to the 160 W limit: it bound. By the energy model, a board
    # predicted to draw p0 at its default 700 W is slowed this much at 160 W:
    assert p0 > 300
    assert reading.limit_slowdown == pytest.approx(EnergyModel().at_limit("h100", p0, 160.0)[0])
    assert reading.limit_slowdown > 1.5


def test_without_per_run_limits_a_real_board_is_left_alone(caplog):
    nvml = fake_nvml()
    spec = RunSpec(device=H100, mode="local-cuda", emulated=False, run_key="k", run_id="run-2",
                   check_worker=False, power_limit_w=300.0)
    with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
        sys.modules["pynvml"], saved = nvml, sys.modules.get("pynvml")
        try:
            execute(lambda: None, (), {}, spec)
        finally:
            sys.modules["pynvml"] = saved
    assert nvml.set_calls == []
    assert "is not applied: this pool does not set per-run limits on real boards " \
           "(GpuCluster(mode='local-cuda', run_power_limits=True) does" in caplog.text


def test_the_slowdown_estimate_is_against_the_boards_own_maximum():
    e = EnergyModel()
    assert e.limit_slowdown("v100", 280.0, 300.0, 300.0) == 1.0  # at its full limit
    assert e.limit_slowdown("v100", 280.0, 200.0, 300.0, mean_w=150.0) == 1.0  # drew well below: did not bind
    full = e.limit_slowdown("v100", 280.0, 200.0, 300.0)
    assert full == pytest.approx(e.at_limit("v100", 280.0, 200.0)[0]) and full > 1
    pcie = e.limit_slowdown("v100", 280.0, 200.0, 250.0)  # a board whose default is 250 W: less than from 300 W
    assert 1 < pcie < full


# -- the pool ----------------------------------------------------------------------------------
@pytest.fixture
def fake_gpus(monkeypatch):
    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"], limits_w=(100, 700))
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def _limit_now() -> float:
    current_gpu().advance(10)
    return sys.modules["pynvml"].limit_mw[0] / W


def test_a_local_cuda_pool_with_run_limits_sets_each_runs_and_puts_the_board_back(fake_gpus, never_the_real_setter):  # noqa: F811
    from gogh_flows.runtime.pool import local_cuda_pool

    with local_cuda_pool(capacity=1, run_power_limits=True) as pool:
        assert fake_gpus.set_calls == [(0, 700 * W)]  # the permission check: the limit in force, unchanged
        (backstop, args, _), = never_the_real_setter  # the opener's exit puts back what a killed worker left
        assert backstop.func is rl.restore_if_still_changed and backstop.args == ({"GPU-0": 700.0},) and not args
        outcome = pool.run(_limit_now, gpu_id="h100-0", job_type="a", power_limit_w=250.0)
        assert outcome.value == 250 and outcome.telemetry.power_limit_w == 250
        assert fake_gpus.limit_mw[0] == 700 * W
        assert pool.run(_limit_now, gpu_id="h100-0", job_type="a").value == 700  # no limit chosen: untouched
    assert fake_gpus.limit_mw[0] == 700 * W and fake_gpus.live == 0


def test_a_pool_that_may_not_change_its_boards_fails_when_it_starts(monkeypatch):
    from gogh_flows.runtime.pool import local_cuda_pool

    nvml = fake_nvml(["NVIDIA H100 80GB HBM3"], refuse="NVMLError_NoPermission")
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(pc.PowerCapError, match=r"NVML refused to check that this worker may change \(at pool start\) "
                                                r"the power limit of GPU 0.*NVMLError_NoPermission.*leave "
                                                r"run_power_limits off"):
        local_cuda_pool(run_power_limits=True)
    assert nvml.set_calls == [] and nvml.limit_mw == {0: 700 * W}


def test_limits_and_a_cap_together_are_refused_before_anything_starts(fake_gpus):
    from gogh_flows.flows.blocks import GpuCluster
    from gogh_flows.runtime.pool import local_cuda_pool

    with pytest.raises(ValueError, match="not both"):
        local_cuda_pool(run_power_limits=True, power_cap_w=300)
    with pytest.raises(ValueError, match="not both"):
        GpuCluster(mode="local-cuda", run_power_limits=True, power_cap_fraction=0.5)
    with pytest.raises(ValueError, match="run_power_limits applies to mode='local-cuda' only"):
        GpuCluster(mode="emulated", run_power_limits=True)
    assert GpuCluster(mode="local-cuda", run_power_limits=True).run_power_limits
    assert fake_gpus.set_calls == []


def test_a_real_run_short_of_its_requirement_lifts_its_board_while_it_runs(monkeypatch):
    import time

    nvml = fake_nvml(limits_w=(100, 700))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(rl, "_active", rl.BoardLimiter())
    spec = RunSpec(device=H100, mode="local-cuda", emulated=False, run_key="k", run_id="run-3",
                   check_worker=False, power_limit_w=200.0, required_throughput=1e6)  # no board is that fast

    def body():
        seen = []
        for _ in range(12):
            time.sleep(0.002)
            current_gpu().report(1)
            seen.append(nvml.limit_mw[0] / W)
        return seen

    outcome = execute(body, (), {}, spec)
    # warm-up (5 steps) and 5 more measured at 200 W; then the board is back at its 700 W
    assert outcome.value[:9] == [200] * 9 and outcome.value[9:] == [700] * 3
    # the limit changed mid-run: no slowdown is made up for the mix, the rate is learned as measured
    assert outcome.telemetry.limit_slowdown is None and outcome.telemetry.power_limit_w == 700


def test_a_limit_clamped_up_to_the_cap_is_no_limit_to_the_guard(monkeypatch):
    """An administrator capped the board at 300 W; a placement chose 450 W, which the board cannot
    take above its cap: the board is not below its limit from before, so a run short of its
    requirement there is not 'lifted' (nothing to lift), nor recorded as measured at 450 W."""
    import time

    nvml = fake_nvml(limits_w=(100, 700), current_w=300)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(rl, "_active", rl.BoardLimiter(nvml, restore={"GPU-0": 300.0}))
    spec = RunSpec(device=H100, mode="local-cuda", emulated=False, run_key="k", run_id="run-4",
                   check_worker=False, power_limit_w=450.0, required_throughput=1e6)

    def body():
        for _ in range(12):
            time.sleep(0.002)
            current_gpu().report(1)
        return nvml.limit_mw[0] / W

    outcome = execute(body, (), {}, spec)
    assert outcome.value == 300  # the cap held throughout
    assert outcome.telemetry.limit_lifted_from_w is None and outcome.telemetry.limit_lifted_rate is None
    # a limit that binds is still lifted, and recorded as the limit in force
    monkeypatch.setattr(rl, "_active", rl.BoardLimiter(nvml, restore={"GPU-0": 300.0}))
    lowered = execute(body, (), {}, dataclasses.replace(spec, run_key="k2", run_id="run-5", power_limit_w=200.0))
    assert lowered.telemetry.limit_lifted_from_w == 200.0 and lowered.value == 300

"""On a real NVIDIA GPU only: a trained body's steady window, and a shared board split in two.

Skipped, with the reason, wherever NVML cannot list a GPU (CI has none); ``make test`` on a
GPU machine runs them.
"""

from __future__ import annotations

import pytest

from gogh_flows.runtime.training import train_zoo


def _gpu_reason() -> str | None:
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return "needs dask-cuda (pip install gogh-flows[cuda])"
    try:
        from gogh_flows.runtime.nvml import NvmlUnavailable, discover

        if not discover():
            return "NVML lists no GPU (check CUDA_VISIBLE_DEVICES)"
    except NvmlUnavailable as exc:
        return f"needs an NVIDIA GPU with its driver: {exc}"
    return None


GPU_REASON = _gpu_reason()


def test_train_zoo_trains_on_the_cpu_outside_a_pool():
    assert train_zoo("ResNet-18", 4, steps=2) == 2
    with pytest.raises(ValueError, match="exactly one of seconds"):
        train_zoo("ResNet-18", 4)


@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_a_real_board_measures_the_steady_window_and_splits_a_shared_board():
    from gogh_flows.runtime.pool import local_cuda_pool

    with local_cuda_pool(capacity=2) as pool:
        gid = pool.gpu_ids[0]
        alone = pool.run(train_zoo, "ResNet-18", 32, seconds=3.0, gpu_id=gid, job_type="ResNet-18 (batch size 32)")
        both = [pool.submit(train_zoo, family, bs, seconds=4.0, gpu_id=gid, job_type=f"{family} (batch size {bs})")
                for family, bs in (("ResNet-18", 32), ("LM", 10))]
        pair = [f.result() for f in both]
    t = alone.telemetry
    assert alone.error is None and t.source == "nvml" and t.window == "steady"
    assert t.throughput == pytest.approx(t.window_steps / t.duration_s) and t.startup_s > 0
    assert t.attributed_energy_j == pytest.approx(t.energy_j)  # alone: the run's share is the board's
    readings = [o.telemetry for o in pair]
    assert all(o.error is None for o in pair) and all(r.window == "steady" for r in readings)
    overlap = [r for r in readings if r.run_energy_j < r.board_run_energy_j * 0.99]
    assert overlap, "two runs on one board must each carry a part of the shared stretch, not all of it"


@pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
def test_a_real_board_keeps_its_limit_when_the_pool_was_not_asked_to_set_one(monkeypatch):
    """Read-only on the board: a placement's chosen limit without ``run_power_limits`` is recorded,
    not applied (the board's limit, read through NVML before and after, is unchanged, and the run's
    measurement carries the limit it really ran at). The machine is shared, so NVML's setter is
    replaced in every process of the pool by one that refuses: a regression fails the run instead
    of changing the board."""
    from gogh_flows.catalog import get_gpu_type
    from gogh_flows.runtime.pool import local_cuda_pool
    from gogh_flows.runtime.power_cap import _load_pynvml
    from gogh_flows.runtime.run_limits import board_of, plan_run_limits

    def refuse(*args, **kwargs):
        raise RuntimeError("a pool opened without run_power_limits tried to set a board's power limit")

    def refuse_limit_changes() -> bool:  # nested: pickled by value to the workers
        import pynvml

        pynvml.nvmlDeviceSetPowerManagementLimit = refuse
        return True

    nvml = _load_pynvml()
    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", refuse)  # this process too
    with local_cuda_pool(capacity=1) as pool:
        assert all(pool.client.run(refuse_limit_changes).values())
        gid = pool.gpu_ids[0]
        device = pool.device(gid)
        board = board_of(device)
        before = plan_run_limits([board], nvml)[board]  # reads, changes nothing
        chosen = max(get_gpu_type(device.gpu_type).power_limit_range_w[0], round(0.6 * before))
        if chosen >= before:
            pytest.skip(f"the board's limit {before:g} W is its lowest: no lower limit to choose")
        out = pool.run(train_zoo, "ResNet-18", 32, seconds=2.0, gpu_id=gid, job_type="ResNet-18 (batch size 32)",
                       power_limit_w=chosen)
        after = plan_run_limits([board], nvml)[board]
    assert out.error is None and out.telemetry.source == "nvml", out.error
    assert after == before, "a pool opened without run_power_limits changed the board's limit"
    assert out.telemetry.power_limit_w == pytest.approx(before)

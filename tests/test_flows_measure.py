"""A placed run logs exactly the work that happened: the body's own count, or the declared work."""

from __future__ import annotations

import pytest

from gogh_flows import GpuCluster, current_placement, gogh_placed
from gogh_flows.flows.session import open_sessions
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.telemetry import Meter, WallClockMeter

pytestmark = pytest.mark.usefixtures("prefect_server")


def _rows():
    (env,) = open_sessions().values()
    return env.measurements.read()


def test_readme_example_logs_exactly_its_work_steps(gogh_home):
    # the README's example, verbatim but for the return value
    @gogh_placed(model="ResNet-50", batch_size=64, min_throughput=2.0, work_steps=1_000,
                 cluster=GpuCluster(fleet={"v100": 1, "t4": 1}))
    def train(epochs: int = 1) -> str:
        where = current_placement()
        where.advance(1_000)
        return where.gpu_id

    train()
    row = _rows().row(0, named=True)
    assert row["steps"] == 1_000
    # throughput is the emulated one: steps over the emulated time of exactly those steps
    assert row["throughput"] == pytest.approx(row["steps"] / row["duration_s"])


def test_a_body_that_reports_half_the_work_logs_half(gogh_home):
    @gogh_placed(model="ResNet-18", batch_size=32, min_throughput=1.0, work_steps=400)
    def half() -> None:
        for _ in range(4):
            current_placement().report(50)

    half()
    assert _rows().row(0, named=True)["steps"] == 200


def test_a_body_that_reports_nothing_logs_the_declared_work_once(gogh_home):
    @gogh_placed(model="ResNet-18", batch_size=32, min_throughput=1.0, work_steps=300)
    def silent() -> None:
        pass

    silent()
    assert _rows().row(0, named=True)["steps"] == 300


def test_every_meter_declares_the_members_callers_use():
    from gogh_flows.runtime.emulation import EmulatedMeter

    device = GpuDevice(id="t4-0", gpu_type="t4", worker="t4-0")
    for meter in (EmulatedMeter(device, job_type=None, truth=None), WallClockMeter()):
        assert isinstance(meter, Meter)
        meter.start()
        assert meter.steps == 0
        meter.report(3)
        assert meter.steps == 3


def test_wall_clock_meter_counts_steps_over_wall_time_and_claims_no_energy():
    ticks = iter([10.0, 12.0])
    meter = WallClockMeter(clock=lambda: next(ticks))
    meter.start()
    meter.advance(50)  # no truth table needed: the real GPU did the work
    reading = meter.stop()
    assert (reading.source, reading.steps, reading.duration_s, reading.throughput) == ("wallclock", 50, 2.0, 25.0)
    assert reading.energy_j is None and reading.mean_power_w is None

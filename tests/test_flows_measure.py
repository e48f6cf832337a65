"""A placed run logs exactly the work that happened: the body's own count, or the declared work."""

from __future__ import annotations

import dataclasses
import json
import time

import polars as pl
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
            time.sleep(0.01)  # some work between reports (reports in a burst are no window)
            current_placement().report(50)

    half()
    row = _rows().row(0, named=True)
    assert row["steps"] == 200
    # reported over wall time: measured from the first report (the warm-up of 5 steps is done
    # there) to the last, the start-up apart
    assert row["window"] == "steady" and row["startup_s"] is not None and row["startup_s"] >= 0
    assert row["run_energy_j"] >= row["energy_j"] > 0


def test_a_body_that_reports_nothing_logs_the_declared_work_once(gogh_home):
    @gogh_placed(model="ResNet-18", batch_size=32, min_throughput=1.0, work_steps=300)
    def silent() -> None:
        pass

    silent()
    row = _rows().row(0, named=True)
    assert row["steps"] == 300 and row["window"] == "emulated"  # emulated time has no start-up


def _measured_row(reading, run_id: str) -> dict:
    """The table row of a ResNet-50 run on an H100 next to LM that measured ``reading``."""
    from gogh_flows.flows.measure import build_measurement
    from gogh_flows.runtime.outcome import RunOutcome
    from gogh_flows.workloads.job import JobSpec
    from types import SimpleNamespace

    job = JobSpec.from_zoo("ResNet-50", 64, required_throughput=10.0, work_steps=300)
    placement = SimpleNamespace(run_id=run_id, policy="optimizer", predicted_energy_j=1.0, waited_s=0.0,
                                predictor_versions={}, partner_runs=(), partners=("LM (batch size 10)",),
                                gpu_id="h100-0", gpu_type="h100", predicted_throughput=20.0, limit_trial=False)
    outcome = RunOutcome(value=None, telemetry=reading, partners=("LM (batch size 10)",), error=None,
                         gpu_id="h100-0", gpu_type="h100", job_type=job.job_type, run_id=run_id)
    m = build_measurement(job, placement, outcome, None, started=1.0, wall_s=31.0, flow_run=None, flow_name="f",
                          device="local")
    return m.to_row()



def test_a_pool_learns_only_from_runs_on_boards_of_its_own_kind():
    """A demo's or a test's runs on emulated GPUs in the same table (or shared MLflow store) as
    runs on real ones: an emulated run's rate is the emulator's truth, and a real pool took it as
    a measured observation (and an emulated pool a real board's)."""
    from types import SimpleNamespace

    from gogh_flows.flows.observations import ObservationCache
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.runtime.pool import GpuPool
    from gogh_flows.runtime.telemetry import TelemetryReading
    from gogh_flows.tracking.measurements import empty_table
    import polars as pl

    def reading(source: str, rate: float) -> TelemetryReading:
        return TelemetryReading(source=source, duration_s=10.0, steps=300, throughput=rate, mean_power_w=300.0,
                                energy_j=3000.0, max_memory_bytes=None, mean_utilisation=None, wall_s=10.0,
                                attributed_energy_j=3000.0, energy_method="model", window=(
                                    "emulated" if source == "emulated" else "steady"),
                                window_steps=300, run_energy_j=3000.0, board_run_energy_j=3000.0)

    rows = [_measured_row(reading("nvml", 24.0), "real"), _measured_row(reading("emulated", 30.0), "emu")]
    table = pl.concat([empty_table(), pl.DataFrame([{**r, "logged_at": float(i)} for i, r in enumerate(rows)],
                                                  schema=empty_table().schema)])
    log = SimpleNamespace(table=SimpleNamespace(version=lambda: 1), read=lambda: table)

    def pool(emulated: set[str], *types: str) -> GpuPool:
        devices = [GpuDevice(id=f"{t}-{i}", gpu_type=t, worker=f"w-{t}-{i}") for t in types for i in range(2)]
        return GpuPool(mode="remote", devices=devices, client=None, owns_client=False,
                       emulated=frozenset(d.id for d in devices if d.id in emulated))

    real = pool(set(), "h100", "t4")
    emulated = pool({"h100-0", "h100-1", "t4-0", "t4-1"}, "h100", "t4")
    mixed = pool({"h100-0"}, "h100", "t4")  # one of two H100s emulated: both kinds kept for it
    assert real.emulated_by_type() == {"h100": False, "t4": False}
    assert mixed.emulated_by_type() == {"h100": None, "t4": False}

    def rates(p: GpuPool | None) -> list[float]:
        return ObservationCache(log, None if p is None else p.emulated_by_type).get()["throughput"].to_list()

    assert rates(real) == [24.0]
    assert rates(emulated) == [30.0]
    assert sorted(rates(mixed)) == [24.0, 30.0]
    assert sorted(rates(None)) == [24.0, 30.0]  # no pool (gogh predict): every row, as before
    # a type the pool lacks follows the pool's one kind (a refiner moves every type from any run)
    assert rates(pool(set(), "a100")) == [24.0]
    assert rates(pool({"a100-0", "a100-1"}, "a100")) == [30.0]


def test_whole_run_and_shared_figures_reach_the_table_as_measured():
    from gogh_flows.flows.observations import observations_from_measurements
    from gogh_flows.runtime.telemetry import TelemetryReading
    from gogh_flows.tracking.measurements import Measurement, empty_table
    import polars as pl

    row = _measured_row
    shared = TelemetryReading(source="nvml", duration_s=12.0, steps=293, throughput=24.0, mean_power_w=507.0,
                              energy_j=6084.0, max_memory_bytes=None, mean_utilisation=None, wall_s=30.5,
                              attributed_energy_j=3300.0, energy_method="counter", window="steady",
                              window_steps=288, startup_s=18.2, startup_energy_j=2700.0, run_energy_j=6100.0,
                              board_run_energy_j=9000.0, energy_split="model")
    whole = TelemetryReading(source="nvml", duration_s=30.0, steps=300, throughput=10.0, mean_power_w=400.0,
                             energy_j=12000.0, max_memory_bytes=None, mean_utilisation=None, wall_s=30.0,
                             attributed_energy_j=12000.0, energy_method="counter", window="whole_run",
                             window_steps=300, run_energy_j=12000.0, board_run_energy_j=12000.0)
    cpu_timed = TelemetryReading(source="emulated", duration_s=1.0, steps=200, throughput=192.0,
                                 mean_power_w=60.0, energy_j=60.0, max_memory_bytes=None, mean_utilisation=None,
                                 wall_s=1.2, attributed_energy_j=60.0, energy_method="model", window="steady",
                                 window_steps=195, startup_s=0.1, startup_energy_j=6.0, run_energy_j=72.0,
                                 board_run_energy_j=72.0)
    emulated = TelemetryReading(source="emulated", duration_s=10.0, steps=300, throughput=30.0, mean_power_w=60.0,
                                energy_j=600.0, max_memory_bytes=None, mean_utilisation=None, wall_s=0.01,
                                attributed_energy_j=600.0, energy_method="model", window="emulated",
                                window_steps=300, run_energy_j=600.0, board_run_energy_j=600.0)
    a, b = row(shared, "r1"), row(whole, "r2")
    c, d = row(cpu_timed, "r3"), row(emulated, "r4")
    # the run's share, never the board's: the board's figure is kept apart
    assert a["energy_j"] == 3300.0 and a["run_energy_j"] == 6100.0 and a["startup_energy_j"] == 2700.0
    assert '"device_energy_j": "6084"' in a["extra"] and '"energy_split": "model"' in a["extra"]
    assert Measurement.from_row(a).window == "steady"
    table = pl.concat([empty_table(), pl.DataFrame([{**r, "logged_at": float(i)} for i, r in enumerate((a, b, c, d))],
                                                  schema=empty_table().schema)])
    obs = observations_from_measurements(table)
    # the refiner learns the steady run and the emulated GPU's own time only: the whole-run
    # figure includes 18 s of start-up, and a report-only body on an emulated fleet was timed
    # by the CPU, not by the GPU it stood for
    assert obs["throughput"].to_list() == [24.0, 30.0]
    # a run whose board limit the worker's guard lifted says so in its row; others do not
    lifted = row(dataclasses.replace(emulated, power_limit_w=None, limit_slowdown=1.04, limit_lifted_from_w=160.0,
                                     limit_lifted_rate=21.5), "r5")
    assert '"limit_lifted_from_w": "160"' in lifted["extra"] and "limit_lifted_from_w" not in d["extra"]
    assert '"limit_lifted_rate": "21.5"' in lifted["extra"]


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
    ticks = iter([10.0, 11.5, 12.0])
    meter = WallClockMeter(clock=lambda: next(ticks))
    meter.start()
    meter.advance(50)  # no truth table needed: the real GPU did the work
    reading = meter.stop()
    # one report is no window: the whole run, marked so
    assert (reading.source, reading.steps, reading.duration_s, reading.throughput) == ("wallclock", 50, 2.0, 25.0)
    assert reading.window == "whole_run" and reading.startup_s is None
    assert reading.energy_j is None and reading.mean_power_w is None


def test_wall_clock_meter_measures_the_steady_window_after_the_warm_up():
    ticks = iter([0.0, *[20.0 + 0.5 * k for k in range(10)], 26.0])  # start, 10 reports, stop
    meter = WallClockMeter(clock=lambda: next(ticks), warmup_steps=3)
    meter.start()
    for _ in range(10):
        meter.report()
    reading = meter.stop()
    # the window opens at the third report (20 + 1.0 s) and ends at the tenth (24.5 s): 7 steps in 3.5 s
    assert reading.window == "steady" and reading.window_steps == 7 and reading.duration_s == 3.5
    assert reading.throughput == 2.0 and reading.steps == 10
    assert reading.startup_s == 21.0 and reading.wall_s == 26.0


def test_a_run_whose_partners_changed_after_placement_has_no_prediction_error():
    """A run placed alone that a partner joined measured a pairing its placement did not predict:
    its error would be the predictor's fault in the table (it showed as +91% in review)."""
    from types import SimpleNamespace

    from gogh_flows.flows.measure import build_measurement
    from gogh_flows.runtime.outcome import RunOutcome
    from gogh_flows.runtime.telemetry import TelemetryReading
    from gogh_flows.tracking.measurements import _metrics
    from gogh_flows.workloads.job import JobSpec

    job = JobSpec.from_zoo("ResNet-50", 64, required_throughput=10.0, work_steps=300)
    reading = TelemetryReading(source="emulated", duration_s=10.0, steps=300, throughput=30.0, mean_power_w=60.0,
                               energy_j=600.0, max_memory_bytes=None, mean_utilisation=None, wall_s=0.01,
                               attributed_energy_j=600.0, energy_method="model", window="emulated",
                               window_steps=300, run_energy_j=600.0, board_run_energy_j=600.0)

    def measured(placed_with: tuple[str, ...], ran_with: tuple[str, ...], trial: bool = False,
                 board_limit_w: float | None = None):
        placement = SimpleNamespace(run_id="r1", policy="optimizer", predicted_energy_j=1.0, waited_s=0.0,
                                    predictor_versions={}, partner_runs=(), partners=placed_with, gpu_id="v100-0",
                                    gpu_type="v100", predicted_throughput=57.0, limit_trial=trial,
                                    power_limit_w=200.0 if trial else None)
        outcome = RunOutcome(value=None, telemetry=dataclasses.replace(reading, power_limit_w=board_limit_w),
                             partners=ran_with, error=None, gpu_id="v100-0",
                             gpu_type="v100", job_type=job.job_type, run_id="r1")
        m = build_measurement(job, placement, outcome, None, started=1.0, wall_s=1.0, flow_run=None,
                              flow_name="f", device="local")
        return m, {x.key: x.value for x in _metrics(m)}

    joined, metrics = measured((), ("LM (batch size 10)",))
    assert joined.extra["partners_changed"] == "placed alone, ran next to LM (batch size 10)"
    assert "prediction_rel_error" not in metrics and metrics["throughput"] == 30.0
    left, metrics = measured(("LM (batch size 10)",), ())
    assert left.extra["partners_changed"] == "placed next to LM (batch size 10), ran alone"
    assert "prediction_rel_error" not in metrics
    same, metrics = measured(("LM (batch size 10)",), ("LM (batch size 10)",))
    assert "partners_changed" not in same.extra and metrics["prediction_rel_error"] == pytest.approx(0.9)
    # a run at a trial limit was offered at the rate measured a level above: a hope, not a prediction
    trial, metrics = measured((), (), trial=True, board_limit_w=200.0)
    assert trial.extra["limit_trial_w"] == "200" and "prediction_rel_error" not in metrics
    # chosen but not applied (a pool that does not set limits on real boards: the board stayed at
    # its own 250 W): nothing was tried, and the prediction is scored
    kept, metrics = measured((), (), trial=True, board_limit_w=250.0)
    assert "limit_trial_w" not in kept.extra and "prediction_rel_error" in metrics


def test_a_run_whose_company_changed_while_it_ran_is_not_learned_as_a_pair_or_alone():
    """Placed next to a partner that left half-way, or alone and joined: its rate mixes two
    figures. Learned as the pair's, it made sharing a V100 look 45% faster than it is (review)."""
    import polars as pl
    from types import SimpleNamespace

    from gogh_flows.flows.measure import build_measurement
    from gogh_flows.flows.observations import observations_from_measurements
    from gogh_flows.runtime.outcome import RunOutcome
    from gogh_flows.runtime.telemetry import TelemetryReading
    from gogh_flows.runtime.worker import Occupancy
    from gogh_flows.tracking.measurements import empty_table
    from gogh_flows.workloads.job import JobSpec

    # the worker's ledger: a run's company changes when a partner joins or leaves while it runs
    occ = Occupancy()
    meter = SimpleNamespace(set_partners=lambda partners: None)  # what the ledger tells a run's meter
    occ.join("v100-0", "a", "ResNet-50 (batch size 64)", meter)
    occ.join("v100-0", "b", "ResNet-50 (batch size 64)", meter)  # b finds a there
    assert occ.leave_with_company("v100-0", "b") == (("ResNet-50 (batch size 64)",), False)  # a there all along
    assert occ.leave_with_company("v100-0", "a") == (("ResNet-50 (batch size 64)",), True)  # b came and went
    occ.join("v100-0", "c", "LM (batch size 10)", meter)
    assert occ.leave("v100-0", "c") == ()

    job = JobSpec.from_zoo("ResNet-50", 64, required_throughput=1.0, work_steps=300)
    partner = "LM (batch size 10)"
    reading = TelemetryReading(source="emulated", duration_s=10.0, steps=300, throughput=30.0, mean_power_w=60.0,
                               energy_j=600.0, max_memory_bytes=None, mean_utilisation=None, wall_s=0.01,
                               attributed_energy_j=600.0, energy_method="model", window="emulated",
                               window_steps=300, run_energy_j=600.0, board_run_energy_j=600.0)

    def row(run_id: str, changed: bool) -> dict:
        placement = SimpleNamespace(run_id=run_id, policy="optimizer", predicted_energy_j=1.0, waited_s=0.0,
                                    predictor_versions={}, partner_runs=(), partners=(partner,), gpu_id="v100-0",
                                    gpu_type="v100", predicted_throughput=30.0, limit_trial=False)
        outcome = RunOutcome(value=None, telemetry=reading, partners=(partner,), error=None, gpu_id="v100-0",
                             gpu_type="v100", job_type=job.job_type, run_id=run_id, company_changed=changed)
        return build_measurement(job, placement, outcome, None, started=1.0, wall_s=1.0, flow_run=None,
                                 flow_name="f", device="local").to_row()

    steady, mixed = row("r1", False), row("r2", True)
    assert "partners_changed" not in steady["extra"]
    assert "a partner came or went during the run" in mixed["extra"]
    table = pl.concat([empty_table(), pl.DataFrame([{**r, "logged_at": float(i)} for i, r in enumerate((steady, mixed))],
                                                  schema=empty_table().schema)])
    obs = observations_from_measurements(table)
    assert obs.height == 1 and obs["partner"].to_list() == [partner]  # the pair figure of the steady run only


def test_an_interrupted_run_says_it_was_interrupted():
    """str(KeyboardInterrupt()) is empty: the row's error named nothing (review)."""
    from types import SimpleNamespace

    from gogh_flows.flows.measure import build_measurement
    from gogh_flows.workloads.job import JobSpec

    job = JobSpec.from_zoo("ResNet-50", 64, required_throughput=1.0, work_steps=300)
    placement = SimpleNamespace(run_id="r1", policy="optimizer", predicted_energy_j=1.0, waited_s=0.0,
                                predictor_versions={}, partner_runs=(), partners=(), gpu_id="v100-0",
                                gpu_type="v100", predicted_throughput=30.0, limit_trial=False)

    def error_of(exc: BaseException) -> str:
        return build_measurement(job, placement, None, exc, started=1.0, wall_s=1.0, flow_run=None,
                                 flow_name="f", device="local").extra["error"]

    assert error_of(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert error_of(RuntimeError("the pool is gone")) == "RuntimeError: the pool is gone"


def _reading(steps: int):
    from gogh_flows.runtime.telemetry import TelemetryReading

    return TelemetryReading(source="emulated", duration_s=10.0, steps=steps, throughput=steps / 10.0,
                            mean_power_w=300.0, energy_j=3000.0, max_memory_bytes=None, mean_utilisation=None,
                            wall_s=10.0, attributed_energy_j=3000.0, energy_method="model", window="emulated",
                            window_steps=steps, run_energy_j=3000.0, board_run_energy_j=3000.0)


def _placed(run_id: str = "r1"):
    from types import SimpleNamespace

    from gogh_flows.runtime.outcome import RunOutcome
    from gogh_flows.workloads.job import JobSpec

    job = JobSpec.from_zoo("ResNet-50", 64, required_throughput=10.0, work_steps=300)
    placement = SimpleNamespace(run_id=run_id, policy="optimizer", predicted_energy_j=1.0, waited_s=0.0,
                                predictor_versions={}, partner_runs=(), partners=(), gpu_id="h100-0",
                                gpu_type="h100", predicted_throughput=20.0, limit_trial=False)
    return job, placement, lambda steps: RunOutcome(value=None, telemetry=_reading(steps), partners=(), error=None,
                                                    gpu_id="h100-0", gpu_type="h100", job_type=job.job_type,
                                                    run_id=run_id)


def test_a_measurement_that_cannot_be_logged_is_said_and_never_raised_over_the_runs_result(caplog):
    """record_run's promise: the run's result reaches its caller whatever the table does."""
    from types import SimpleNamespace

    from gogh_flows.flows.measure import record_run

    job, placement, outcome = _placed()
    kicked: list[bool] = []

    def full_disk(m, *, defer):
        raise OSError(28, "No space left on device")

    session = SimpleNamespace(pool=SimpleNamespace(device=lambda gpu_id: SimpleNamespace(where="local")),
                              measurements=SimpleNamespace(log=full_disk),
                              mirror=SimpleNamespace(kick=lambda: kicked.append(True)))
    with caplog.at_level("ERROR", logger="gogh_flows"):
        assert record_run(session, job, placement, outcome(300), None, started=1.0, flow_run=None,
                          flow_name="f") is False  # not recorded: its placer does not tell the ledger it is
    assert "could not record the measurement of run r1 on h100-0" in caplog.text
    assert "No space left on device" in caplog.text and not kicked


@pytest.mark.parametrize(("steps", "told"), [(300, False), (600, False), (150, False), (3_000, True), (30, True)])
def test_a_body_far_from_its_declared_work_either_way_is_told(monkeypatch, steps, told):
    """work_steps=300: within a factor 2 either way nothing is said; 10x more or 10x fewer, told."""
    from gogh_flows.flows import measure

    said: list[str] = []
    monkeypatch.setattr(measure, "_warn", said.append)
    job, placement, outcome = _placed()
    m = measure.build_measurement(job, placement, outcome(steps), None, started=1.0, wall_s=10.0, flow_run=None,
                                  flow_name="f", device="local")
    measure._say_if_work_differs(job, m)
    assert bool(said) == told, said
    if told:
        assert f"reported {steps:,} steps" in said[0] and "declares 300" in said[0]


def test_observations_read_extra_in_polars_and_survive_an_unreadable_one():
    """The table's ``extra`` is read by polars for the whole table at once (a row-by-row parse cost a
    second per placement at 50,000 rows); a text it cannot parse is read as empty, as before."""
    from gogh_flows.flows.observations import observations_from_measurements

    base = {"job_type": "a", "gpu_type": "t4", "steps": 100.0, "telemetry": "nvml", "window": "steady"}
    frame = pl.DataFrame([
        {**base, "key": "k1", "throughput": 10.0, "partners": [""], "extra": "not json"},
        {**base, "key": "k2", "throughput": 8.0, "partners": [], "extra": json.dumps({"limit_slowdown": "1.25"})},
        {**base, "key": "k3", "throughput": 5.0, "partners": ["b"], "extra": json.dumps({"partners_changed": "x"})},
        {**base, "key": "k4", "throughput": 6.0, "partners": ["b", ""], "extra": "{}"},
    ])
    obs = observations_from_measurements(frame, keys=True).sort("key")
    assert obs.select("key", "partner", "throughput").rows() == [("k1", None, 10.0), ("k2", None, 10.0),
                                                                  ("k4", "b", 6.0)]


def test_a_nan_row_or_an_unreadable_file_in_the_table_does_not_stop_placements(tmp_path, caplog):
    """One row with a NaN rate (written by anything but MeasurementLog, which refuses it) failed
    every placement's observations (NaN > 0 holds in polars); one damaged parquet file failed them
    with polars' words and no path (a security review). The row is left out; the file is named,
    with what to do, and placements go on with what was read before."""
    import logging
    import time

    import polars as pl

    from gogh_flows.flows.observations import ObservationCache
    from gogh_flows.tracking.measurements import SCHEMA, Measurement, MeasurementLog
    from gogh_flows.tracking.table import DamagedTableFile

    root = tmp_path / "measurements"
    log = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", root)

    def m(i: int, rate: float) -> Measurement:
        return Measurement(run_id=f"r{i}", flow_name="f", job_type="ResNet-50 (batch size 64)", family="ResNet-50",
                           batch_size=64, gpu_id="v100-0", gpu_type="v100", device="emulated", partners=(),
                           required_throughput=1.0, predicted_throughput=2.0, steps=100.0, duration_s=50.0,
                           throughput=rate, mean_power_w=200.0, energy_j=1e4, status="completed",
                           telemetry="emulated", started_at=time.time(), window="emulated")

    log.log(m(1, 2.0), defer=True)
    parts = root / "table" / "parts"
    row = {**m(2, 2.0).to_row(), "logged_at": time.time(), "throughput": float("nan")}
    pl.DataFrame([row], schema=SCHEMA).write_parquet(parts / "zz-nan.parquet")
    cache = ObservationCache(log)
    assert cache.get()["throughput"].to_list() == [2.0]
    [good] = [p for p in parts.glob("*.parquet") if p.name != "zz-nan.parquet"]
    (parts / "zz-damaged.parquet").write_bytes(good.read_bytes()[:200])
    with pytest.raises(DamagedTableFile, match=r"zz-damaged.parquet.*Move them out of the folder"):
        log.read()
    reads = []
    real_read = log.read
    log.read = lambda *a, **k: reads.append(1) or real_read(*a, **k)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        for _ in range(5):  # decisions on the unchanged table: read (and said) once, not at each
            assert cache.get()["throughput"].to_list() == [2.0]  # what was read before
            assert cache.limit_evidence() is not None
        assert ObservationCache(log).get().is_empty()  # a new process: nothing, said
    said = [r.getMessage() for r in caplog.records if "placing without the measurements" in r.getMessage()]
    assert len(said) == 2 and all("zz-damaged.parquet" in x for x in said) and len(reads) == 2

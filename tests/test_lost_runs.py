"""Runs of a lost placing process are ended by a live process of the same store: measured, and Crashed in Prefect."""

from __future__ import annotations

import pytest

from gogh_flows.flows.lost_runs import crash_flow_run, deliver_lost_runs
from gogh_flows.runtime.leases import LostRun
from gogh_flows.tracking.measurements import Measurement, MeasurementLog

pytestmark = pytest.mark.usefixtures("prefect_server")


def _flow_run(state):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="placed-elsewhere")
    def placed_elsewhere() -> None: ...

    with get_client(sync_client=True) as client:
        return client.create_flow_run(placed_elsewhere, state=state)


def _state(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


class _Ledger:
    def __init__(self, lost):
        self.lost, self.done = lost, []

    def collect(self, store):
        return list(self.lost)

    def delivered(self, run_ids):
        self.done += run_ids
        return len(run_ids)


def test_lost_runs_are_measured_once_and_their_flow_runs_say_crashed(tmp_path):
    from prefect.states import Completed, Running

    measured, unstarted, back, ended = (_flow_run(Running()), _flow_run(Running()), _flow_run(Running()),
                                        _flow_run(Completed()))
    m = Measurement(run_id=str(measured.id), flow_name="f", job_type="ResNet-50:64", family="ResNet-50",
                    batch_size=64, gpu_id="a100-0", gpu_type="a100", device="a100-0@a100-0", partners=(),
                    required_throughput=5.0, predicted_throughput=6.0, steps=40.0, duration_s=8.0,
                    throughput=5.0, mean_power_w=None, energy_j=None, status="failed", telemetry="emulated",
                    started_at=1.0, flow_run_url=None, extra={"logged_by": "worker"})
    log = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "measurements")
    ledger = _Ledger([
        LostRun(str(measured.id), m.to_row(), "a100-0", placer_gone=True),
        LostRun(f"{unstarted.id}#2", None, "a100-1", placer_gone=True),  # a retried attempt's ledger id
        LostRun(str(back.id), None, "a100-2", placer_gone=False),  # its placer came back: it ends it
        LostRun(str(ended.id), None, "a100-3", placer_gone=True),
    ])
    assert deliver_lost_runs(ledger, log) == 1
    assert len(ledger.done) == 4
    first, second = _state(measured.id), _state(unstarted.id)
    assert first.is_crashed() and "was stopped on a100-0 after 40 steps" in first.message and "placed this run was lost" in first.message
    assert second.is_crashed() and "never started" in second.message and "a100-1" in second.message
    assert _state(back.id).is_running() and _state(ended.id).is_completed()
    assert log.read()["steps"].to_list() == [40.0]


def test_a_run_prefect_cannot_be_told_about_stays_with_the_ledger(tmp_path, monkeypatch):
    """Its measurement is logged now (by its key), its Crashed mark tried again when handed out again."""
    import prefect.client.orchestration
    from prefect.states import Running

    run = _flow_run(Running())
    log = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "measurements")
    ledger = _Ledger([LostRun(str(run.id), None, "a100-0", placer_gone=True)])

    def unreachable(*args, **kwargs):
        raise ConnectionError("Prefect API unreachable")

    with monkeypatch.context() as m:
        m.setattr(prefect.client.orchestration, "get_client", unreachable)
        deliver_lost_runs(ledger, log)
    assert ledger.done == [] and _state(run.id).is_running()
    deliver_lost_runs(ledger, log)  # handed out again, Prefect back
    assert ledger.done == [str(run.id)] and _state(run.id).is_crashed()


def test_only_flow_runs_are_marked():
    assert not crash_flow_run("local-0123456789ab", "lost")  # called outside any flow run
    assert not crash_flow_run("00000000-0000-4000-8000-000000000000", "lost")  # not on this server


def test_a_run_this_process_still_ends_is_logged_but_not_marked_crashed(tmp_path):
    """After a dropped connection the placer collects its own run's worker record; it ends the
    flow run itself (Failed, with the reason), so the delivery must not mark it Crashed."""
    from prefect.states import Running

    from gogh_flows.flows.lost_runs import handling

    run = _flow_run(Running())
    m = Measurement(run_id=str(run.id), flow_name="f", job_type="LM", family="LM", batch_size=20,
                    gpu_id="a100-0", gpu_type="a100", device="a100-0@a100-0", partners=(), required_throughput=1.0,
                    predicted_throughput=2.0, steps=47.0, duration_s=4.0, throughput=2.0, mean_power_w=None,
                    energy_j=None, status="failed", telemetry="emulated", started_at=1.0, flow_run_url=None,
                    extra={"logged_by": "worker"})
    log = MeasurementLog(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "measurements")
    ledger = _Ledger([LostRun(str(run.id), m.to_row(), "a100-0", placer_gone=True)])
    with handling(str(run.id)):
        assert deliver_lost_runs(ledger, log) == 1
    assert _state(run.id).is_running() and ledger.done == [str(run.id)]
    assert log.read()["steps"].to_list() == [47.0]

"""The Dask GPU pool: pinning, emulated telemetry, outcomes, the three modes' set-up."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
import types

import pytest
from distributed import Scheduler, SpecCluster, Worker, get_worker

from gogh_flows.catalog import UnknownGpuTypeError
from gogh_flows.energy import EnergyModel
from gogh_flows.runtime import (
    GpuDevice,
    current_gpu,
    emulated_pool,
    local_cuda_pool,
    open_pool,
    parse_fleet,
    remote_pool,
)
from gogh_flows.runtime import telemetry as telemetry_mod
from gogh_flows.runtime.devices import fleet_devices
from gogh_flows.runtime.emulation import EmulatedMeter, EmulationError
from gogh_flows.runtime.pool import UnknownDeviceError, _remote_device
from gogh_flows.truth.table import ThroughputTable

# A small hand-written truth: two job types on three GPU types, so expected
# figures can be computed by hand below.
ISO = {("a", "v100"): 100.0, ("a", "t4"): 50.0, ("a", "k80"): 20.0,
       ("b", "v100"): 40.0, ("b", "t4"): 30.0, ("b", "k80"): 10.0}
ACT = {"a": 0.6, "b": 0.5}
PAIR = {"v100": (60.0, 30.0), "t4": (30.0, 20.0), "k80": (12.0, 6.0)}  # (a, b) while sharing


def small_truth() -> ThroughputTable:
    rows = [{"job_type": j, "gpu_type": g, "scale_factor": 1, "throughput": t, "activity": ACT[j]}
            for (j, g), t in ISO.items()]
    rows += [{"job_type": "a", "gpu_type": g, "scale_factor": 1, "partner": "b", "throughput": ta,
              "partner_throughput": tb} for g, (ta, tb) in PAIR.items()]
    return ThroughputTable.from_rows(rows, source="hand-made")


@pytest.fixture(scope="module")
def pool():
    with emulated_pool({"v100": 2, "t4": 2, "k80": 2}, truth=small_truth()) as p:
        yield p


# -- fleets and devices --------------------------------------------------------------
def test_parse_fleet_accepts_strings_and_mappings():
    assert parse_fleet("v100=2, T4=2") == {"v100": 2, "t4": 2}
    assert parse_fleet({"k80": 1, "a100": 0}) == {"k80": 1}
    ids = [d.id for d in fleet_devices("v100=2,t4=1", capacity=1)]
    assert ids == ["v100-0", "v100-1", "t4-0"]


@pytest.mark.parametrize("spec, match", [
    ("v100", "TYPE=COUNT"), ("v100=two", "whole numbers"), ("v100=0", "declares no GPUs"),
    ({"v100": -1}, ">= 0"), ("", "declares no GPUs"),
    # named twice (case aside): refused, as `gogh simulate --cluster` refuses it, not added up
    ("v100=1,v100=2", r"'v100' appears twice .* total count \(e.g. 'v100=3'\)"),
    ({"T4": 1, "t4": 1}, r"'t4' appears twice .*'t4=2'"),
])
def test_parse_fleet_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_fleet(spec)


def test_unknown_gpu_type_lists_known_types():
    with pytest.raises(UnknownGpuTypeError, match="known types: .*v100"):
        parse_fleet("x100=1")
    with pytest.raises(UnknownGpuTypeError, match="x100"):
        emulated_pool("x100=1")
    with pytest.raises(UnknownGpuTypeError, match="known types"):
        GpuDevice(id="x", gpu_type="nope", worker="x")
    with pytest.raises(ValueError, match="capacity must be 1"):
        GpuDevice(id="x", gpu_type="v100", worker="x", capacity=3)


def test_truth_must_cover_the_fleet():
    with pytest.raises(ValueError, match=r"no data for GPU type\(s\) \['a100'\]"):
        emulated_pool("a100=1,v100=1", truth=small_truth())


def test_open_pool_checks_mode_and_options():
    with pytest.raises(ValueError, match="choose one of emulated, local-cuda, remote"):
        open_pool("cloud")
    with pytest.raises(ValueError, match="needs fleet="):
        open_pool("emulated")
    with pytest.raises(ValueError, match="needs address="):
        open_pool("remote")


# -- the emulated pool ---------------------------------------------------------------
def _where() -> tuple[str, str, str, str]:
    ctx = current_gpu()
    return str(get_worker().name), ctx.device.id, ctx.torch_device, ctx.mode


def test_each_run_executes_on_the_worker_pinned_to_its_gpu(pool):
    assert len(pool.devices) == 6 and pool.fleet() == {"v100": 2, "t4": 2, "k80": 2}
    futures = {g: [pool.submit(_where, gpu_id=g, job_type="a") for _ in range(3)] for g in pool.gpu_ids}
    for gpu_id, fs in futures.items():
        for f in fs:
            outcome = f.result()
            assert outcome.ok and outcome.gpu_id == gpu_id and outcome.worker == gpu_id
            assert outcome.value == (gpu_id, gpu_id, "cpu", "emulated")
    assert current_gpu() is None  # only bodies see a GPU context


def test_unknown_gpu_id_is_a_clear_error(pool):
    with pytest.raises(UnknownDeviceError, match="no GPU 'v100-9'.*v100-0, v100-1"):
        pool.submit(_where, gpu_id="v100-9")


def _advance(steps: float) -> float:
    current_gpu().advance(steps)
    return steps


def test_emulated_energy_is_power_times_emulated_time_alone(pool):
    outcome = pool.run(_advance, 500, gpu_id="v100-1", job_type="a")
    t = outcome.telemetry
    # By hand: a alone on a V100 runs 100 steps/s, so 500 steps take 5 s; it draws
    # idle + activity * (TDP - idle) = 40 + 0.6 * (300 - 40) = 196 W -> 980 J.
    assert t.source == "emulated" and t.energy_method == "model"
    assert t.duration_s == pytest.approx(5.0)
    assert t.throughput == pytest.approx(100.0)
    assert t.mean_power_w == pytest.approx(196.0)
    assert t.energy_j == pytest.approx(980.0)
    assert t.attributed_energy_j == pytest.approx(980.0)
    assert outcome.partners == () and outcome.value == 500


def test_emulated_meter_shared_segment_by_hand():
    truth = small_truth()
    meter = EmulatedMeter(GpuDevice("v100-0", "v100", "v100-0"), job_type="a", truth=truth)
    meter.start()
    meter.advance(500)  # alone: 5 s at 196 W = 980 J
    meter.set_partners(("b",))
    meter.advance(120)  # shared: 60 steps/s -> 2 s
    reading = meter.stop()
    # Shared power: r_a = 60/100, r_b = 30/40; load = 0.6*0.6 + 0.5*0.75 = 0.735;
    # 40 + 0.735 * 260 = 231.1 W for 2 s = 462.2 J.
    shared_w = EnergyModel().power_shared("v100", ((0.6, 0.6), (0.5, 0.75)))
    assert shared_w == pytest.approx(231.1)
    assert reading.duration_s == pytest.approx(7.0)
    assert reading.steps == 620
    assert reading.energy_j == pytest.approx(980.0 + 462.2)
    assert reading.attributed_energy_j == pytest.approx(980.0 + 462.2 * 0.36 / 0.735)


def test_emulated_meter_sleeps_scaled_time():
    slept: list[float] = []
    meter = EmulatedMeter(GpuDevice("t4-0", "t4", "t4-0"), job_type="b", truth=small_truth(),
                          time_scale=0.01, sleep=slept.append)
    meter.start()
    meter.advance(60)  # 2 emulated seconds on a T4
    assert slept == [pytest.approx(0.02)]
    assert meter.stop().duration_s == pytest.approx(2.0)


def test_one_advance_follows_a_partner_that_joins_and_a_stop_asked_while_it_runs():
    """A body that advances its whole work at once (as the README shows) on a board with
    time_scale > 0: the rate and power were fixed when the call began, so a partner that joined
    meanwhile changed neither (the shared stretch was charged at the whole board's alone power,
    and again in the partner's row), and a cancelled run slept on to its last step."""
    from gogh_flows.runtime.context import GpuContext, RunCancelled
    from gogh_flows.runtime.emulation import STRETCH_WALL_S

    device = GpuDevice("v100-0", "v100", "v100-0")
    slept: list[float] = []
    meter = EmulatedMeter(device, job_type="a", truth=small_truth(), time_scale=0.1, sleep=slept.append)

    def partner_joins_after_the_first_stretch(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 1:
            meter.set_partners(("b",))

    meter._sleep = partner_joins_after_the_first_stretch
    meter.start()
    meter.advance(620)
    reading = meter.stop()
    alone = STRETCH_WALL_S / 0.1 * 100  # steps of the first stretch, alone at 100 steps/s
    assert slept[0] == pytest.approx(STRETCH_WALL_S) and len(slept) > 2
    assert reading.steps == pytest.approx(620)
    # alone at 100/s for the first stretch, then at the pair's 60/s
    assert reading.duration_s == pytest.approx(alone / 100 + (620 - alone) / 60)
    shared_w = EnergyModel().power_shared("v100", ((0.6, 0.6), (0.5, 0.75)))
    assert reading.energy_j == pytest.approx(196.0 * alone / 100 + shared_w * (620 - alone) / 60)
    assert reading.attributed_energy_j < reading.energy_j  # the shared stretch is split with the partner

    stopper = EmulatedMeter(device, job_type="a", truth=small_truth(), time_scale=0.1, sleep=lambda s: None)
    ctx = GpuContext(device=device, torch_device="cpu", mode="emulated", job_type="a", run_id="r", meter=stopper)
    stopper._sleep = lambda seconds: ctx.request_stop("timed out")
    stopper.start()
    with pytest.raises(RunCancelled, match="timed out"):
        ctx.advance(10_000)
    assert stopper.stop().steps == pytest.approx(STRETCH_WALL_S / 0.1 * 100)  # one stretch, not 10,000 steps


def test_the_guard_looks_between_stretches_and_an_infinite_time_scale_is_refused():
    """A limit a partner's placement lowers while one long advance() runs is looked at by the
    limit guard while lifting it still helps (it looked only when the call ended)."""
    from gogh_flows.runtime.emulation import STRETCH_WALL_S

    meter = EmulatedMeter(GpuDevice("v100-0", "v100", "v100-0"), job_type="a", truth=small_truth(),
                          time_scale=0.1, sleep=lambda s: None)
    looked: list[float] = []
    meter.watch = lambda m: looked.append(m.steps)
    meter.start()
    meter.advance(10 * STRETCH_WALL_S / 0.1 * 100)  # ten stretches alone at 100 steps/s
    assert len(looked) == 10 and looked == sorted(looked)
    with pytest.raises(ValueError, match="finite number >= 0"):
        EmulatedMeter(GpuDevice("v100-0", "v100", "v100-0"), job_type="a", truth=small_truth(),
                      time_scale=math.inf)  # it spun forever, advancing 0 steps a stretch


def test_a_stop_during_the_declared_work_of_a_silent_body_ends_it_as_a_bodys_stop_does(monkeypatch):
    """A body that reports nothing has its declared work run after it returns; a lost placing
    process's stop there escaped without the flow run being marked crashed."""
    from types import SimpleNamespace

    from gogh_flows.flows import decorator
    from gogh_flows.runtime.context import GpuContext, RunCancelled, use_gpu
    from gogh_flows.runtime.ledger import PLACER_LOST

    device = GpuDevice("v100-0", "v100", "v100-0")
    meter = EmulatedMeter(device, job_type="a", truth=small_truth(), time_scale=0.01)
    ctx = GpuContext(device=device, torch_device="cpu", mode="emulated", job_type="a", run_id="r", meter=meter)
    meter._sleep = lambda seconds: ctx.request_stop(PLACER_LOST)
    crashed: list[str] = []
    monkeypatch.setattr(decorator, "_mark_crashed", crashed.append)
    meter.start()
    with use_gpu(ctx), pytest.raises(RunCancelled):
        decorator._execute_body(lambda: "done", (), {}, {}, SimpleNamespace(gpu_id="v100-0"), 100_000)
    assert len(crashed) == 1 and "was lost" in crashed[0]
    assert 0 < meter.steps < 100_000


def test_a_placer_back_after_a_blip_is_left_to_end_its_flow_run_and_a_lost_one_is_marked_crashed(monkeypatch):
    """Dask cancels a disconnected client's runs even when it is back within a second: the worker
    marked such a flow run Crashed at once, and the placer's Failed came after it (Crashed ->
    Failed, which Prefect never retries). The worker now waits for the placer to come back."""
    from waits import until

    from gogh_flows.flows import decorator

    monkeypatch.setattr(decorator, "PLACER_BACK_GRACE_S", 0.5)
    monkeypatch.setattr(decorator, "_PLACER_POLL_S", 0.02)
    crashed: list[str] = []
    monkeypatch.setattr(decorator, "_mark_crashed", crashed.append)
    # after the wait, only that attempt is marked (a later one may run): the ledger's run id
    monkeypatch.setattr(decorator, "crash_flow_run", lambda run_id, message: crashed.append(f"{run_id}: {message}"))
    def gpu(placer_connected, run_id: str) -> types.SimpleNamespace:  # what the mark reads of a GpuContext
        return types.SimpleNamespace(placer_connected=placer_connected, run_id=run_id)

    back = iter([False, False, True])
    asked_back: list[bool] = []
    decorator._mark_crashed_unless_placer_back(gpu(lambda: asked_back.append(True) or next(back), "r#1"), "blip")
    asked_gone: list[bool] = []
    decorator._mark_crashed_unless_placer_back(gpu(lambda: asked_gone.append(True) and None, "r#2"), "lost")
    until(lambda: crashed, "the lost placer's flow run marked crashed", timeout_s=10)
    time.sleep(0.2)
    assert crashed == ["r#2: lost"] and len(asked_back) == 3 and len(asked_gone) >= 3
    decorator._mark_crashed_unless_placer_back(gpu(None, "r#3"), "no lease")  # nobody to ask: at once
    assert crashed == ["r#2: lost", "no lease"]


_meet = threading.Barrier(2)


def _together(steps: float) -> tuple[str, ...]:
    _meet.wait(timeout=30)  # both runs are on the GPU before either advances
    ctx = current_gpu()
    partners = ctx.partners
    ctx.advance(steps)
    _meet.wait(timeout=30)
    return partners


def test_co_located_runs_see_each_other_and_run_at_paired_speed(pool):
    fa = pool.submit(_together, 60, gpu_id="t4-1", job_type="a", run_id="run-a")
    fb = pool.submit(_together, 40, gpu_id="t4-1", job_type="b", run_id="run-b")
    a, b = fa.result(), fb.result()
    assert a.value == ("b",) and b.value == ("a",)
    assert a.partners == ("b",) and b.partners == ("a",)
    assert a.run_id == "run-a"
    assert a.telemetry.throughput == pytest.approx(30.0)  # a's paired rate on a T4
    assert b.telemetry.throughput == pytest.approx(20.0)
    assert a.telemetry.energy_j == pytest.approx(b.telemetry.mean_power_w * 2.0)  # same device power


def test_partners_override_uses_the_given_partner(pool):
    outcome = pool.run(_advance, 12, gpu_id="k80-0", job_type="a", partners=["b"])
    assert outcome.partners == ("b",)
    assert outcome.telemetry.throughput == pytest.approx(12.0)


_live = {"now": 0, "max": 0}
_live_lock = threading.Lock()


def _occupy() -> None:
    with _live_lock:
        _live["now"] += 1
        _live["max"] = max(_live["max"], _live["now"])
    time.sleep(0.2)
    with _live_lock:
        _live["now"] -= 1


def test_dask_never_runs_more_bodies_than_capacity(pool):
    for f in [pool.submit(_occupy, gpu_id="k80-1", job_type="a") for _ in range(5)]:
        f.result()
    assert 1 <= _live["max"] <= pool.device("k80-1").capacity


def _fail() -> None:
    current_gpu().report(3)
    raise ValueError("body broke")


def test_failed_body_still_yields_telemetry_and_unwrap_reraises(pool):
    outcome = pool.run(_fail, gpu_id="t4-0", job_type="b")
    assert not outcome.ok and outcome.error == "ValueError: body broke"
    assert "body broke" in outcome.traceback
    assert outcome.telemetry.steps == 3 and outcome.telemetry.energy_j >= 0
    with pytest.raises(ValueError, match="body broke"):
        outcome.unwrap()
    assert pool.run(_advance, 1, gpu_id="t4-0", job_type="b").unwrap() == 1


def test_advance_needs_a_job_type_the_truth_knows(pool):
    outcome = pool.run(_advance, 1, gpu_id="v100-0")
    assert "needs the run's job type" in outcome.error
    with pytest.raises(EmulationError):
        outcome.unwrap()
    outcome = pool.run(_advance, 1, gpu_id="v100-0", job_type="zzz")
    assert "'zzz' is not in the throughput table" in outcome.error


def test_report_only_body_is_measured_over_wall_time(pool):
    def body():
        current_gpu().report(10)
        time.sleep(0.05)

    t = pool.run(body, gpu_id="v100-0", job_type="b").telemetry
    assert t.steps == 10 and t.duration_s == t.wall_s and t.duration_s > 0
    assert t.mean_power_w == pytest.approx(40 + 0.5 * 260)
    assert t.energy_j == pytest.approx(t.mean_power_w * t.duration_s)


def test_closed_pool_refuses_work():
    with emulated_pool("k80=1", truth=small_truth(), capacity=1) as p:
        assert p.device("k80-0").capacity == 1
        assert p.run(_where, gpu_id="k80-0").value[0] == "k80-0"
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(_where, gpu_id="k80-0")


# -- remote --------------------------------------------------------------------------
def _cluster(workers: dict[str, dict]) -> SpecCluster:
    spec = {name: {"cls": Worker, "options": {"name": name, "nthreads": 2, **opts}}
            for name, opts in workers.items()}
    return SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {
        "dashboard": False, "dashboard_address": ":0", "host": "127.0.0.1"}}, silence_logs=40)


def test_remote_pool_discovers_gpus_from_worker_names_and_resources(monkeypatch):
    monkeypatch.setenv("GOGH_EMULATED", "1")
    with _cluster({"v100-0": {"resources": {"slot": 2}}, "t4-0": {"resources": {"slot": 1}}}) as cluster:
        with remote_pool(cluster.scheduler_address, truth=small_truth()) as p:
            assert p.mode == "remote" and p.address == cluster.scheduler_address
            assert {d.id: (d.gpu_type, d.capacity) for d in p.devices} == {
                "v100-0": ("v100", 2), "t4-0": ("t4", 1)}
            assert p.is_emulated("t4-0")
            outcome = p.run(_advance, 50, gpu_id="t4-0", job_type="a")
            assert outcome.worker == "t4-0" and outcome.telemetry.duration_s == pytest.approx(1.0)
            assert p.run(_where, gpu_id="v100-0").value == ("v100-0", "v100-0", "cpu", "remote")
        # Closing a remote pool leaves the scheduler and workers running.
        assert len(cluster.scheduler_info["workers"]) == 2


def test_misconfigured_remote_worker_is_left_out_with_a_warning_naming_it(monkeypatch, caplog, capsys):
    monkeypatch.setenv("GOGH_EMULATED", "1")
    with _cluster({"x100-0": {"resources": {"slot": 2}}, "v100-0": {"resources": {"slot": 2}},
                   "box": {"resources": {"slot": 2}}}) as cluster:
        with caplog.at_level("WARNING", logger="gogh_flows.runtime"):
            with remote_pool(cluster.scheduler_address, min_workers=3) as p:
                assert p.gpu_ids == ("v100-0",)  # the others are left out, the pool still serves
                # the workers left out were looked at once: a placement does not re-read the pool
                # for them (and warn again), as it did on every call
                members = {"x100-0", "v100-0", "box"}
                assert [d.id for d in p.live_devices(members)] == ["v100-0"]
                assert caplog.text.count("worker 'box'") == 1
                # `gogh pool status` does not count them as idle GPUs
                from gogh_flows.cli import main

                p.ledger.state()  # the ledger plugin, as the first placement registers it
                assert main(["pool", "status", cluster.scheduler_address]) == 0
                out = " ".join(capsys.readouterr().out.split())
                assert "1 idle: v100-0; 2 left out of the pool (misconfigured or not answering): box, x100-0" in out
                # ... but looked at again once a while has passed: 'box' fixed and restarted
                # under the same name is found, and nothing is warned twice meanwhile
                from gogh_flows.runtime import pool as pool_mod

                fixed = _remote_device("tcp://h:1", "v100-1", {"resources": {"slot": 2}}, {})
                box = dataclasses.replace(fixed, id="box", worker="box")
                p._rediscover = lambda: ([*p.devices, box], {**p._pins, "box": "box"}, set(), members, {"x100-0"})
                assert [d.id for d in p.live_devices(members)] == ["v100-0"]  # not yet: too soon
                p._discovered_at -= pool_mod.RECHECK_LEFT_OUT_S
                assert sorted(d.id for d in p.live_devices(members)) == ["box", "v100-0"]
        assert "worker 'x100-0'" in caplog.text and "unknown GPU type 'x100'" in caplog.text
        assert "worker 'box'" in caplog.text and "advertises no GPU type" in caplog.text
    with _cluster({"x100-0": {"resources": {"slot": 2}}}) as cluster:
        with pytest.raises(ValueError, match="advertises a usable GPU.*unknown GPU type 'x100'"):
            remote_pool(cluster.scheduler_address)


def test_remote_worker_advertisement_errors():
    with pytest.raises(ValueError, match="advertises no GPU type.*--name v100-0"):
        _remote_device("tcp://h:1", "box", {"resources": {"slot": 2}}, {})
    with pytest.raises(ValueError, match="no 'slot' resource.*--resources slot=2"):
        _remote_device("tcp://h:1", "v100-0", {"resources": {}}, {})
    d = _remote_device("tcp://h:1", "box", {"resources": {"slot": 1}, "host": "h"},
                       {"gpu_type": "A100", "cuda_visible_devices": "3,0"})
    assert (d.id, d.gpu_type, d.capacity, d.cuda_index, d.host) == ("box", "a100", 1, 3, "h")
    # a slot count that is no whole number, or above what a GPU takes, names the worker and the option
    for bad in (1.5, 0, "two", float("inf")):
        with pytest.raises(ValueError, match=rf"worker 'v100-0' \(tcp://h:1\) advertises slot={bad!r}.*slot=2"):
            _remote_device("tcp://h:1", "v100-0", {"resources": {"slot": bad}}, {})
    with pytest.raises(ValueError, match=r"worker 'v100-0' \(tcp://h:1\): .*capacity.*--resources slot=2"):
        _remote_device("tcp://h:1", "v100-0", {"resources": {"slot": 3}}, {})


def test_a_worker_with_fewer_threads_than_slots_is_counted_by_its_threads(caplog):
    """`--nthreads 1 --resources slot=2`: the second run placed there as a pair queued behind the
    first and ran alone after it, measured as if paired, without a word (a review)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        one = _remote_device("tcp://h:9", "a100-2", {"resources": {"slot": 2}, "nthreads": 1}, {})
        _remote_device("tcp://h:9", "a100-2", {"resources": {"slot": 2}, "nthreads": 1}, {})
    assert one.capacity == 1
    said = [r.getMessage() for r in caplog.records if "thread(s) for slot=2" in r.getMessage()]
    assert len(said) == 1 and "--nthreads 2" in said[0], said  # once per worker, with the fix
    assert _remote_device("tcp://h:9", "a100-3", {"resources": {"slot": 2}, "nthreads": 2}, {}).capacity == 2


def test_remote_pool_unreachable_scheduler_is_a_clear_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # refused at once, not after Dask's connect retried it for the whole timeout (a review: 10 s
    # for `gogh pool status` at a port where nothing listened)
    import time

    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"nothing listens at 'tcp://127.0.0.1:{port}' "
                                              r"\(Connection refused\): no scheduler is running there"):
        remote_pool(f"tcp://127.0.0.1:{port}", timeout=20)
    assert time.monotonic() - start < 10


def test_remote_pool_at_a_hung_scheduler_fails_within_its_timeout():
    """A scheduler that accepts connections and never answers (stopped, swapping): the Client's
    handshake alone would hold the placing process for minutes."""
    import socket
    import time

    from gogh_flows.runtime.probe import SchedulerUnreachable

    with socket.create_server(("127.0.0.1", 0)) as hung:  # the kernel accepts; nobody answers
        start = time.monotonic()
        with pytest.raises(SchedulerUnreachable, match="within 2 s .*down or hung"):
            remote_pool(f"tcp://127.0.0.1:{hung.getsockname()[1]}", timeout=2)
        assert time.monotonic() - start < 20


# -- local CUDA ----------------------------------------------------------------------
def test_local_cuda_pool_without_dask_cuda_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask_cuda", None)
    with pytest.raises(RuntimeError, match=r"needs dask-cuda.*install gogh-flows\[cuda\]"):
        local_cuda_pool()


def test_local_cuda_pool_without_driver_says_so(monkeypatch):
    from test_runtime_telemetry import fake_pynvml

    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=object))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error="NVMLError_LibraryNotFound"))
    with pytest.raises(RuntimeError, match="cannot list GPUs: nvmlInit failed.*LibraryNotFound"):
        local_cuda_pool()


class FakeLocalCUDACluster(SpecCluster):
    """dask-cuda's shape: integer worker names, CUDA_VISIBLE_DEVICES rotated per worker."""

    def __init__(self, *, CUDA_VISIBLE_DEVICES, n_workers, threads_per_worker, resources, **_):
        visible = [str(i) for i in CUDA_VISIBLE_DEVICES]
        workers = {i: {"cls": Worker, "options": {"name": i, "nthreads": threads_per_worker,
                                                   "resources": resources}} for i in range(n_workers)}
        super().__init__(workers=workers, scheduler={"cls": Scheduler, "options": {
            "dashboard": False, "dashboard_address": ":0", "protocol": "inproc"}}, silence_logs=40)
        for i in range(n_workers):
            self.worker_spec[i]["options"]["env"] = {"CUDA_VISIBLE_DEVICES": ",".join(visible[i:] + visible[:i])}


def test_local_cuda_pool_maps_boards_to_workers_and_samples_nvml(monkeypatch):
    from test_runtime_telemetry import fake_pynvml

    nvml = fake_pynvml(names=["Tesla V100-SXM2-16GB", "Tesla T4"], power_w=70.0)
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with local_cuda_pool(capacity=2) as p:
        assert p.mode == "local-cuda"
        assert [(d.id, d.worker, d.cuda_index, d.uuid) for d in p.devices] == [
            ("v100-0", "0", 0, "GPU-0"), ("t4-0", "1", 1, "GPU-1")]

        def body():
            ctx = current_gpu()
            ctx.advance(5)  # real GPU: counted, not emulated
            return str(get_worker().name), ctx.torch_device

        outcome = p.run(body, gpu_id="t4-0", job_type="a")
        assert outcome.value == ("1", "cuda:0")
        t = outcome.telemetry
        assert t.source == "nvml" and t.steps == 5 and t.mean_power_w == pytest.approx(70.0)
        assert t.max_memory_bytes == 2 * 2**30 and t.mean_utilisation == pytest.approx(0.75)


def test_remote_gpu_worker_without_nvml_falls_back_to_wall_clock_timing(monkeypatch):
    monkeypatch.delenv("GOGH_EMULATED", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML on this "GPU" host
    monkeypatch.setattr(telemetry_mod, "_warned", False)
    with _cluster({"v100-0": {"resources": {"slot": 2}}}) as cluster:
        with remote_pool(cluster.scheduler_address) as p:
            assert not p.is_emulated("v100-0")
            outcome = p.run(_advance, 100, gpu_id="v100-0", job_type="a")
    # the body succeeded on a real GPU: counted, timed by the wall clock, energy unknown
    assert outcome.ok and outcome.telemetry.source == "wallclock" and outcome.telemetry.steps == 100
    assert outcome.telemetry.energy_j is None
    assert telemetry_mod.nvml_fallback_warned()


@pytest.mark.slow
def test_emulated_pool_with_process_workers():
    with emulated_pool("t4=1", truth=small_truth(), processes=True, capacity=1) as p:
        assert p.address.startswith("tcp://127.0.0.1:")
        outcome = p.run(_advance, 100, gpu_id="t4-0", job_type="a")
    # a alone on a T4: 50 steps/s -> 2 s at 10 + 0.6 * 60 = 46 W -> 92 J
    assert outcome.worker == "t4-0" and outcome.telemetry.energy_j == pytest.approx(92.0)


_BOTH = threading.Barrier(2)


def _report_together(n: int) -> None:
    ctx = current_gpu()
    _BOTH.wait(timeout=30)  # the two runs are on the board together
    for _ in range(n):
        ctx.report()
        time.sleep(0.01)


def test_runs_sharing_a_local_board_split_its_energy_and_never_log_it_twice(monkeypatch):
    from test_runtime_telemetry import fake_pynvml

    nvml = fake_pynvml(names=["NVIDIA H100 80GB HBM3"], power_w=500.0)  # counter = 500 W x t
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    body = _report_together
    _BOTH.reset()
    with local_cuda_pool(capacity=2) as p:
        futures = [p.submit(body, 40, gpu_id="h100-0", job_type="ResNet-50 (batch size 64)"),
                   p.submit(body, 60, gpu_id="h100-0", job_type="LM (batch size 10)")]
        outcomes = [f.result() for f in futures]
    readings = [o.telemetry for o in outcomes]
    assert all(r.source == "nvml" and r.window == "steady" for r in readings)
    assert {o.partners for o in outcomes} == {("LM (batch size 10)",), ("ResNet-50 (batch size 64)",)}
    first_start = min(o.started_at for o in outcomes)
    last_end = max(o.ended_at for o in outcomes)
    board = 500.0 * (last_end - first_start)  # the board's energy while either ran (bodies' clock)
    shares = sum(r.run_energy_j for r in readings)
    assert shares == pytest.approx(board, rel=0.1)  # one board's energy, not two
    for r in readings:  # each run carries a part of the shared stretch, split by the power model
        assert r.run_energy_j < 0.9 * r.board_run_energy_j and "model" in r.energy_split


def test_the_scheduler_probe_works_from_async_code_too():
    """An async flow places from inside a running event loop, where asyncio.run() is refused."""
    import asyncio
    import socket

    from gogh_flows.runtime.probe import SchedulerUnreachable, probe_scheduler

    with socket.create_server(("127.0.0.1", 0)) as hung:
        async def place() -> None:
            probe_scheduler(f"tcp://127.0.0.1:{hung.getsockname()[1]}", 1)

        with pytest.raises(SchedulerUnreachable, match="within 1 s"):
            asyncio.run(place())


@pytest.mark.parametrize("source, warned", [("simulation_throughputs.json", True), ("synthetic(seed=0)", False)])
def test_a_job_type_the_emulated_table_lacks_is_learned_and_a_mixed_truth_is_said(source, warned, caplog):
    """A job type outside the emulated fleet's table runs on synthetic-fleet figures; on a
    measured (Gavel) table that mixes two truths, which a user must be told (docs/user-guide.md)."""
    from gogh_flows.predict.data import zoo_jobs
    from gogh_flows.runtime.worker import _learn_job
    from gogh_flows.truth.table import ThroughputTable

    known = "ResNet-50 (batch size 64)"
    truth = ThroughputTable.from_rows([{"job_type": known, "gpu_type": g, "scale_factor": 1, "throughput": t}
                                       for g, t in (("v100", 10.0), ("k80", 2.0))], source=source)
    new = "ResNet-50 (batch size 48)"
    with caplog.at_level("INFO", logger="gogh_flows"):
        _learn_job(truth, new, zoo_jobs([new])[new])
    assert truth.isolated(new, "v100") > 0 and truth.pair(new, known, "v100")[0] > 0
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert bool(warnings) is warned
    if warned:
        assert "not in the emulated fleet's table" in warnings[0].getMessage()
        assert source in warnings[0].getMessage()


def test_a_tls_address_without_tls_settings_says_what_to_set():
    """Dask refuses it locally with a TypeError, which the probe reported as a server answering
    in another protocol ("check the address")."""
    from gogh_flows.runtime.probe import SchedulerUnreachable, probe_scheduler

    import dask

    # Dask read its environment at import: its configuration is what a Client would use
    with dask.config.set({"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None,
                          "distributed.comm.tls.client.key": None}):
        with pytest.raises(SchedulerUnreachable, match="TLS address, but this process has no TLS client settings.*"
                                                       "DASK_DISTRIBUTED__COMM__TLS__CA_FILE"):
            probe_scheduler("tls://127.0.0.1:1", 1)
    # settings naming a file that is not there: said as such, not a raw error
    with dask.config.set({"distributed.comm.tls.ca-file": "/nonexistent/ca.pem",
                          "distributed.comm.tls.client.cert": "/nonexistent/c.pem"}):
        with pytest.raises(SchedulerUnreachable, match="TLS client settings cannot be used"):
            probe_scheduler("tls://127.0.0.1:1", 1)


def test_a_rediscovery_beside_placements_never_shows_one_discoverys_devices_with_anothers_kinds():
    """A placement asks which of the pool's boards are emulated while another re-reads the pool.
    The devices and their kinds were assigned one after the other, so a reader in between could
    see the new devices with the old kinds: here a real T4 that no discovery ever found. The view
    is now replaced whole. Two threads at once, a switch interval of a microsecond, bounded."""
    from gogh_flows.runtime.pool import GpuPool

    v100, t4 = fleet_devices({"v100": 1})[0], fleet_devices({"t4": 1})[0]
    views = [([v100], {v100.id: v100.worker}, {v100.id}, {v100.worker}, set()),
             ([t4], {t4.id: t4.worker}, {t4.id}, {t4.worker}, set())]
    pool = GpuPool(mode="remote", devices=[v100], client=None, owns_client=False)
    answers: set[tuple] = set()
    stop = time.monotonic() + 1.5
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def rediscover() -> None:
            i = 0
            while time.monotonic() < stop:
                pool._learn(views[i % 2])
                i += 1

        writer = threading.Thread(target=rediscover)
        writer.start()
        while time.monotonic() < stop:
            answers.add(tuple(sorted(pool.emulated_by_type().items())))
        writer.join()
    finally:
        sys.setswitchinterval(old)
    assert answers <= {(("v100", True),), (("t4", True),)}, answers

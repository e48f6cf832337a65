"""Degradation, never a stall: a dead MLflow, a corrupt champion, a fresh home raced by processes."""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from gogh_flows.flows.blocks import PredictorRegistry
from gogh_flows.flows.placer import PlacementTimeout
from gogh_flows.flows.predictors import PredictorSource, models_dir
from gogh_flows.flows.spec import placed_job
from gogh_flows.runtime.leases import Claim, Lease, LedgerState
from gogh_flows.truth.synthetic import synthetic_table


def _dead_http_uri() -> str:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_registry_places_with_the_built_in_prior_at_once(gogh_home, caplog):
    src = PredictorSource(PredictorRegistry(tracking_uri=_dead_http_uri(), refresh_s=0))
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="gogh_flows"):
        first = src.get()
        second = src.get()  # asked again (refresh_s=0): still fast, said once
    assert time.monotonic() - start < 15  # not MLflow's minutes of retries
    assert first is second and src.versions() == {"p1": None, "p2": None}
    assert "unreachable" in src.degraded and "built-in prior 'synthetic'" in src.degraded
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


def _corrupt_source_of(registry, name: str, version: int) -> None:
    source = registry._ready().get_model_version(name, str(version)).source
    folder = Path(source.removeprefix("file://"))
    for f in folder.rglob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")


def test_corrupt_champion_falls_back_to_the_last_good_version_then_to_the_prior(gogh_home, tmp_path, caplog):
    block = PredictorRegistry(refresh_s=0)
    good = PredictorSource(block)
    good.get()
    assert good.versions()["p1"] == 1 and good.degraded is None
    # a new champion whose artifacts are garbage
    copy = tmp_path / "p1"
    shutil.copytree(models_dir() / "synthetic" / "p1", copy)
    v2 = good.registry.register(block.p1_name, copy, alias=block.alias)
    _corrupt_source_of(good.registry, block.p1_name, v2)

    with caplog.at_level("WARNING", logger="gogh_flows"):
        assert good.get() is not None and good.versions()["p1"] == 1  # the loaded one stays in use
        assert f"v{v2}" in good.degraded and "cannot be loaded" in good.degraded
        fetched = []
        good._fetch = lambda *a: fetched.append(a)  # type: ignore[method-assign]
        for _ in range(3):  # asked again while the alias stays on it: not fetched, not said again
            good.get()
    assert not fetched and sum("cannot be loaded" in r.getMessage() for r in caplog.records) == 1
    del good._fetch

    fresh = PredictorSource(block)  # a new process: the last good version cached locally
    fresh.get()
    assert fresh.versions()["p1"] == 1 and "cached locally" in fresh.degraded

    shutil.rmtree(gogh_home / "model-cache")
    bare = PredictorSource(block)  # nothing cached: the built-in prior
    bare.get()
    assert bare.versions() == {"p1": None, "p2": None} and "built-in prior" in bare.degraded


def _register_p2_with(source, block, tmp_path, change) -> int:
    """A copy of the shipped P2 as the new champion, its config.json changed by ``change`` (its
    weights and their hash as they were: what tampering with the records beside them looks like)."""
    import json

    copy = tmp_path / "p2-changed"
    shutil.copytree(models_dir() / "synthetic" / "p2", copy)
    config = json.loads((copy / "config.json").read_text())
    change(config["trained_on"])
    (copy / "config.json").write_text(json.dumps(config))
    return source.registry.register(block.p2_name, copy, alias=block.alias)


@pytest.mark.parametrize("what, change", [
    ("ensemble", lambda t: t["ensemble"]["weights"].__setitem__("isolated", 2.0)),
    ("site offsets", lambda t: t.__setitem__("site_offsets", {"unmeasured": {"t4": float("nan")}})),
    ("intervals", lambda t: t["intervals"]["halfwidths"]["isolated"].__setitem__(0, float("nan"))),
])
def test_a_champion_whose_stored_records_are_out_of_range_is_refused_not_placed_with(gogh_home, tmp_path, what,
                                                                                     change):
    """The records beside a refiner's weights (ensemble, site offsets, intervals) are not covered
    by the weights' hash. One out of range made every placement fail, in a fresh process and in
    one that had a good champion loaded (a security review). Such a champion is refused like
    garbage, and never cached."""
    block = PredictorRegistry(refresh_s=0)
    good = PredictorSource(block)
    good.get()
    assert good.versions()["p2"] == 1 and good.degraded is None
    bad = _register_p2_with(good, block, tmp_path, change)
    assert good.get() is not None and good.versions()["p2"] == 1  # the loaded one stays in use
    assert f"gogh-p2 v{bad}" in good.degraded and f"stored {what}" in good.degraded
    fresh = PredictorSource(block)  # a new process: the last good version cached locally
    fresh.get()
    assert fresh.versions() == {"p1": 1, "p2": 1} and "cached locally" in fresh.degraded
    assert not list((gogh_home / "model-cache").rglob(f"gogh-p2-v{bad}*"))  # nothing of it kept


def test_a_cached_copy_damaged_on_disk_is_downloaded_again(gogh_home, caplog):
    """A cached weights file changed after it was checked (a disk error, a hand edit) made every
    fresh process's placement fail with advice to re-save the model; the registry still has it."""
    block = PredictorRegistry(refresh_s=0)
    PredictorSource(block).get()
    [weights] = (gogh_home / "model-cache").rglob("gogh-p2-v1/weights.safetensors")
    weights.write_bytes(weights.read_bytes()[:-10])
    fresh = PredictorSource(block)
    with caplog.at_level("WARNING", logger="gogh_flows"):
        fresh.get()
    assert fresh.versions() == {"p1": 1, "p2": 1} and fresh.degraded is None
    assert "the cached gogh-p2-v1 did not load any more" in caplog.text


def test_falling_back_skips_cached_versions_that_no_longer_load_and_prefers_the_pair_last_loaded(gogh_home, tmp_path,
                                                                                                caplog):
    """With the registry away, a placement falls back to the versions cached here: the pair this
    machine last loaded (not the newest of each, which may be a demoted champion), and past any
    that do not load any more, down to the built-in prior, never a failed placement."""
    block = PredictorRegistry(refresh_s=0)
    source = PredictorSource(block)
    source.get()
    newer = _register_p2_with(source, block, tmp_path, lambda t: None)  # a good v2, then demoted to v1
    source.get()
    assert source.versions()["p2"] == newer
    source.registry.set_alias(block.p2_name, block.alias, 1)
    source.get()
    assert source.versions()["p2"] == 1  # both cached now; v1 loaded last
    predictor, versions, using = source._fallback_predictor("the registry is away")
    assert versions == (1, 1) and "P2 v1" in using
    # the pair last loaded damaged on disk: set aside, the next cached pair serves
    [weights] = (gogh_home / "model-cache").rglob("gogh-p2-v1/weights.safetensors")
    weights.write_bytes(b"damaged")
    with caplog.at_level("WARNING", logger="gogh_flows"):
        predictor, versions, using = source._fallback_predictor("the registry is away")
    assert versions == (1, newer) and "set aside gogh-p2-v1" in caplog.text
    for p1 in (gogh_home / "model-cache").rglob("gogh-p1-v1/weights.safetensors"):
        p1.write_bytes(b"damaged")
    predictor, versions, using = source._fallback_predictor("the registry is away")
    assert versions == (None, None) and "built-in prior" in using


def test_four_processes_starting_together_on_a_fresh_home_all_place(tmp_path):
    """MLflow's schema creation raced on a fresh SQLite store (3 of 4 processes failed)."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    go = tmp_path / "go"
    code = ("import sys, time, pathlib\n"
            "from gogh_flows.flows.blocks import PredictorRegistry\n"
            "from gogh_flows.flows.predictors import PredictorSource\n"
            "go = pathlib.Path(sys.argv[1])\n"
            "while not go.exists(): time.sleep(0.01)\n"
            "src = PredictorSource(PredictorRegistry())\n"
            "src.get()\n"
            "print(src.versions()['p1'], src.degraded)\n")
    env = {**os.environ, "GOGH_HOME": str(home), "GOGH_MODELS_DIR": str(models_dir())}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(2)
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in outs]
    assert [out.split()[:2] for out, _ in outs] == [["1", "None"]] * 4  # one prior registered, used by all


def test_a_prefect_failure_after_the_claim_does_not_keep_the_slot(gogh_home, monkeypatch, prefect_server):
    """The placement task claimed, then failed to report to Prefect: the claim is freed."""
    import pytest

    from gogh_flows import GpuCluster, gogh_placed
    from gogh_flows.flows import decorator
    from gogh_flows.flows.session import open_sessions

    real = decorator.place_with_retry

    def claims_then_fails(*args, **kwargs):
        real(*args, **kwargs)  # the slot is claimed in the ledger
        raise RuntimeError("Prefect API refused the task's state (HTTP 503)")

    monkeypatch.setattr(decorator, "place_with_retry", claims_then_fails)

    @gogh_placed(model="ResNet-18", batch_size=32, min_throughput=1.0, work_steps=10,
                 cluster=GpuCluster(fleet={"v100": 1}))
    def run() -> None:
        pass

    with pytest.raises(Exception, match="HTTP 503"):
        run()
    (env,) = open_sessions().values()
    assert env.pool.ledger.state().counts.get("claimed") == 1
    assert not env.pool.ledger.state().leases  # released, not refreshed for the life of the process


def _stalling_registry():
    """A loopback 'MLflow server' that passes the health check, then never answers a registry call."""
    import http.server

    release = threading.Event()
    asked: list[str] = []  # the registry calls it received (each then stalls)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.startswith("/health"):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")
                return
            asked.append(self.path)
            release.wait(60)  # stalls until the test ends
            self.send_response(503)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.asked = asked
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, release


def test_a_registry_that_stalls_after_its_health_check_delays_one_placement_by_its_timeout(gogh_home, caplog):
    server, release = _stalling_registry()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        src = PredictorSource(PredictorRegistry(tracking_uri=uri, refresh_s=0, timeout_s=1.0))
        with caplog.at_level("WARNING", logger="gogh_flows"):
            start = time.monotonic()
            first = src.get()
            first_s = time.monotonic() - start
            asked = len(server.asked)
            start = time.monotonic()
            second = src.get()  # the question is still open: not asked, nor waited for, again
            second_s = time.monotonic() - start
        assert first is not None and second is not None
        assert asked >= 1 and len(server.asked) == asked, server.asked
        assert 0.9 <= first_s < 5.0 and second_s < 0.9, (first_s, second_s)  # waiting again takes the 1 s
        assert "did not answer within 1 s" in src.degraded and "built-in prior 'synthetic'" in src.degraded
        assert src.using == "the built-in prior 'synthetic'"  # what `gogh predict` names under its table
        assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1
    finally:
        release.set()
        server.shutdown()


def _place(ledger, *, devices=None, predict=None, **options):
    """One ResNet-50 run (1 step/s) placed by greedy-fastest onto a one-A100 fleet through ``ledger``."""
    from gogh_flows.flows.placer import place_with_retry
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.truth.synthetic import synthetic_table

    table = synthetic_table(["a100"])
    device = GpuDevice(id="a100-0", gpu_type="a100", worker="a100-0", capacity=2)
    settings = {"time_limit_s": 0.1, "wait_timeout_s": 600, "poll_s": 0.1, **options}
    return place_with_retry(_JOB, "r1", devices=devices or (lambda state: [device]), ledger=ledger,
                            predict=predict or (lambda feats: table), features=lambda t: _JOB.features,
                            policy="greedy-fastest", versions={}, **settings)


_JOB = placed_job(model="ResNet-50", batch_size=64, min_throughput=1.0, work_steps=100)


def _two_types(v100_rate: float, t4_rate: float):
    """A V100 (1 slot, held by another run) and a free T4, predicted at these rates for _JOB."""
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.truth.table import ThroughputTable

    rows = [{"job_type": _JOB.job_type, "gpu_type": t, "scale_factor": 1, "throughput": rate}
            for t, rate in (("v100", v100_rate), ("t4", t4_rate))]
    table = ThroughputTable.from_rows(rows, source="hand-made")
    v100 = GpuDevice(id="v100-0", gpu_type="v100", worker="v100-0", capacity=1)
    t4 = GpuDevice(id="t4-0", gpu_type="t4", worker="t4-0", capacity=1)

    class Ledger:
        def __init__(self) -> None:
            self.claimed: list[str] = []

        def state(self, *, timeout_s=None):
            now = time.time()
            busy = (Lease(run_id="x", gpu_id="v100-0", worker="v100-0", job_type=_JOB.job_type,
                          required_throughput=2.0, work=1e9, claimed_at=now, seen_at=now, started_at=now,
                          cancel=False),)
            return LedgerState(now=now, lease_timeout_s=30.0, versions={"v100-0": 1}, leases=busy,
                               workers=frozenset({"v100-0", "t4-0"}), counts={})

        def claim(self, run_id, gpu_id, *, timeout_s=None, **kwargs):
            self.claimed.append(gpu_id)
            return Claim(ok=True, version=1)

    return table, [v100, t4], Ledger()


def test_headroom_is_kept_while_the_type_that_clears_it_is_busy():
    """A run whose requirement only a busy type meets with headroom waits for it up to
    headroom_wait_s, then takes a GPU that meets the requirement itself; the headroom is dropped
    at once when no type of the fleet could clear it (it was dropped whenever the fleet was busy,
    and a T4 predicted 2.6% above the requirement measured below it)."""
    job = placed_job(model="ResNet-50", batch_size=64, min_throughput=2.0, work_steps=100)
    table, devices, ledger = _two_types(v100_rate=4.6, t4_rate=2.05)
    from gogh_flows.flows.placer import place_with_retry

    said: list[str] = []
    now = [0.0]
    with pytest.MonkeyPatch.context() as mp:  # a clock the waits advance, so the test does not sleep
        mp.setattr("gogh_flows.flows.placer.time.monotonic", lambda: now[0])

        def sleep(s: float) -> None:
            if s > 0:
                assert ledger.claimed == [], "the T4 was taken before the wait for the V100 ended"
            now[0] += s

        placed = place_with_retry(job, "r1", devices=lambda state: devices, ledger=ledger,
                                  predict=lambda feats: table, features=lambda t: job.features,
                                  policy="greedy-fastest", versions={}, headroom=0.1, headroom_wait_s=10.0,
                                  time_limit_s=0.1, wait_timeout_s=600.0, poll_s=5.0, sleep=sleep,
                                  on_wait=said.append)
    # waited headroom_wait_s for the V100, then took the T4 that meets 2.0 itself (not at the
    # end of wait_timeout_s: a GPU meeting the requirement is not left idle for ten minutes)
    assert now[0] == 10.0 and placed.gpu_id == "t4-0" and ledger.claimed == ["t4-0"]
    assert "planned against 2.2 with the policy's headroom for 10 s more (10 s from the placement's start)" in said[0]
    assert "no GPU cleared its requirement with the policy's headroom (10%) within 10 s" in said[-1]
    # with no type that could clear 2.0 x 1.1 (the V100 as slow as the T4), the T4 is taken at once
    table, devices, ledger = _two_types(v100_rate=2.0, t4_rate=2.05)
    placed = place_with_retry(job, "r2", devices=lambda state: devices, ledger=ledger, predict=lambda feats: table,
                              features=lambda t: job.features, policy="greedy-fastest", versions={}, headroom=0.1,
                              time_limit_s=0.1, wait_timeout_s=0.3, poll_s=0.1)
    assert placed.gpu_id == "t4-0" and ledger.claimed == ["t4-0"]


def test_deciding_is_bounded_by_placement_timeout_s_apart_from_waiting():
    class Contended:
        """Every claim is refused as 'changed': other runs keep winning the GPU."""

        def state(self, *, timeout_s=None):
            return LedgerState(now=time.time(), lease_timeout_s=30.0, versions={}, leases=(),
                               workers=frozenset({"a100-0"}), counts={})

        def claim(self, *args, timeout_s=None, **kwargs):
            time.sleep(0.05)
            return Claim(ok=False, version=1, reason="changed")

    class Free(Contended):
        def claim(self, *args, timeout_s=None, **kwargs):
            return Claim(ok=True, version=1)

    # a first decision imports the solver and the predictors' modules (seconds when this test runs
    # alone): warmed up, the time measured below is the loop's own
    assert _place(Free()).gpu_id == "a100-0"
    start = time.monotonic()
    with pytest.raises(PlacementTimeout, match=r"placement_timeout_s=0\.5 s.*claim\(s\) refused|claim\(s\) refused.*placement_timeout_s=0\.5"):
        _place(Contended(), placement_timeout_s=0.5)
    assert time.monotonic() - start < 3.0


def test_a_pool_with_no_live_worker_says_so_not_that_the_fleet_was_busy():
    """With every worker gone nothing is predicted: the wait and the timeout said "best predicted nan
    steps/s ... the fleet can run it but was busy" (a test-suite review)."""

    class Empty:
        def state(self, *, timeout_s=None):
            return LedgerState(now=time.time(), lease_timeout_s=30.0, versions={}, leases=(),
                               workers=frozenset(), counts={})

        def claim(self, *args, timeout_s=None, **kwargs):
            raise AssertionError("nothing to claim on a pool without workers")

    said: list[str] = []
    with pytest.raises(PlacementTimeout) as err:
        _place(Empty(), devices=lambda state: [], wait_timeout_s=0.05, poll_s=0.01, on_wait=said.append)
    message = str(err.value)
    assert "no worker of the pool was alive" in message and "gogh pool status" in message, message
    assert "nan" not in message and "busy" not in message, message
    assert said and "no GPU of the pool has a live worker (required 1 steps/s)" in said[0], said
    assert "nan" not in said[0]


def test_a_scheduler_that_does_not_answer_fails_the_placement_within_its_bound():
    from gogh_flows.runtime import emulated_pool

    with emulated_pool("a100=1", capacity=2) as pool:
        ledger = pool.ledger  # registers the ledger on the scheduler
        scheduler = pool.cluster.scheduler

        async def stalled(**kwargs):
            await asyncio.sleep(30)

        real = scheduler.handlers["gogh_ledger_state"]
        scheduler.handlers["gogh_ledger_state"] = stalled
        try:
            start = time.monotonic()
            with pytest.raises(PlacementTimeout, match=r"did not answer state\(\)"):
                _place(ledger, devices=lambda s: pool.live_devices(s.workers), predict=lambda feats: None,
                       placement_timeout_s=1.0)
            assert time.monotonic() - start < 4.0
        finally:
            scheduler.handlers["gogh_ledger_state"] = real


def test_waiting_on_a_busy_fleet_does_not_use_up_the_placement_bound():
    """placement_timeout_s bounds each decision, not the sum of the decisions of a long wait."""
    table = synthetic_table(["a100"])

    class Full:
        def state(self, *, timeout_s=None):
            now = time.time()
            busy = tuple(Lease(run_id=f"x{i}", gpu_id="a100-0", worker="a100-0", job_type=_JOB.job_type,
                               required_throughput=1.0, work=1e9, claimed_at=now, seen_at=now, started_at=now,
                               cancel=False) for i in range(2))
            return LedgerState(now=now, lease_timeout_s=30.0, versions={"a100-0": 2}, leases=busy,
                               workers=frozenset({"a100-0"}), counts={})

        def claim(self, *args, timeout_s=None, **kwargs):
            raise AssertionError("the GPU is full: nothing to claim")

    def slow_predict(feats):
        time.sleep(0.3)
        return table

    with pytest.raises(PlacementTimeout, match="was busy"):
        _place(Full(), predict=slow_predict, wait_timeout_s=2.0, poll_s=0.05, placement_timeout_s=0.5)


def test_the_explanation_says_what_the_headroom_held_the_run_to():
    """'Rejected slots: 1 too slow' on a T4 predicted above the requirement only makes sense
    beside the headroom the decision applied."""
    from gogh_flows.flows.placer import decide, explain_markdown

    job = placed_job(model="ResNet-50", batch_size=64, min_throughput=2.0, work_steps=100)
    table, devices, _ = _two_types(v100_rate=4.6, t4_rate=2.05)
    placement, problem = decide(job, "r1", devices, [], table, "greedy-fastest", 0.1, headroom=0.1)
    text = explain_markdown(job, "r1", placement, problem, "v100-0", 0.0, {})
    assert "| required throughput | 2 steps/s |" in text
    assert "| planned against | 2.2 steps/s (the policy's headroom of 10%" in text
    # which slot was too slow, and by how much: the T4's prediction beside what it was held to
    assert "**Rejected slots:** 1 too slow (too slow alone: t4 2.05 steps/s predicted, under 2.2)" in text
    placement, problem = decide(job, "r1", devices, [], table, "greedy-fastest", 0.1)
    assert "planned against" not in explain_markdown(job, "r1", placement, problem, "v100-0", 0.0, {})


def test_a_record_landing_while_a_run_decides_never_leaves_it_old_evidence_and_no_pending_mark():
    """The race a full-suite run caught: a run deciding after another of its type tried a lower
    limit read the evidence, then that run's record landed and its pending mark ended, then the
    marks were read (empty): old evidence, no mark, and the level just tried was offered again.
    The marks are read first now; this plays the record landing during the evidence read."""
    from gogh_flows.flows.placer import place_with_retry
    from gogh_flows.runtime.devices import GpuDevice
    from gogh_flows.truth.synthetic import synthetic_table

    table = synthetic_table(["a100"])
    device = GpuDevice(id="a100-0", gpu_type="a100", worker="a100-0", capacity=1)

    class Ledger:
        def state(self, *, timeout_s=None):
            return LedgerState(now=time.time(), lease_timeout_s=30.0, versions={"a100-0": 0}, leases=(),
                               workers=frozenset({"a100-0"}), counts={})

        def claim(self, run_id, gpu_id, *, timeout_s=None, **kwargs):
            return Claim(ok=True, version=1)

    job = placed_job(model="ResNet-50", batch_size=64, min_throughput=1.0, work_steps=100)
    levels = (0.0, 0.25, 0.5, 0.75)

    def place(evidence, measuring):
        return place_with_retry(job, "r", devices=lambda state: [device], ledger=Ledger(),
                                predict=lambda feats: table, features=lambda t: job.features, policy="optimizer",
                                versions={}, time_limit_s=1.0, wait_timeout_s=10.0, poll_s=0.1,
                                power_limit_levels=levels, limit_evidence=evidence, measuring=measuring)

    first = place({}, frozenset).power_limit_w
    assert first is not None
    full_rate = table.isolated(job.job_type, "a100")
    met = {(job.job_type, "a100"): ((first, full_rate, 0.9 * first),)}  # the first limit met it with room
    trial = place(met, frozenset)
    assert trial.limit_trial and trial.power_limit_w < first  # with nothing pending, the level below is tried

    marks = {(job.job_type, "a100")}  # that trial's run: measured, record not yet in

    def evidence_while_the_record_lands():
        old = dict(met)
        marks.clear()  # its record lands now and its mark ends
        return old

    again = place(evidence_while_the_record_lands, lambda: frozenset(marks))
    assert not again.limit_trial, again.explanation_md  # the mark was read first: no blind second trial


def test_a_join_that_changes_the_boards_limit_says_its_partner_runs_at_it_too():
    """A board has one power limit: a join placed at 250 W raised its partner from 175 W, and the
    joiner's artifact said only what the limit saved."""
    from types import SimpleNamespace

    from gogh_flows.flows.placer import _partner_limit
    from gogh_flows.placement.problem import Job

    def problem(limit_w):
        partner = Job("lm", "LM (batch size 20)", 1.0, 100.0, gpus=("a100-0",), power_limit_w=limit_w)
        return SimpleNamespace(occupants=lambda gpu_id: [partner] if gpu_id == "a100-0" else [])

    raised = SimpleNamespace(power_limit_w=250.0)
    assert _partner_limit(problem(175.0), "new", "a100-0", raised) == (
        "; a board has one limit, so its partner runs at it too (it ran at 175 W)")
    assert "it ran at full power" in _partner_limit(problem(None), "new", "a100-0", raised)
    assert _partner_limit(problem(250.0), "new", "a100-0", raised) == ""  # unchanged: nothing to say
    assert _partner_limit(problem(175.0), "new", "t4-0", raised) == ""  # alone: no partner


def test_a_claim_refused_as_released_ends_the_placement_instead_of_deciding_again():
    """The ledger refuses a claim of a run it saw released (a claim given up on, arriving late):
    no decision could change that, so the placement stops at once rather than re-deciding until
    its wait runs out."""
    from gogh_flows.flows.placer import PlacementCancelled
    from gogh_flows.runtime import emulated_pool

    with emulated_pool("a100=1", capacity=2) as pool:
        pool.ledger.release("r1", if_unstarted=True)  # released before any claim of it
        start = time.monotonic()
        with pytest.raises(PlacementCancelled, match="run r1's claim was refused: run r1 was released before"):
            _place(pool.ledger, devices=lambda s: pool.live_devices(s.workers))
        assert time.monotonic() - start < 10


def test_a_cached_copy_another_process_set_aside_mid_read_is_fetched_again_not_refused(gogh_home, monkeypatch):
    """Another process deleting a cached copy (it found it damaged) while this one read it made
    this one refuse a good champion until its alias moved (a review): a copy gone, not refused,
    is downloaded again."""
    import gogh_flows.flows.predictors as predictors_mod

    block = PredictorRegistry(refresh_s=0)
    PredictorSource(block).get()  # cached
    real, calls = predictors_mod.load_p1, []

    def vanishing(folder):
        calls.append(folder)
        if len(calls) == 1:  # the other process's rmtree lands mid-read
            shutil.rmtree(folder)
            raise FileNotFoundError(f"{folder}/weights.safetensors")
        return real(folder)

    monkeypatch.setattr(predictors_mod, "load_p1", vanishing)
    fresh = PredictorSource(block)
    fresh.get()
    assert fresh.versions() == {"p1": 1, "p2": 1} and fresh.degraded is None and not fresh._refused


def test_a_registry_made_again_is_not_served_from_the_old_registrys_cache(gogh_home):
    """Models deleted and registered anew number from 1 again: the local cache, keyed by number,
    served the old v1's weights in place of the new v1's, unsaid (an MLflow review)."""
    import json

    from mlflow import MlflowClient

    source = PredictorSource(PredictorRegistry(refresh_s=0))  # the synthetic prior, v1 of each
    source.get()
    client = MlflowClient(source.block.resolved_tracking_uri())
    for name in ("gogh-p1", "gogh-p2"):
        client.delete_registered_model(name)
    gavel = PredictorSource(PredictorRegistry(refresh_s=0, prior="gavel"))
    gavel.get()
    assert gavel.versions() == {"p1": 1, "p2": 1} and gavel.degraded is None
    for name, sub in (("gogh-p1", "p1"), ("gogh-p2", "p2")):
        [cached] = (gogh_home / "model-cache").rglob(f"{name}-v1/config.json")
        shipped = json.loads((models_dir() / "gavel" / sub / "config.json").read_text())["weights_sha256"]
        assert json.loads(cached.read_text())["weights_sha256"] == shipped, name


def test_a_champion_alias_removed_by_hand_is_said_before_the_prior_takes_it(gogh_home, caplog):
    """An operator deleting a bad champion expects the previous one to serve; the shipped prior
    took the alias silently, and the next retraining was judged against it (an operator's review)."""
    from mlflow import MlflowClient

    block = PredictorRegistry(refresh_s=0)
    source = PredictorSource(block)
    source.get()
    MlflowClient(block.resolved_tracking_uri()).delete_registered_model_alias("gogh-p2", "champion")
    with caplog.at_level("WARNING", logger="gogh_flows"):
        PredictorSource(block).get()
    assert "gogh-p2 in" in caplog.text and "has 1 version(s) but none under the alias 'champion'" in caplog.text
    assert "set_alias('gogh-p2', 'champion', <version>)" in caplog.text


def test_a_champion_pair_not_trained_together_is_said(gogh_home, gogh_models, caplog):
    """Another prior's P1 put under the alias by hand beside the refiner of the first: placements
    loaded the pair silently (an operator's review)."""
    from gogh_flows.tracking.registry import ModelRegistry

    block = PredictorRegistry(refresh_s=0)
    PredictorSource(block).get()
    ModelRegistry(block.resolved_tracking_uri()).register("gogh-p1", gogh_models / "gavel" / "p1", alias="champion",
                                                           tags={"gogh.prior_id": "another-prior"})
    with caplog.at_level("WARNING", logger="gogh_flows"):
        source = PredictorSource(block)
        source.get()
    assert source.versions() == {"p1": 2, "p2": 1}
    assert "the champion pair gogh-p1 v2 and gogh-p2 v1 were not trained together" in caplog.text
    assert "descends from another prior" in caplog.text


def test_a_prior_that_cannot_be_registered_is_tried_again_after_a_growing_pause(gogh_home, monkeypatch, caplog):
    """An artifact root this user cannot write failed every registration of the prior, each
    leaving a FAILED run in MLflow, once per refresh (thousands a day), and was said to be an
    unreachable registry (an MLflow review)."""
    from gogh_flows.tracking.registry import ModelRegistry

    calls = []

    def refused(self, *args, **kwargs):
        calls.append(args[0])
        raise NotADirectoryError(20, "Not a directory", "/srv/mlartifacts/x")

    monkeypatch.setattr(ModelRegistry, "ensure_registered", refused)
    source = PredictorSource(PredictorRegistry(refresh_s=0))
    with caplog.at_level("WARNING", logger="gogh_flows"):
        for _ in range(5):
            source.get(force=True)
    assert len(calls) == 1, calls  # one attempt, then a pause of 30 s at least
    assert "failed (NotADirectoryError" in source.degraded and "unreachable" not in source.degraded
    assert "built-in prior" in source.degraded
    source._prior_failed = (0.0, 30.0, source._prior_failed[2])  # the pause is over
    source.get(force=True)
    assert len(calls) == 2 and source._prior_failed[1] == 60.0  # and the next one is twice as long


def test_a_copy_another_process_cached_meanwhile_is_kept_not_replaced(gogh_home):
    """Two processes filling an empty cache together: the later one set the earlier one's copy
    aside and deleted it, and a process reading it then refused a good champion (a review)."""
    block = PredictorRegistry(refresh_s=0)
    first, second = PredictorSource(block), PredictorSource(block)
    first.ensure_prior()
    real = second.registry.download

    theirs = []

    def while_the_other_caches(uri, dest):
        out = real(uri, dest=dest)
        other = threading.Thread(target=lambda: theirs.append(first._fetch("gogh-p1", 1)))  # own staging folder
        other.start()  # the other's copy lands while this one downloads
        other.join()
        theirs.append((theirs[0] / "config.json").stat().st_ino)
        return out

    second.registry.download = while_the_other_caches
    kept = second._fetch("gogh-p1", 1)
    assert kept == theirs[0] and (kept / "config.json").stat().st_ino == theirs[1]  # the first's copy, untouched
    assert not [p for p in kept.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_prior_missing_where_the_block_says_falls_back_to_the_cached_versions(gogh_home, tmp_path, monkeypatch):
    """An empty registry, the prior's folder gone, versions cached here: the placement used to fail
    (a ValueError) where it had fallen back before (a review)."""
    from mlflow import MlflowClient

    block = PredictorRegistry(refresh_s=0)
    PredictorSource(block).get()  # v1 of each cached
    client = MlflowClient(block.resolved_tracking_uri())
    for name in ("gogh-p1", "gogh-p2"):
        client.delete_registered_model(name)
    empty = tmp_path / "no-models"
    empty.mkdir()
    monkeypatch.setenv("GOGH_MODELS_DIR", str(empty))
    source = PredictorSource(PredictorRegistry(refresh_s=0))
    source.get()
    assert "the prior 'synthetic' has no p1/" in source.degraded and "cached locally" in source.degraded

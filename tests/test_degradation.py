"""Degradation, never a stall: a dead MLflow, a corrupt champion, a fresh home raced by processes."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path


from gogh_flows.flows.blocks import PredictorRegistry
from gogh_flows.flows.environment import PredictorSource, models_dir


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


def test_four_processes_starting_together_on_a_fresh_home_all_place(tmp_path):
    """MLflow's schema creation raced on a fresh SQLite store (3 of 4 processes failed)."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    go = tmp_path / "go"
    code = ("import sys, time, pathlib\n"
            "from gogh_flows.flows.blocks import PredictorRegistry\n"
            "from gogh_flows.flows.environment import PredictorSource\n"
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
    from gogh_flows.flows.environment import open_environments

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
    (env,) = open_environments().values()
    assert env.pool.ledger.state().counts.get("claimed") == 1
    assert not env.pool.ledger.state().leases  # released, not refreshed for the life of the process

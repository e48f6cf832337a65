"""Fail fast and say why when a pool's worker processes cannot start; show start-up progress.

Issue 18, item 5: a script without ``if __name__ == "__main__":`` that opened a local-cuda
pool re-ran itself in every spawned worker and the pool waited more than seven minutes.
No GPU here: the scripts reach the guard check before anything that needs one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import ClassVar

import pytest

from gogh_flows.runtime.main_guard import (
    check_main_guard,
    guard_advice,
    line_is_guarded,
)

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)  # the interpreter running the suite: make test's .venv, or any other environment


# -- the ast check -----------------------------------------------------------------------
def _line_of(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


GUARDED = {
    "plain guard": '''
        import gogh
        if __name__ == "__main__":
            gogh.pool()  # HERE
    ''',
    "reversed operands": '''
        if "__main__" == __name__:
            gogh.pool()  # HERE
    ''',
    "single quotes, and-ed with more": '''
        if __name__ == '__main__' and len(sys.argv) > 1:
            gogh.pool()  # HERE
    ''',
    "nested if inside the guard": '''
        if __name__ == "__main__":
            if args.gpu:
                for i in range(3):
                    gogh.pool()  # HERE
    ''',
    "guard inside a with block": '''
        with open("log") as fh:
            if __name__ == "__main__":
                gogh.pool()  # HERE
    ''',
    "elif branch": '''
        if sys.argv[1] == "x":
            pass
        elif __name__ == "__main__":
            gogh.pool()  # HERE
    ''',
    "else of a != test": '''
        if __name__ != "__main__":
            pass
        else:
            gogh.pool()  # HERE
    ''',
    "try inside the guard, multi-line call": '''
        if __name__ == "__main__":
            try:
                result = train(
                    epochs=3,  # HERE
                )
            except KeyboardInterrupt:
                pass
    ''',
}

UNGUARDED = {
    "top level call": '''
        import gogh
        gogh.pool()  # HERE
    ''',
    "call after a guard block": '''
        if __name__ == "__main__":
            main()
        gogh.pool()  # HERE
    ''',
    "else of an == guard": '''
        if __name__ == "__main__":
            main()
        else:
            gogh.pool()  # HERE
    ''',
    "an unrelated if": '''
        if DEBUG:
            gogh.pool()  # HERE
    ''',
    "__name__ compared with something else": '''
        if __name__ == "main":
            gogh.pool()  # HERE
    ''',
    "or-ed guard": '''
        if __name__ == "__main__" or FORCE:
            gogh.pool()  # HERE
    ''',
    "print of a decorated flow's result": '''
        @gogh_placed(model="ResNet-50", batch_size=64, min_throughput=2.0, work_steps=1000)
        def train():
            return 1
        print(train())  # HERE
    ''',
    "with block at top level": '''
        with local_cuda_pool() as pool:
            pool.run(f, gpu_id="v100-0")  # HERE
    ''',
}


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_lines_under_the_guard_are_guarded(name):
    source = textwrap.dedent(GUARDED[name])
    assert line_is_guarded(source, _line_of(source, "# HERE"))


@pytest.mark.parametrize("name", sorted(UNGUARDED))
def test_lines_outside_the_guard_are_not(name):
    source = textwrap.dedent(UNGUARDED[name])
    assert not line_is_guarded(source, _line_of(source, "# HERE"))


def test_the_decorator_line_of_a_top_level_def_is_not_guarded():
    source = textwrap.dedent('''
        @gogh_placed(cluster=open_it())
        def train():
            if __name__ == "__main__":
                pass
    ''')
    assert not line_is_guarded(source, 2)


def test_advice_wraps_the_callers_own_statement():
    from gogh_flows.runtime.main_guard import UnguardedCall

    advice = guard_advice(UnguardedCall(path="/x/train.py", line=9, statement="print(train())"))
    assert advice == 'if __name__ == "__main__":\n    print(train())'
    assert guard_advice() == 'if __name__ == "__main__":\n    main()'


def test_the_check_passes_under_pytest():
    # pytest's own entry point is guarded: the check looks at the main module's frame only
    check_main_guard()


# -- scripts, run the way a user runs them ---------------------------------------------------
def _run_script(tmp_path: Path, body: str, env: dict[str, str] | None = None,
                timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    began = time.monotonic()
    proc = subprocess.run([str(PYTHON), str(script)], cwd=tmp_path, capture_output=True, text=True, check=False,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - began


def test_script_without_guard_fails_at_once_naming_the_guard(tmp_path):
    proc, took = _run_script(tmp_path, '''
        from gogh_flows.runtime.pool import local_cuda_pool

        print("opening the pool")
        pool = local_cuda_pool(capacity=2)
        print("unreachable")
    ''')
    assert proc.returncode != 0 and took < 60
    assert "unreachable" not in proc.stdout
    err = proc.stderr
    assert "MainGuardMissing" in err, err
    assert f"{(tmp_path / 'train.py').resolve()}, line 5" in err
    assert 'outside an `if __name__ == "__main__":` block' in err
    # what to write, with the user's own line under the guard
    assert 'if __name__ == "__main__":\n        pool = local_cuda_pool(capacity=2)' in err


def test_a_packages_main_run_with_dash_m_needs_no_guard(tmp_path):
    # multiprocessing never re-runs a package's __main__ in a spawned worker
    pkg = tmp_path / "trainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(textwrap.dedent('''
        from gogh_flows.runtime.main_guard import check_main_guard

        check_main_guard()
        print("check passed")
    '''))
    proc = subprocess.run([str(PYTHON), "-m", "trainpkg"], cwd=tmp_path, capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 0 and "check passed" in proc.stdout, proc.stderr


def test_script_with_guard_passes_the_check(tmp_path):
    proc, _ = _run_script(tmp_path, '''
        from gogh_flows.runtime.main_guard import check_main_guard


        def main():
            check_main_guard()
            print("check passed")


        if __name__ == "__main__":
            main()
    ''')
    assert proc.returncode == 0, proc.stderr
    assert "check passed" in proc.stdout


def test_script_with_guard_reaches_what_follows_the_check(tmp_path):
    # this machine has no dask-cuda: with the guard, local_cuda_pool gets as far as saying so
    pytest.importorskip("distributed")
    try:
        import dask_cuda  # noqa: F401
        pytest.skip("dask-cuda is installed here: local_cuda_pool would go on to start a cluster")
    except ImportError:
        pass
    proc, _ = _run_script(tmp_path, '''
        from gogh_flows.runtime.pool import local_cuda_pool

        if __name__ == "__main__":
            local_cuda_pool()
    ''')
    assert proc.returncode != 0
    assert "needs dask-cuda" in proc.stderr and "MainGuardMissing" not in proc.stderr


def test_unguarded_script_opening_the_pool_from_a_thread_is_caught(tmp_path):
    # an async flow runs its body on a worker thread while the main thread waits at the call
    proc, _ = _run_script(tmp_path, '''
        import threading
        from gogh_flows.runtime.main_guard import check_main_guard

        seen = []
        def body():
            try:
                check_main_guard()
                seen.append("passed")
            except Exception as exc:
                seen.append(type(exc).__name__)

        t = threading.Thread(target=body); t.start(); t.join()
        print(seen)
    ''')
    assert proc.returncode == 0, proc.stderr
    assert "['MainGuardMissing']" in proc.stdout


def test_fork_start_method_or_the_opt_out_skip_the_check(tmp_path):
    proc, _ = _run_script(tmp_path, '''
        import os
        import dask
        from gogh_flows.runtime.main_guard import check_main_guard

        with dask.config.set({"distributed.worker.multiprocessing-method": "fork"}):
            check_main_guard()   # fork does not re-import the script
        os.environ["GOGH_SKIP_MAIN_GUARD_CHECK"] = "1"
        check_main_guard()
        print("skipped")
    ''')
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stdout


# -- the start-up bound ------------------------------------------------------------------------
class HangingCluster:
    """A cluster whose constructor starts a worker process and then waits for it for ever."""

    instances: ClassVar[list[HangingCluster]] = []

    def __init__(self, **options):
        self.closed = False
        self.options = options
        HangingCluster.instances.append(self)
        ctx = multiprocessing.get_context("spawn")
        self.child = ctx.Process(target=time.sleep, args=(300,), daemon=True)
        self.child.start()
        threading.Event().wait()

    def close(self, timeout=None):
        self.closed = True


def test_a_cluster_that_does_not_start_is_given_up_and_closed():
    from gogh_flows.runtime.pool import PoolStartTimeout, _start_within

    HangingCluster.instances.clear()
    began = time.monotonic()
    with pytest.raises(PoolStartTimeout) as info:
        _start_within(HangingCluster, {"n_workers": 1}, deadline=time.monotonic() + 3.0,
                      what="a test cluster (1 worker process)")
    took = time.monotonic() - began
    assert took < 20
    message = str(info.value)
    assert "starting a test cluster (1 worker process) did not finish within 3 s" in message
    assert "what it had started was closed" in message
    assert "bootstrapping phase" in message and 'if __name__ == "__main__":' in message
    assert "GOGH_POOL_START_TIMEOUT_S" in message
    cluster = HangingCluster.instances[-1]
    assert cluster.closed and cluster.options == {"n_workers": 1}
    cluster.child.join(10)
    assert not cluster.child.is_alive()  # the worker process it started was stopped


def test_a_constructor_error_is_raised_as_it_is():
    from gogh_flows.runtime.pool import _start_within

    class Broken:
        def __init__(self, **options):
            raise OSError("no port")

    with pytest.raises(OSError, match="no port"):
        _start_within(Broken, {}, deadline=time.monotonic() + 5, what="x")


def test_local_cuda_pool_gives_up_on_a_hanging_cluster(monkeypatch):
    from test_power_cap import fake_nvml

    from gogh_flows.runtime.pool import PoolStartTimeout, local_cuda_pool

    class Hanging(HangingCluster):
        def __init__(self, **options):
            self.closed = False
            HangingCluster.instances.append(self)
            threading.Event().wait()

    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=Hanging))
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(["Tesla V100-SXM2-16GB", "Tesla T4"]))
    began = time.monotonic()
    with pytest.raises(PoolStartTimeout, match=r"starting dask-cuda's LocalCUDACluster \(2 worker process\(es\), "
                                               r"one per GPU: 0 Tesla V100-SXM2-16GB, 1 Tesla T4\) did not finish "
                                               r"within 2 s"):
        local_cuda_pool(start_timeout_s=2)
    assert time.monotonic() - began < 20
    assert HangingCluster.instances[-1].closed


def test_the_start_timeout_comes_from_the_environment(monkeypatch):
    from gogh_flows.runtime.pool import START_TIMEOUT_S, _start_timeout

    monkeypatch.delenv("GOGH_POOL_START_TIMEOUT_S", raising=False)
    assert _start_timeout() == START_TIMEOUT_S == 60
    monkeypatch.setenv("GOGH_POOL_START_TIMEOUT_S", "150")
    assert _start_timeout() == 150 and _start_timeout(5) == 5
    monkeypatch.setenv("GOGH_POOL_START_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="GOGH_POOL_START_TIMEOUT_S must be a number of seconds"):
        _start_timeout()


# -- progress while the first run starts things ----------------------------------------------
def test_first_session_says_what_it_starts_and_later_ones_say_nothing(gogh_home, caplog):
    from gogh_flows.flows.blocks import GpuCluster
    from gogh_flows.flows.session import shared_session

    cluster = GpuCluster(fleet={"v100": 1})
    uri = f"sqlite:///{gogh_home / 'mlflow.db'}"
    # no caplog.set_level: the lines must pass gogh's logger at its default level
    # this call's own lines: a registry thread an earlier test left loading (daemon, degraded
    # registry) may finish and log its "predictors ready" line while this test runs
    def ours() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "gogh_flows.startup" and r.thread == threading.get_ident()]

    shared_session(cluster, uri)
    lines = [r.getMessage() for r in ours()]
    assert all(r.levelno == logging.INFO for r in ours())
    started = [m for m in lines if m.startswith("gogh: starting ")]
    ready = [m for m in lines if " ready in " in m]
    assert started == [
        "gogh: starting the emulated fleet's throughput table (synthetic, v100) ...",
        "gogh: starting the Dask GPU pool (emulated: v100=1, one worker thread per GPU) ...",
        f"gogh: starting the MLflow measurement store ({uri}) ...",
    ]
    assert [m.split(" ready in ")[0] for m in ready] == [
        "gogh: the emulated fleet's throughput table", "gogh: the Dask GPU pool", "gogh: the MLflow measurement store"]
    assert all(m.endswith(" s") for m in ready)
    caplog.clear()
    shared_session(cluster, uri)  # already open: nothing starts, nothing is said
    assert not ours()


def test_start_up_lines_mask_a_password_in_the_tracking_uri():
    from gogh_flows.tracking.backend import masked_uri as _safe_uri

    assert _safe_uri("postgresql://gogh:s3cret@db:5432/mlflow") == "postgresql://gogh:***@db:5432/mlflow"
    assert _safe_uri("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_start_up_lines_show_on_the_console_by_default(tmp_path):
    """A user's script, no logging set up: the first session prints its progress on stderr."""
    proc, _ = _run_script(tmp_path, f'''
        from gogh_flows.flows.blocks import GpuCluster
        from gogh_flows.flows.session import close_all, shared_session

        if __name__ == "__main__":
            shared_session(GpuCluster(fleet={{"t4": 1}}), "sqlite:///{tmp_path / 'mlflow.db'}")
            close_all()
    ''', env={"GOGH_HOME": str(tmp_path / "gogh")}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gogh: starting the Dask GPU pool (emulated: t4=1, one worker thread per GPU) ..." in proc.stderr
    assert "gogh: the Dask GPU pool ready in " in proc.stderr
    assert "gogh: the MLflow measurement store ready in " in proc.stderr

import json
import re

import pytest

from gogh_flows.cli import main
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS


def test_a_command_imports_only_its_own_parser_and_an_unknown_one_lists_every_command(capsys):
    """`gogh pool status` must not pay for torch and OR-Tools (5 s on 2 cores) to parse its line."""
    import subprocess
    import sys

    from gogh_flows.cli import _COMMAND_MODULES, _OWN_COMMANDS, build_parser

    choices = set(build_parser()._subparsers._group_actions[0].choices)
    assert choices == _OWN_COMMANDS | set(_COMMAND_MODULES)  # the two lists name every command
    code = ("import sys\nfrom gogh_flows.cli import main\ntry:\n    main(['pool', 'status', '--help'])\n"
            "except SystemExit:\n    pass\nprint([m for m in ('torch', 'ortools') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr
    with pytest.raises(SystemExit):
        main(["simulat"])
    err = capsys.readouterr().err
    assert "invalid choice: 'simulat'" in err and "'simulate'" in err and "'pool'" in err


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"gogh {version('gogh-flows')}"


def test_bench_placement_writes_the_three_figures(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", "placement", "--gpus", "32", "--running", "40", "--arrivals", "4",
               "--repeat", "3", "--seed", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"p50_ms", "p99_ms", "max_gap"} <= set(data)
    assert 0 < data["p50_ms"] <= data["p99_ms"]
    assert 0 <= data["max_gap"] <= 0.01
    assert json.loads(capsys.readouterr().out) == data


def test_demo_prints_explanations_and_every_policy(capsys):
    assert main(["demo", "--wave-only"]) == 0
    out = capsys.readouterr().out
    for name in ("optimizer", "first-fit", "random", "greedy-fastest", "greedy-min-power", "greedy-efficiency"):
        assert name in out
    assert "runner_up" in out
    # the full demo's options do nothing with --wave-only: refused, not ignored
    assert main(["demo", "--wave-only", "--wave-size", "6", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "--wave-size, --out apply to the full demo" in err and "Traceback" not in err


def test_cli_reports_bad_input_without_a_traceback(capsys):
    assert main(["bench", "placement", "--gpus", "0"]) == 2
    assert "--gpus must be a whole number >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "placement", "--gpus", "4", "--arrivals", "-1"]) == 2
    assert "--arrivals must be a whole number >= 1, got -1" in capsys.readouterr().err
    assert main(["bench", "placement", "--gpus", "8", "--running", "100"]) == 2
    assert "--running 100 fills every slot of 8 GPUs" in capsys.readouterr().err


def test_simulate_refuses_an_empty_trace(gavel_dir, tmp_path, capsys):
    empty = tmp_path / "empty.trace"
    empty.write_text("")
    rc = main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace", str(empty),
               "--cluster", "v100=2"])
    assert rc == 2 and "has no jobs to simulate" in capsys.readouterr().err
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace",
                 "generate:0", "--cluster", "v100=2"]) == 2
    assert "N >= 1" in capsys.readouterr().err


def test_pool_status_prints_who_holds_what(capsys):
    from gogh_flows.runtime import emulated_pool

    with emulated_pool("v100=1,t4=1", processes=True, capacity=2) as pool:
        address = pool.address
        assert main(["pool", "status", address]) == 0
        assert "no gogh ledger yet" in capsys.readouterr().out
        seen = pool.ledger.state()
        assert main(["pool", "status", address]) == 0  # a ledger, nothing claimed: said, not a trailing "; "
        assert "workers: 2 (2 idle: t4-0, v100-0); no claims yet" in capsys.readouterr().out
        assert pool.ledger.claim("run-7", "t4-0", worker="t4-0", capacity=2, job_type="A3C",
                                 required_throughput=2.0, work=10.0, expect_version=seen.version("t4-0")).ok
        assert main(["pool", "status", address]) == 0
        out = capsys.readouterr().out
        assert "run-7" in out and "t4-0" in out and "queued" in out and "1 idle: v100-0" in out
        assert main(["pool", "status", address, "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
        assert [lease["run_id"] for lease in state["leases"]] == ["run-7"]


def _loopback_server(reply: bytes | None):
    """A loopback TCP server that answers every connection with ``reply``, or never answers."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if reply is not None:
                conn.recv(4096)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return server, held


@pytest.mark.parametrize(("reply", "match"), [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4, "answered, but not as a Dask scheduler"),
    (None, "answered as a Dask scheduler within 2 s"),
])
def test_pool_status_at_something_that_is_not_a_scheduler_fails_in_its_timeout(reply, match, capsys):
    import time

    server, held = _loopback_server(reply)
    try:
        start = time.monotonic()
        assert main(["pool", "status", f"tcp://127.0.0.1:{server.getsockname()[1]}", "--timeout", "2"]) == 2
        assert time.monotonic() - start < 30  # before the probe: minutes, or a multi-exabyte allocation
        err = capsys.readouterr().err
        assert match in err and "8787 is its dashboard" in err and "Traceback" not in err
        assert "MemoryError" not in err and "EiB" not in err  # another protocol's bytes, not this machine's memory
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_pool_status_at_a_worker_says_it_is_not_the_scheduler(capsys):
    from gogh_flows.runtime import emulated_pool

    with emulated_pool("v100=1", processes=False, capacity=1) as pool:
        worker = next(iter(pool.client.scheduler_info()["workers"]))
        assert main(["pool", "status", worker, "--timeout", "5"]) == 2
        assert "is a Dask Worker, not the scheduler" in capsys.readouterr().err
    assert main(["pool", "status", "127.0.0.1", "--timeout", "1"]) == 2
    assert "missing port number" in capsys.readouterr().err


def test_simulate_on_gavel_trace_writes_every_policy(gavel_dir, tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
               "--trace", str(gavel_dir / "traces" / "physical_cluster" / "small_test.trace"),
               "--cluster", "v100=2,p100=2,k80=4", "--policy", "oracle,greedy-fastest,first-fit",
               "--seed", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    keys = {"energy_kwh", "sla_attainment", "avg_jct_s", "makespan_s", "avg_queue_s", "migrations",
            "jobs_completed", "decision_p50_ms", "decision_p99_ms"}
    assert set(data["policies"]) == {"oracle", "greedy-fastest", "first-fit"}
    for figures in data["policies"].values():
        assert keys <= set(figures)
        assert 0.0 <= figures["sla_attainment"] <= 1.0
        assert figures["jobs_completed"] == data["jobs"]
        # where the work went: every type of the cluster, busy no longer than its GPUs over the window
        busy, count = figures["busy_gpu_h"], {"v100": 2, "p100": 2, "k80": 4}
        assert set(busy) == set(count) and sum(busy.values()) > 0
        assert all(0 <= busy[t] <= count[t] * figures["window_h"] + 1e-9 for t in count)
    assert data["policies"]["oracle"]["sla_attainment"] == 1.0
    assert png.stat().st_size > 10_000
    assert "v100 busy_gpu_h" in capsys.readouterr().out


def test_simulate_over_seeds_reports_one_window_for_every_policy_and_the_spread(gavel_dir, tmp_path, capsys):
    out = tmp_path / "seeds.json"
    rc = main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
               "--trace", str(gavel_dir / "traces" / "physical_cluster" / "small_test.trace"),
               "--cluster", "v100=2,p100=2,k80=4", "--policy", "oracle,greedy-fastest,first-fit",
               "--seeds", "0,1,2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["seeds"] == [0, 1, 2] and set(data["per_seed"]) == {"0", "1", "2"}
    for figures in data["per_seed"].values():
        window = {f["window_h"] for f in figures.values()}
        assert len(window) == 1  # one window for every policy of a run
        for name, f in figures.items():
            assert f["energy_kwh_on"] >= f["energy_kwh_parked"] > 0
            # a policy's own run ends at or before the window: the window charges it more, never less
            assert f["energy_kwh_on"] >= f["energy_kwh"] - 1e-9
        assert figures["oracle"]["on_vs_oracle"] == 1.0 and figures["greedy-fastest"]["on_vs_greedy-fastest"] == 1.0
        assert figures["first-fit"]["on_vs_greedy-fastest"] == pytest.approx(
            figures["first-fit"]["energy_kwh_on"] / figures["greedy-fastest"]["energy_kwh_on"])
    spread = data["spread"]["first-fit"]["on_vs_oracle"]
    ratios = [data["per_seed"][s]["first-fit"]["on_vs_oracle"] for s in ("0", "1", "2")]
    assert spread == {"mean": pytest.approx(sum(ratios) / 3), "min": min(ratios), "max": max(ratios)}
    assert "over seeds 0, 1, 2" in capsys.readouterr().out
    assert main(["simulate", "--trace", "generate:2", "--cluster", "v100=1", "--seeds", "0,x"]) == 2
    assert "--seeds must be comma-separated integers such as 0,1,2, got '0,x'" in capsys.readouterr().err


def test_simulate_floor_sits_below_every_policy_that_met_its_requirements(gavel_dir, tmp_path, capsys):
    out = tmp_path / "floor.json"
    rc = main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
               "--trace", str(gavel_dir / "traces" / "physical_cluster" / "small_test.trace"),
               "--cluster", "v100=2,p100=2,k80=4", "--policy", "greedy-fastest,oracle,oracle+limits",
               "--seeds", "0,1", "--floor", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["floor"]["limit_levels"] == list(DEFAULT_LIMIT_LEVELS)  # the +limits policies' levels
    for figures in data["per_seed"].values():
        wait, due = figures["floor, may wait"], figures["floor, by greedy-fastest"]
        assert wait["energy_kwh_on"] <= due["energy_kwh_on"] * (1 + 1e-9)
        for name in ("greedy-fastest", "oracle", "oracle+limits"):
            if figures[name]["sla_attainment"] == 1.0:
                assert figures[name]["energy_kwh_on"] >= wait["energy_kwh_on"] * (1 - 1e-6), name
                assert figures[name]["energy_kwh_parked"] >= wait["energy_kwh_parked"] * (1 - 1e-6), name
        # greedy-fastest finished every job by its own finish times: it meets that floor too
        assert figures["greedy-fastest"]["energy_kwh_on"] >= due["energy_kwh_on"] * (1 - 1e-6)
        assert wait["on_vs_greedy-fastest"] == pytest.approx(
            wait["energy_kwh_on"] / figures["greedy-fastest"]["energy_kwh_on"])
    assert "floor, may wait" in data["spread"]
    assert "'floor, may wait': the least any schedule" in capsys.readouterr().err


def test_simulate_generated_arrivals_on_synthetic_fleet(gavel_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GOGH_GAVEL_DIR", str(gavel_dir))  # for the Philly duration distribution
    out = tmp_path / "gen.json"
    rc = main(["simulate", "--trace", "generate:25", "--rate", "20", "--cluster", "h100=8,a100=8,t4=8",
               "--policy", "oracle,random", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["jobs"] == 25 and set(data["policies"]) == {"oracle", "random"}


def test_simulate_announces_jobs_the_fleet_cannot_gang(gavel_dir, tmp_path, monkeypatch, capsys):
    """Too few GPUs of any type for the 4- and 8-GPU gangs: they are dropped, never silently."""
    import pytest

    monkeypatch.setenv("GOGH_GAVEL_DIR", str(gavel_dir))
    out = tmp_path / "small.json"
    rc = main(["simulate", "--trace", "generate:25", "--rate", "20", "--cluster", "h100=2,a100=2,t4=2",
               "--policy", "oracle", "--json", str(out)])
    assert rc == 0
    err = capsys.readouterr().err  # a note for people, not a Python warning with a line of source
    assert re.search(r"^note: dropped \d+ of 25 jobs", err, re.M) and "UserWarning" not in err
    assert json.loads(out.read_text())["jobs"] < 25


def test_simulate_rejects_a_cluster_type_the_truth_lacks(gavel_dir, capsys):
    rc = main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
               "--trace", "generate:5", "--cluster", "h100=2"])
    assert rc == 2
    assert "not in the truth table" in capsys.readouterr().err


def test_demo_environment_creates_a_fresh_home_with_its_parents(tmp_path, monkeypatch):
    """A GOGH_HOME that does not exist yet: Prefect's home must exist before its server starts."""
    from gogh_flows.demo import _setup_env

    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "GOGH_HOME")}
    monkeypatch.setattr(os, "environ", env)  # nothing the demo sets leaks into other tests
    home = tmp_path / "new" / "gogh"
    _setup_env(home / "runs" / "x", home / "prefect")
    assert (home / "prefect").is_dir() and (home / "runs" / "x").is_dir()


@pytest.mark.parametrize("argv", [
    ["power", "evaluate", "--data", "unused", "--test-gpu", "v100", "--json", "/proc/gogh-test/figures.json"],
    ["predictors", "evaluate", "--truth", "synthetic", "--json", "/proc/figures.json"],
    ["predictors", "train", "--truth", "synthetic", "--out", "/proc/gogh-test/models"],
    ["bench", "placement", "--gpus", "4", "--json", "{file}/figures.json"],
])
def test_an_output_that_cannot_be_written_is_refused_before_the_command_runs(argv, tmp_path, capsys):
    """Refused first: had the command run, "unused" data would fail otherwise, training would take minutes."""
    plain_file = tmp_path / "a-file"
    plain_file.write_text("")
    argv = [a.replace("{file}", str(plain_file)) for a in argv]
    assert main(argv) == 2
    assert "cannot be written: nothing can be created in" in capsys.readouterr().err


def test_a_folder_given_as_an_output_file_is_refused_with_a_file_name_to_use(tmp_path, capsys):
    assert main(["bench", "placement", "--gpus", "4", "--json", str(tmp_path)]) == 2
    assert f"is a folder; give a file name in it (e.g. {tmp_path / 'out.json'})" in capsys.readouterr().err
    # `gogh power fit --out` is a file too: refused before the fit, not by a traceback after it (a review)
    assert main(["power", "fit", "--out", str(tmp_path)]) == 2
    assert f"--out '{tmp_path}' is a folder; give a file name in it" in capsys.readouterr().err
    out = tmp_path / "new" / "deeper" / "b.json"  # a missing parent is created, not refused
    assert main(["bench", "placement", "--gpus", "8", "--running", "4", "--arrivals", "1", "--repeat", "1",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["p50_ms"] > 0


@pytest.mark.parametrize(("extra", "match"), [
    (["--trace", "{gavel}/traces"], r"--trace '.*traces' is a folder; give a .trace file in it \(e.g. .*\.trace\)"),
    (["--trace", "{tmp}/nope.trace"], r"--trace '.*nope.trace' not found"),
    (["--trace", "{gavel}/traces/physical_cluster/max_min_fairness.trace", "--rate", "5"],
     "--rate sets the arrivals of --trace generate:N"),
    (["--trace", "generate:5", "--rate", "-3"], "--rate must be arrivals per hour > 0"),
    (["--trace", "generate:5", "--capacity", "0"], "--capacity must be 1"),
    (["--trace", "generate:5", "--p1-epochs", "0"], "--p1-epochs must be a whole number of epochs >= 1"),
    (["--trace", "generate:5", "--p2-epochs", "50"], "--p1-epochs and --p2-epochs set the training of --holdout"),
    (["--trace", "generate:5", "--policy", "gogh", "--holdout-family", "LM", "--risk-level", "1.5"],
     r"--risk-level must be within the calibrated 0.5-0.95.*got 1.5"),
    (["--trace", "generate:5", "--migration-s", "-60"], "--migration-s must be seconds >= 0"),
    # these three were refused by SimConfig only after the jobs were read and the models trained
    (["--trace", "generate:5", "--policy", "gogh", "--holdout-family", "LM", "--noise", "2"],
     r"--noise must be a log-normal sigma in \[0, 1\).*got 2"),
    (["--trace", "generate:5", "--rebalance-gain", "-1"], r"--rebalance-gain must be a fraction in \[0, 1\)"),
    (["--trace", "generate:5", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--trace", "generate:5", "--seeds", "0,-2"], "--seeds must be integers >= 0, got -2"),
    (["--trace", "generate:5", "--seeds", "0,1,0"], "--seeds names 0 more than once"),
    (["--trace", "generate:5", "--plot", "{tmp}/plot.txt"], "'.txt' is not one matplotlib writes"),
    (["--trace", "generate:5", "--policy", "orcale"], "unknown simulation policy 'orcale'"),
    (["--trace", "generate:5", "--policy", "gogh", "--predictors", "{repo}/models/gavel", "--holdout-family", "lm"],
     r"trained with family 'LM' \(trained without: none\).*--exclude-family LM"),
    (["--trace", "generate:5", "--policy", "oracle", "--holdout-family", "Each"],
     r"--holdout-family each trains the predictors of the learned policies .*none of \['oracle'\]"),
    (["--trace", "generate:5", "--policy", "gogh", "--holdout-family", "eahc"],
     r"--holdout-family: unknown model family 'eahc'.*or 'each' to keep the jobs' own types"),
    # options no policy of the run reads were accepted and recorded in the JSON (a review)
    (["--trace", "generate:5", "--policy", "oracle", "--predictors", "{tmp}/nope"],
     r"--predictors '.*nope' serves the learned policies .*none of \['oracle'\] is one"),
    (["--trace", "generate:5", "--policy", "oracle", "--rltune-model", "{tmp}/nope"],
     r"--rltune-model '.*nope' is the rltune peer's agent, and rltune is not among \['oracle'\]"),
    (["--trace", "generate:5", "--no-rebalance", "--rebalance-gain", "0.5"],
     "--rebalance-gain 0.5 sets when a running job moves to a freed GPU, and --no-rebalance never moves one"),
    (["--trace", "generate:5", "--policy", "gogh", "--predictors", "{tmp}/nope"],
     r"--predictors '.*nope' is neither a shipped prior \(gavel, synthetic\) nor a folder holding a p1/"),
])
def test_simulate_says_which_option_is_wrong_before_anything_runs(extra, match, gavel_dir, tmp_path, capsys):
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    extra = [a.format(gavel=gavel_dir, tmp=tmp_path, repo=repo) for a in extra]
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=2,k80=2",
                 *extra]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err and "note:" not in err  # refused before any job was read


def test_simulate_names_the_truth_and_what_to_do_for_job_types_it_lacks(gavel_dir, tmp_path, capsys):
    trace = tmp_path / "bert.trace"
    trace.write_text("BERT (batch size 32)\tpython3 main.py\tdir\t--num_steps\t1\t600\t1\t1\t-1.000000\t0\n")
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=1",
                 "--trace", str(trace), "--policy", "greedy-fastest"]) == 2
    err = capsys.readouterr().err
    assert "missing from the truth table (" in err and "['BERT (batch size 32)']; it knows 26 job types" in err
    assert "give a --truth that measures them" in err


def test_calibrate_uses_the_data_the_refiner_was_trained_on(gavel_dir, tmp_path, capsys):
    """Intervals from other data would be stored as the refiner's own."""
    import shutil
    from pathlib import Path

    model = str(Path(__file__).resolve().parent.parent / "models" / "gavel")
    assert main(["predictors", "calibrate", "--truth", "synthetic", "--model", model]) == 2
    assert "but the refiner in" in capsys.readouterr().err
    assert main(["predictors", "calibrate", "--model", model, "--exclude-family", "LM"]) == 2
    assert "trained on every family; drop --exclude-family" in capsys.readouterr().err
    from gogh_flows.predict.cli import _same_table

    # the shipped model records its data relative to the repository: from elsewhere the same file
    # given by another name is accepted, and a missing one is asked for, not a dead end
    assert _same_table(str(gavel_dir / "simulation_throughputs.json"), "../elsewhere/simulation_throughputs.json")
    assert not _same_table("synthetic", "../elsewhere/simulation_throughputs.json")
    import os

    # a recorded truth that cannot be found from here (the shipped one's Gavel file is found by its
    # name wherever the data lives): refused before anything is written
    ours = tmp_path / "ours"
    shutil.copytree(model, ours)
    config = ours / "p2" / "config.json"
    data = json.loads(config.read_text())
    data["trained_on"]["truth"] = "../elsewhere/ours.json"
    config.write_text(json.dumps(data))
    before = config.read_bytes()
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert main(["predictors", "calibrate", "--model", str(ours)]) == 2
        assert "which cannot be read from here" in capsys.readouterr().err
    finally:
        os.chdir(here)
    assert config.read_bytes() == before
    assert main(["predictors", "train", "--out", __file__]) == 2  # before training, not after
    assert "is a file; it names a folder to write into" in capsys.readouterr().err


def test_power_traces_that_cannot_be_read_are_named(gavel_dir, tmp_path, capsys):
    import shutil

    zeus = gavel_dir.parent / "zeus"
    for name in ("summary_power_v100.csv", "summary_power_p100.csv"):
        shutil.copy(zeus / name, tmp_path / name)
    lines = (tmp_path / "summary_power_v100.csv").read_text().splitlines()
    column = lines[0].split(",").index("power_limit")
    row = lines[2].split(",")
    row[column] = "max"
    (tmp_path / "summary_power_v100.csv").write_text("\n".join([*lines[:2], ",".join(row), *lines[3:]]) + "\n")
    assert main(["power", "evaluate", "--data", str(tmp_path), "--test-gpu", "p100"]) == 2
    assert "summary_power_v100.csv: power_limit, time_per_epoch and average_power must be numbers" in \
        capsys.readouterr().err
    (tmp_path / "summary_power_v100.csv").write_text("")
    assert main(["power", "evaluate", "--data", str(tmp_path), "--test-gpu", "p100"]) == 2
    assert "summary_power_v100.csv is empty" in capsys.readouterr().err
    assert main(["power", "evaluate", "--data", str(zeus / "summary_power_a40.csv"), "--test-gpu", "a40"]) == 2
    assert "is a file; give the folder that holds it" in capsys.readouterr().err


def test_the_usage_line_lists_every_command_whichever_was_given(capsys):
    from gogh_flows.cli import _COMMAND_MODULES, _OWN_COMMANDS

    with pytest.raises(SystemExit):
        main(["pool", "status", "tcp://127.0.0.1:1", "--bogus"])
    usage = capsys.readouterr().err.split("error:")[0]
    assert all(name in usage for name in (*_OWN_COMMANDS, *_COMMAND_MODULES))


def test_checks_do_not_refuse_what_works(gavel_dir, tmp_path, capsys, monkeypatch):
    """A held-out family's jobs for a policy that learns nothing, a plot without a suffix (a PNG), a
    trace under ~; predictors no learned policy would use are refused for that, not for having
    seen the family."""
    import argparse
    from pathlib import Path

    from gogh_flows.cli import check_outputs_writable

    repo = Path(__file__).resolve().parent.parent
    trace = gavel_dir / "traces" / "physical_cluster" / "max_min_fairness.trace"
    common = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=2,k80=2",
              "--trace", str(trace), "--policy", "greedy-fastest", "--holdout-family", "LM"]
    assert main([*common, "--json", str(tmp_path / "out.json")]) == 0
    capsys.readouterr()
    assert main([*common, "--predictors", str(repo / "models" / "gavel")]) == 2
    err = capsys.readouterr().err
    assert "serves the learned policies" in err and "trained with family" not in err
    check_outputs_writable(argparse.Namespace(plot=str(tmp_path / "figure")))
    monkeypatch.setenv("HOME", str(gavel_dir))  # a quoted ~ passed the check and then failed to load
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=2,k80=2",
                 "--trace", "~/traces/physical_cluster/max_min_fairness.trace", "--policy", "greedy-fastest"]) == 0


def test_simulate_says_when_the_predictors_were_trained_on_another_truth(gavel_dir, tmp_path, capsys):
    """Shipped synthetic-fleet predictors on Gavel's truth run (a fair question how they transfer),
    with a note saying so; the Gavel prior on Gavel's truth, without one."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    common = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=1,k80=1",
              "--trace", "generate:3", "--policy", "gogh"]
    assert main([*common, "--predictors", str(repo / "models" / "synthetic")]) == 0
    err = capsys.readouterr().err
    assert "were trained on 'synthetic'" in err and "gogh predictors train --truth" in err
    assert main([*common, "--predictors", str(repo / "models" / "gavel")]) == 0
    assert "were trained on" not in capsys.readouterr().err


def test_generated_jobs_of_a_family_that_runs_on_one_gpu_only_are_drawn_at_that_count(gavel_dir, tmp_path, capsys):
    """As a trace's jobs at counts no type of the family runs at are dropped with a note, generate:N
    draws none there (it stopped with the generator's own wording, naming arguments the CLI lacks)."""
    import json

    out = tmp_path / "a3c.json"
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace", "generate:12",
                 "--cluster", "v100=2,p100=2,k80=2", "--policy", "greedy-fastest,oracle", "--holdout-family", "A3C",
                 "--json", str(out)]) == 0
    assert "no job type of family 'A3C' runs at 2, 4, 8 GPU(s) here" in capsys.readouterr().err
    assert json.loads(out.read_text())["policies"]["oracle"]["jobs_completed"] == 12


def test_commands_given_wrong_things_say_what_and_run_nothing(gavel_dir, tmp_path, capsys, monkeypatch):
    """A new user's review: each of these ended in a traceback, said the opposite of what was
    wrong, or ran something else than asked."""
    out = str(tmp_path / "agent")
    # a fleet type the truth lacks: every generated job was dropped, then ZeroDivisionError
    assert main(["rltune", "train", "--out", out, "--episodes", "1", "--jobs", "8", "--cluster", "h100=4",
                 "--data", str(gavel_dir)]) == 2
    assert "--cluster GPU types ['h100'] are not in the truth table" in capsys.readouterr().err
    # 'synthetic' was read as a file name, and the error advised giving 'synthetic'
    assert main(["rltune", "train", "--out", out, "--truth", "synthetic", "--data", str(gavel_dir)]) == 2
    assert "neither 'gavel' nor a file" in capsys.readouterr().err
    # an empty --seeds ran seed 0 unasked
    assert main(["simulate", "--trace", "generate:5", "--cluster", "v100=1", "--seeds", ""]) == 2
    assert "--seeds names no seed" in capsys.readouterr().err
    # a group without its command named the group, not the commands it wants
    with pytest.raises(SystemExit):
        main(["power"])
    assert "required: {evaluate,fit}" in capsys.readouterr().err
    # GOGH_HOME that is a file (FileExistsError from deep inside) or cannot be made
    afile = tmp_path / "home"
    afile.write_text("")
    for home, said in ((afile, "is a file, not a folder"), ("/proc/gogh-nope", "cannot be made")):
        monkeypatch.setenv("GOGH_HOME", str(home))
        assert main(["predict", "--job", "LM (batch size 20)"]) == 2
        err = capsys.readouterr().err
        assert f"GOGH_HOME={str(home)!r} {said}" in err and "Traceback" not in err
    # an MLflow SQLite store whose folder cannot be made: one line about the path, no traceback
    monkeypatch.setenv("GOGH_HOME", str(tmp_path / "gogh"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////proc/gogh-nope/mlflow.db")
    assert main(["predict", "--job", "LM (batch size 20)"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the folder /proc/gogh-nope" in err and "give a path where this user can write" in err
    assert "mlflow server" not in err and "Traceback" not in err


def test_simulate_takes_a_shipped_prior_by_its_name_as_predict_does(gavel_dir, tmp_path, capsys, monkeypatch):
    """`gogh predict --predictors gavel` took the shipped prior; `gogh simulate --predictors gavel` said
    it had "no p1/ model directory" (a review)."""
    monkeypatch.chdir(tmp_path)  # no ./gavel folder here: the name is the shipped prior's
    out = tmp_path / "s.json"
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--cluster", "v100=2,k80=2",
                 "--trace", "generate:5", "--policy", "gogh,oracle", "--predictors", "gavel", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"gogh", "oracle"} and "gavel" in data["predictors"]

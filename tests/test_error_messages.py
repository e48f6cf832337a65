"""Errors that say what is true and what to do (issue 16, item 4)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from gogh_flows.flows.blocks import apply_block_documents
from gogh_flows.flows.spec import _features_of


def test_a_missing_block_folder_is_named_as_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        apply_block_documents(tmp_path / "no-such-dir")
    with pytest.raises(FileNotFoundError, match=r"no block documents \(\*\.json\)"):
        apply_block_documents(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"notes.txt is not a block document \(\*\.json\)"):
        apply_block_documents(tmp_path / "notes.txt")


class ReadsValues(nn.Module):
    """A forward that reads a tensor's value: it cannot run on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e9:  # data-dependent branch
            return self.fc(x) * 2
        return self.fc(x)


def test_a_model_that_reads_tensor_values_is_traced_where_it_is():
    feats, family, name = _features_of(ReadsValues(), 16, "training", torch.randn(16, 8), None)
    assert family is None and name == "ReadsValues (batch size 16)"
    assert sum(layer.flops for layer in feats.layers) > 0


class Transformer(nn.Module):
    """A user's own model whose class is named like a zoo family."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_job_of_ones_own_is_kept_apart_from_a_zoo_job_types_name():
    """A model of one's own named like a zoo job type ran at the zoo model's speed on the emulated
    fleet and was logged into the zoo model's records (a review); so was a zoo model given another
    zoo job type's name. A name the user gave is refused (any spelling the zoo reads as its own);
    one derived from a common class name is prefixed with "my ", and said."""
    x = torch.zeros(64, 16)
    with pytest.warns(UserWarning, match=r"class is named like a zoo model, and 'Transformer \(batch size 64\)' is "
                                         r"the zoo's job type: it is placed and measured as 'my Transformer"):
        assert _features_of(Transformer(), 64, "training", x, None)[1:] == (None, "my Transformer (batch size 64)")
    for name in ("ResNet-50 (batch size 64)", "lm (batch size 20)", "LM"):
        with pytest.raises(ValueError, match=rf"job_name={re.escape(repr(name))}\) is read as the zoo's job type "
                                             rf".* this is not that model.*e.g. job_name='my {re.escape(name)}'"):
            _features_of(Transformer(), 64, "training", x, name)
    with pytest.raises(ValueError, match=r"another zoo job type than this model's own "
                                         r"\('ResNet-50 \(batch size 64\)'\)"):
        _features_of("ResNet-50", 64, "training", None, "LM (batch size 20)")
    with pytest.raises(ValueError, match="must be a non-empty name, got ''"):
        _features_of("ResNet-50", 64, "training", None, "")
    from gogh_flows.workloads.zoo import zoo_features

    # the zoo model's own features under its own name are that model; under another size, not
    assert _features_of(zoo_features("LM", 20), 20, "training", None, "LM (batch size 20)")[2] == "LM (batch size 20)"
    with pytest.raises(ValueError, match="is read as the zoo's job type 'LM \\(batch size 40\\)'"):
        _features_of(zoo_features("LM", 20), 20, "training", None, "LM (batch size 40)")
    assert _features_of(Transformer(), 64, "training", x, "my Transformer (batch size 64)")[2] == \
        "my Transformer (batch size 64)"
    assert _features_of("ResNet-50", 64, "training", None, "ResNet-50 (batch size 64)")[1:] == \
        ("ResNet-50", "ResNet-50 (batch size 64)")
    assert _features_of("ResNet-50", 64, "training", None, "resnet-50 (batch size 64)")[1] == "ResNet-50"
    assert _features_of("ResNet-50", 64, "inference", None, None)[2] == "ResNet-50 (batch size 64) [inference]"


def test_the_registry_honours_mlflow_tracking_uri_and_the_block_overrides_it(monkeypatch, tmp_path):
    from gogh_flows.flows.blocks import PredictorRegistry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert PredictorRegistry().resolved_tracking_uri() == "http://127.0.0.1:5999"
    assert PredictorRegistry(tracking_uri=f"sqlite:///{tmp_path}/m.db").resolved_tracking_uri().startswith("sqlite")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nonsense")
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI: .* fix or unset it"):
        PredictorRegistry().resolved_tracking_uri()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("GOGH_HOME", str(tmp_path))
    assert PredictorRegistry().resolved_tracking_uri().startswith("sqlite:///")


def test_flow_above_gogh_placed_says_to_put_gogh_placed_outermost():
    import inspect

    import cloudpickle
    from prefect import flow

    from gogh_flows import gogh_placed

    def train(epochs: int = 1) -> int:
        return epochs

    placed = gogh_placed(model="ResNet-18", batch_size=32, min_throughput=1.0, work_steps=10)(train)
    with pytest.raises(TypeError, match="put @gogh_placed outermost"):
        flow(name="outer")(placed)
    with pytest.raises(TypeError, match="put @gogh_placed outermost"):
        flow(placed)
    # anyone else asking for its signature gets the body's, and the flow still pickles
    assert list(inspect.signature(placed).parameters) == ["epochs"]
    assert cloudpickle.loads(cloudpickle.dumps(placed)).name == "train"


def test_a_saved_block_that_does_not_validate_says_what_is_wrong_without_its_saved_values(monkeypatch):
    """Review: the first version of this message quoted the saved values, a tracking URI with its
    password among them, into the flow run's log."""
    from pydantic import ValidationError

    from gogh_flows.flows.blocks import PredictorRegistry, load_block

    try:
        PredictorRegistry.model_validate({"tracking_uri": "postgresql://mlflow:hunter2@db/mlflow",
                                          "refresh_interval_s": 30})
    except ValidationError as exc:
        invalid = exc

    def saved(cls, name, **kwargs):  # what Prefect raises for a saved document that fails validation
        raise RuntimeError(f"Unable to load {name!r} due to failed validation") from invalid

    # patched, not subclassed: a subclass would take the block type's slug in Prefect's registry
    monkeypatch.setattr(PredictorRegistry, "load", classmethod(saved))
    with pytest.raises(ValueError, match=r"block 'prod' does not validate: the block: .*refresh_interval_s.*"
                                         r"gogh blocks apply") as info:
        load_block(PredictorRegistry, "prod", PredictorRegistry())
    assert "hunter2" not in str(info.value)

    def broken(cls, name, **kwargs):  # any other RuntimeError is not taken for a bad block
        raise RuntimeError("validation server unreachable")

    monkeypatch.setattr(PredictorRegistry, "load", classmethod(broken))
    with pytest.raises(RuntimeError, match="unreachable"):
        load_block(PredictorRegistry, "prod", PredictorRegistry())


def test_a_second_process_with_a_local_pool_of_the_same_gpus_is_told_they_do_not_see_each_other(
        tmp_path, monkeypatch, caplog):
    """Two processes each with a process-local pool (two terminals on one GPU box) placed onto one
    GPU at once, each measured as if alone, without a word (a review). A process holding the mark
    is named; sessions of one process share it; the mark goes with its process, however it ends."""
    import logging
    import subprocess
    import sys

    from gogh_flows.flows.blocks import GpuCluster
    from gogh_flows.flows.session import local_pool_mark

    monkeypatch.setenv("GOGH_HOME", str(tmp_path / "home"))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\n"
         "from gogh_flows.flows.blocks import GpuCluster\n"
         "from gogh_flows.flows.session import local_pool_mark\n"
         "with local_pool_mark(GpuCluster(fleet={'v100': 1})):\n"
         "    print('held', flush=True)\n"
         "    sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="gogh_flows"):
            with local_pool_mark(GpuCluster(fleet={"v100": 1})):
                pass
            with local_pool_mark(GpuCluster(fleet={"a100": 2})):  # another fleet: no GPU in common
                pass
        said = [r.getMessage() for r in caplog.records if "already has a process-local pool" in r.getMessage()]
        assert len(said) == 1 and f"process {holder.pid} of this machine" in said[0], said
        assert "GpuCluster(mode='remote'" in said[0]
        # a session that warned holds no mark, and closing it must not take the mark of a later one
        # of this process (a review: it released it, and a third process then opened unwarned)
        from contextlib import ExitStack

        from filelock import FileLock, Timeout

        from gogh_flows.flows.session import _mark_path

        with ExitStack() as first:
            first.enter_context(local_pool_mark(GpuCluster(fleet={"v100": 1})))  # warns: the holder has it
            holder.kill()
            holder.wait(timeout=30)
            with local_pool_mark(GpuCluster(fleet={"v100": 1})):  # the holder is gone: this one takes it
                first.close()
                with pytest.raises(Timeout):  # still held by the session that took it
                    FileLock(str(_mark_path(GpuCluster(fleet={"v100": 1}))), timeout=0,
                             thread_local=False).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        with local_pool_mark(GpuCluster(fleet={"v100": 1})):  # the holder was killed: its mark went with it
            with local_pool_mark(GpuCluster(fleet={"v100": 1})):  # this process's second session shares it
                pass
    assert "already has a process-local pool" not in caplog.text


def test_a_pool_in_other_processes_needs_a_prefect_server_the_workers_can_reach(monkeypatch):
    """Without PREFECT_API_URL a remote worker started a temporary Prefect server of its own and the
    start-up was timed as the body's first steps (a new user's run logged 3.6 steps/s for a body
    that did 50 at once). Workers on this machine are given this process's temporary server;
    workers elsewhere cannot reach it, and the run is refused before anything is placed."""
    import prefect.server.api.server as server_mod
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gogh_flows.flows.decorator import _context_for_workers, _workers_prefect_url

    class TemporaryServer:  # this process's temporary server, as Prefect keeps it (one per process)
        running = True
        api_url = "http://127.0.0.1:8765/api"

    monkeypatch.setattr(server_mod, "SubprocessASGIServer", TemporaryServer)
    run = object()
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(RuntimeError, match="PREFECT_API_URL is not set") as info:
            _workers_prefect_url("tcp://10.0.0.5:8786", run)
        assert "prefect server start" in str(info.value) and "tcp://10.0.0.5:8786" in str(info.value)
        # a scheduler on loopback (a local-cuda pool): its workers can reach this process's server
        url = _workers_prefect_url("tcp://127.0.0.1:41234", run)
        assert url == TemporaryServer.api_url
        shipped = _context_for_workers(url)["settings_context"]
        assert TemporaryServer.api_url in str(shipped)
        assert PREFECT_API_URL.value() is None  # named for the workers only
        TemporaryServer.running = False
        with pytest.raises(RuntimeError, match="PREFECT_API_URL is not set"):
            _workers_prefect_url("tcp://127.0.0.1:41234", run)
        assert _workers_prefect_url("inproc://10.0.0.5/1/2", run) is None  # workers in this process
        assert _workers_prefect_url("tcp://10.0.0.5:8786", None) is None  # not in a flow run
    with temporary_settings({PREFECT_API_URL: "http://10.0.0.9:4200/api"}):
        assert _workers_prefect_url("tcp://10.0.0.5:8786", run) is None  # the workers get this one


def test_a_loopback_prefect_api_url_sent_to_workers_on_other_machines_is_warned(caplog):
    """The bodies report to the placing process's Prefect server (its settings go with each run): a
    loopback PREFECT_API_URL (an ssh tunnel) named the workers' own machines (a review)."""
    import logging

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gogh_flows.flows.decorator import _workers_prefect_url

    run = object()
    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
            for _ in range(2):
                assert _workers_prefect_url("tcp://10.0.0.5:8786", run) is None
            assert _workers_prefect_url("tcp://127.0.0.1:8786", run) is None  # workers on this machine
        with temporary_settings({PREFECT_API_URL: "http://10.0.0.2:4200/api"}):
            assert _workers_prefect_url("tcp://10.0.0.5:8786", run) is None
    said = [r.getMessage() for r in caplog.records if "a loopback address" in r.getMessage()]
    assert len(said) == 1 and "tcp://10.0.0.5:8786" in said[0], said


def test_a_served_flow_run_on_a_process_local_pool_is_told_its_runs_do_not_see_each_other(monkeypatch, caplog):
    """serve/deploy run each flow run in a process of its own: an emulated or local-cuda pool opened
    there has its own ledger, so overlapping runs of the deployment would not see each other."""
    import logging

    from gogh_flows import GpuCluster
    from gogh_flows.flows.session import _say_if_alone

    caplog.set_level(logging.WARNING, logger="gogh_flows")
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    monkeypatch.delenv("PREFECT__DEPLOYMENT_NAME", raising=False)
    _say_if_alone(GpuCluster(fleet={"t4": 1}))  # a script's own call: nothing to say
    assert not caplog.records
    # a run `serve` started: Prefect 3.8 sets only the deployment's name there (a review found two
    # served runs sharing one board past its capacity, told nothing)
    monkeypatch.setenv("PREFECT__DEPLOYMENT_NAME", "train/nightly")
    _say_if_alone(GpuCluster(fleet={"t4": 1}))
    assert len(caplog.records) == 1 and "do not see each other" in caplog.records[0].getMessage()
    caplog.clear()
    monkeypatch.delenv("PREFECT__DEPLOYMENT_NAME")
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000001")
    _say_if_alone(GpuCluster(mode="remote", address="tcp://127.0.0.1:8786"))  # shared: fine
    assert not caplog.records
    _say_if_alone(GpuCluster(fleet={"t4": 1}))
    _say_if_alone(GpuCluster(mode="local-cuda"))
    emulated, cuda = (r.getMessage() for r in caplog.records)
    assert "a pool of its own in it (emulated)" in emulated and "emulated fleet of their own" in emulated
    assert "the same GPUs of this machine" in cuda
    for said in (emulated, cuda):
        assert "do not see each other" in said and "GpuCluster(mode='remote'" in said


def test_a_shared_pool_or_a_missing_block_without_prefect_api_url_says_where_the_runs_and_blocks_went(
        monkeypatch, caplog):
    """A one-machine rehearsal of a team's setup ran a remote pool without PREFECT_API_URL without a
    word (its flow runs on a temporary server nobody else sees), and on a second host the block
    saved on the team's server was "not on the Prefect server", save one (a review)."""
    import logging

    from prefect.blocks.core import Block
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gogh_flows import GpuCluster
    from gogh_flows.flows.blocks import load_block
    from gogh_flows.flows.session import _say_if_shared_without_a_server

    caplog.set_level(logging.WARNING, logger="gogh_flows")
    shared = GpuCluster(mode="remote", address="tcp://127.0.0.1:8786")

    def missing(cls, name, **kwargs):
        raise ValueError(f"Unable to find block document named {name}")

    monkeypatch.setattr(Block, "load", classmethod(missing))
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        _say_if_shared_without_a_server(shared)
        assert not caplog.records
        with pytest.raises(ValueError, match="no GpuCluster block named 'team-fleet'") as err:
            load_block(GpuCluster, "team-fleet", GpuCluster())
        assert "PREFECT_API_URL" not in str(err.value)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        _say_if_shared_without_a_server(GpuCluster(fleet={"t4": 1}))  # a pool of its own: nothing to say
        assert not caplog.records
        _say_if_shared_without_a_server(shared)
        (record,) = caplog.records
        assert "tcp://127.0.0.1:8786 with no PREFECT_API_URL" in record.getMessage()
        assert "temporary Prefect server of its own" in record.getMessage()
        with pytest.raises(ValueError, match="set PREFECT_API_URL to that server: this process has none set"):
            load_block(GpuCluster, "team-fleet", GpuCluster())


def test_a_prefect_server_that_does_not_answer_is_one_line_naming_it_not_a_traceback(capsys):
    """PREFECT_API_URL set, nothing listening: `gogh serve`, `gogh blocks apply` and `gogh predict
    --registry` ended in httpx's 80-line ConnectError traceback (the user guide says serve refuses)."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gogh_flows.cli import main

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    blocks = Path(__file__).resolve().parent.parent / "blocks"
    with temporary_settings({PREFECT_API_URL: url}):
        for argv in (["serve", "--cron", "0 * * * *"], ["blocks", "apply", str(blocks)],
                     ["predict", "--job", "LM (batch size 20)", "--registry", "local-registry"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert f"no Prefect server answers at PREFECT_API_URL={url}" in err and "prefect server start" in err, err
            assert "Traceback" not in err


@pytest.mark.usefixtures("prefect_server")
def test_a_bad_silent_scheduler_wait_is_said_before_anything_is_placed(monkeypatch):
    """$GOGH_SILENT_SCHEDULER_S is read while a run waits on its body; a typo found there would
    fail a run that had already taken a GPU. It is checked when the run starts instead."""
    from gogh_flows import gogh_placed
    from gogh_flows.flows import decorator

    opened = []
    monkeypatch.setattr(decorator, "shared_session", lambda *a, **k: opened.append(a))
    monkeypatch.setenv("GOGH_SILENT_SCHEDULER_S", "a minute")

    @gogh_placed(model="ResNet-50", batch_size=64, min_throughput=1.0, work_steps=10)
    def train() -> None: ...

    with pytest.raises(ValueError, match=r"GOGH_SILENT_SCHEDULER_S must be a number of seconds > 0.*'a minute'"):
        train()
    assert not opened  # each value's reading: test_every_seconds_setting_is_read_one_way


def test_every_seconds_setting_is_read_one_way(monkeypatch):
    """The runtime's three seconds settings: a blank value is unset, and a word, 0, a negative or an
    infinite value is refused in one form, naming the variable, what it bounds and what it was given."""
    from gogh_flows.flows.decorator import silent_scheduler_s
    from gogh_flows.runtime.ledger import lease_timeout_from_env
    from gogh_flows.runtime.pool import _start_timeout

    readers = {"GOGH_LEASE_TIMEOUT_S": (lease_timeout_from_env, 30.0, "lease timeout"),
               "GOGH_POOL_START_TIMEOUT_S": (_start_timeout, 60.0, "worker processes may take to start"),
               "GOGH_SILENT_SCHEDULER_S": (silent_scheduler_s, 60.0, "scheduler that does not answer")}
    for env, (read, default, what) in readers.items():
        monkeypatch.setenv(env, "  ")
        assert read() == default, env
        monkeypatch.setenv(env, "12.5")
        assert read() == 12.5, env
        for bad in ("soon", "0", "-3", "inf", "nan"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValueError, match=rf"^\${env} must be a number of seconds > 0 \(.*{what}.*\), "
                                                 rf"got '{bad}'$"):
                read()
        monkeypatch.delenv(env)
    with pytest.raises(ValueError, match=r"^lease_timeout_s must be a number of seconds > 0 .*got -1$"):
        lease_timeout_from_env(-1)


def test_a_block_document_whose_data_is_not_an_object_or_not_utf8_is_named(tmp_path):
    import json

    from gogh_flows.flows.blocks import read_block_document

    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps({"type": "placement-policy", "name": "p", "data": [1]}))
    with pytest.raises(ValueError, match=r"listed.json: a block document .* 'data' \(an object of the block's"):
        read_block_document(listed)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"type": "placement-policy", "name": "caf\xe9", "data": {}}')
    with pytest.raises(ValueError, match=r"latin.json: not UTF-8 text .* save it as UTF-8 JSON"):
        read_block_document(latin)


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "fast"])
def test_a_workers_time_scale_is_refused_by_name(monkeypatch, bad):
    from gogh_flows.runtime.worker import time_scale_from_env

    monkeypatch.setenv("GOGH_TIME_SCALE", bad)
    with pytest.raises(ValueError, match=r"\$GOGH_TIME_SCALE on this worker must be a number >= 0"):
        time_scale_from_env()
    monkeypatch.setenv("GOGH_TIME_SCALE", " ")
    assert time_scale_from_env() == 0.0


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_rates_and_features_are_refused_where_they_are_read(value):
    """NaN passes a "< 0" check: a NaN rate in a truth file or a Gavel JSON made the optimiser's
    figures NaN, and NaN layer features (published by another placing process) made a job look
    unplaceable everywhere (a security review)."""
    from gogh_flows.truth.gavel import GavelFormatError, parse_gavel_throughputs
    from gogh_flows.truth.table import ThroughputTable
    from gogh_flows.workloads.features import LayerFeature

    with pytest.raises(ValueError, match="throughput must be a finite number >= 0"):
        ThroughputTable.from_rows([{"job_type": "a", "gpu_type": "v100", "throughput": value}], source="t")
    with pytest.raises(ValueError, match="partner_throughput must be a finite number >= 0, got .* beside 'b'"):
        ThroughputTable.from_rows([{"job_type": "a", "gpu_type": "v100", "throughput": 1.0},
                                   {"job_type": "a", "gpu_type": "v100", "partner": "b", "throughput": 1.0,
                                    "partner_throughput": value}], source="t")
    with pytest.raises(GavelFormatError, match="expected a finite throughput >= 0"):
        parse_gavel_throughputs({"v100": {"('ResNet-18', 1)": {"null": value}}})
    with pytest.raises(ValueError, match="must be finite numbers >= 0"):
        LayerFeature("fc", "linear", value, 1, 1, 1)


def test_a_huge_integer_rate_and_a_bom_are_read_as_such(tmp_path):
    from gogh_flows.flows.blocks import read_block_document
    from gogh_flows.truth.gavel import GavelFormatError, parse_gavel_throughputs

    with pytest.raises(GavelFormatError, match="expected a finite throughput >= 0"):
        parse_gavel_throughputs({"v100": {"('ResNet-18', 1)": {"null": 10 ** 400}}})
    doc = tmp_path / "policy.json"
    doc.write_bytes(b'\xef\xbb\xbf{"type": "placement-policy", "name": "p", "data": {}}')  # an editor's BOM
    assert read_block_document(doc)[0] == "p"


def test_site_offsets_beyond_a_factor_of_ten_are_applied_at_it_and_said(caplog):
    import math
    import logging

    from gogh_flows.predict.site import MAX_OFFSET, SiteOffsets

    with caplog.at_level(logging.WARNING, logger="gogh_flows"):
        site = SiteOffsets.from_dict({"unmeasured": {"t4": math.log(30.0), "v100": -5.0, "a100": 0.1}})
    assert site.unmeasured == {"t4": MAX_OFFSET, "v100": -MAX_OFFSET, "a100": 0.1}
    assert "beyond a factor of 10 are kept at it" in caplog.text
    with pytest.raises(ValueError, match="site offsets must be finite log factors"):
        SiteOffsets.from_dict({"unmeasured": {"t4": float("nan")}})


def test_a_models_folder_that_does_not_exist_is_named_as_such(tmp_path, monkeypatch):
    """GOGH_MODELS_DIR=/nope read as "the prior 'synthetic' has no p1/ at <cwd>/synthetic (the shipped
    priors are the folders of /nope)", with the advice to set GOGH_MODELS_DIR given twice (a review)."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource, PriorMissing

    monkeypatch.setenv("GOGH_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GOGH_MODELS_DIR", str(tmp_path / "nope"))
    with pytest.raises(PriorMissing) as info:
        PredictorSource(PredictorRegistry(prior="synthetic")).ensure_prior()
    message = str(info.value)
    assert f"GOGH_MODELS_DIR='{tmp_path / 'nope'}' is not a folder" in message
    assert message.count("GOGH_MODELS_DIR") == 1


def test_flow_runs_started_together_from_threads_start_one_temporary_server(monkeypatch):
    """Prefect starts its temporary server from each thread's first client without a lock: runs
    started together from a thread pool started several (ports taken, "Server process did not
    start", one left running after the script exited) or found it marked running before it
    answered (a review). The first placed call starts it under a lock; the others wait until it
    answers."""
    import contextvars
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import prefect.server.api.server as server_mod
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gogh_flows.flows import decorator

    class SlowServer:  # Prefect's order: marked running and its process started at once, answering later
        running = False
        server_process = None
        answering = False
        started = 0

        def start(self) -> None:
            if self.running:
                return
            type(self).running = True
            type(self).server_process = object()
            type(self).started += 1
            time.sleep(0.3)
            type(self).answering = True

    monkeypatch.setattr(server_mod, "SubprocessASGIServer", SlowServer)
    monkeypatch.setattr(decorator, "_TEMPORARY_SERVER_READY", threading.Event())
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        def call() -> bool:
            decorator._start_temporary_server()
            return SlowServer.answering  # what a flow call then needs: a server that answers

        with ThreadPoolExecutor(8) as pool:  # each thread with these settings (a thread starts with none)
            ready = [f.result() for f in [pool.submit(contextvars.copy_context().run, call) for _ in range(8)]]
    assert SlowServer.started == 1 and all(ready), (SlowServer.started, ready)
    monkeypatch.setattr(decorator, "_TEMPORARY_SERVER_READY", threading.Event())
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        SlowServer.running = False
        decorator._start_temporary_server()  # a configured server: nothing started
        assert SlowServer.started == 1


def test_a_job_type_of_ones_own_declared_again_with_other_layers_is_warned():
    """Two different nn.Sequential models at one batch size became one job type without a word: the
    second was predicted and run as the first (a review). Warned; the same layers again are not."""
    import warnings

    from gogh_flows.flows.spec import placed_job

    x = torch.zeros(16, 8)
    small, large = nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 512), nn.Linear(512, 512))
    common = dict(batch_size=16, min_throughput=1, work_steps=10, example_inputs=x, job_name="two-models-one-name")
    placed_job(model=small, **common)
    with pytest.warns(UserWarning, match=r"'two-models-one-name' was declared before in this process with other "
                                         r"layer features .* Give each model a job_name of its own"):
        placed_job(model=large, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed_job(model=nn.Sequential(nn.Linear(8, 512), nn.Linear(512, 512)), **common)  # the same layers


def test_a_database_store_without_its_driver_says_which_package_to_install(tmp_path, monkeypatch):
    """PredictorRegistry(tracking_uri="postgresql://...") raised a bare ModuleNotFoundError for psycopg2
    (a review), with the password in the URI nowhere masked."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import PredictorSource
    from gogh_flows.tracking.errors import TrackingUnavailableError

    pytest.importorskip("sqlalchemy")
    try:
        import psycopg2  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        pytest.skip("psycopg2 is installed here")
    monkeypatch.setenv("GOGH_HOME", str(tmp_path))
    with pytest.raises(TrackingUnavailableError, match=r"postgresql://u:\*\*\*@127.0.0.1:1/db needs the Python "
                                                       r"package 'psycopg2'.*pip install psycopg2-binary") as info:
        PredictorSource(PredictorRegistry(tracking_uri="postgresql://u:secret@127.0.0.1:1/db"))
    assert "secret" not in str(info.value)
    # a registry store of its own is checked too, and named (it failed at the registry's first call)
    with pytest.raises(TrackingUnavailableError, match=r"the MLflow store postgresql://u:\*\*\*@127.0.0.1:2/reg"):
        PredictorSource(PredictorRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                                          registry_uri="postgresql://u:secret@127.0.0.1:2/reg"))


def test_a_block_asking_another_lease_timeout_than_the_pools_ledger_keeps_is_warned(gogh_home, caplog):
    """A shared pool's ledger keeps the lease timeout it was started with (on the scheduler); a
    block's lease_timeout_s then has no effect, and nothing said so (a review)."""
    import logging

    from gogh_flows.flows.blocks import GpuCluster
    from gogh_flows.flows.session import Session
    from gogh_flows.runtime import emulated_pool

    with emulated_pool("a100=1", lease_timeout_s=7.0) as pool:
        with caplog.at_level(logging.WARNING, logger="gogh_flows"):
            for asked in (7.0, 30.0):
                session = Session.open(GpuCluster(mode="remote", address=pool.address, lease_timeout_s=asked),
                                       f"sqlite:///{gogh_home}/mlflow.db")
                session.close()
    said = [r.getMessage() for r in caplog.records if "frees a silent holder's GPU after" in r.getMessage()]
    assert len(said) == 1 and "after 7 s" in said[0] and "lease_timeout_s=30" in said[0], said

"""``gogh predict``: every zoo job answers on every catalog GPU type, with the figures placement uses.

One registry (the shipped prior registered in a temporary $GOGH_HOME, as a first placement
does) serves the whole module; the loops call the core in-process, the CLI tests call ``main``.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from gogh_flows.catalog import gpu_types
from gogh_flows.cli import main
from gogh_flows.placement import Gpu, Job, PlacementProblem
from gogh_flows.placement.options import FleetState, options_for
from gogh_flows.whatif import WhatIfRow, predict_what_if, resolve_job
from gogh_flows.workloads.zoo import DEFAULT_BATCH_SIZES, FAMILIES, job_type_name

ALL_TYPES = tuple(g.name for g in gpu_types())
ZOO_JOBS = tuple(job_type_name(f, b) for f in FAMILIES for b in DEFAULT_BATCH_SIZES[f])
PARTNER = "Transformer (batch size 64)"
ROW_KEYS = {"gpu_type", "job_type", "partner", "throughput", "partner_throughput", "power_w", "energy_per_step_j"}


@pytest.fixture(scope="module")
def placement_home(tmp_path_factory, gogh_models):
    """A fresh $GOGH_HOME for the module, and the champion a placement would load from its embedded
    registry (the shipped prior, registered on first use)."""
    from gogh_flows.flows.blocks import PredictorRegistry
    from gogh_flows.flows.predictors import forget_predictor_sources, predictor_source

    home = tmp_path_factory.mktemp("gogh-predict")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GOGH_HOME", str(home))
        mp.setenv("GOGH_MODELS_DIR", str(gogh_models))
        forget_predictor_sources()
        yield home, predictor_source(PredictorRegistry()).get()
        forget_predictor_sources()


@pytest.fixture(scope="module")
def predictor(placement_home):
    return placement_home[1]


def _check_row(row: WhatIfRow, job: str, gpu: str, partner: str | None) -> None:
    assert (row.job_type, row.gpu_type, row.partner) == (job, gpu, partner)
    if row.fits:
        assert row.throughput > 0 and row.power_w > 0 and row.energy_per_step_j > 0
        assert (row.partner_throughput is None) == (partner is None)
        if partner is None:
            assert row.energy_per_step_j == pytest.approx(row.power_w / row.throughput)
        else:
            assert row.partner_throughput > 0
            # the join's share of the board never exceeds the whole board's energy per step
            assert row.energy_per_step_j <= row.power_w / row.throughput * (1 + 1e-9)
    else:
        assert row.throughput == 0 and row.power_w is None and row.energy_per_step_j is None and row.note


def test_every_zoo_job_alone_on_every_catalog_type(predictor):
    for name in ZOO_JOBS:
        job = resolve_job(name)
        assert job.job_type == name
        rows = predict_what_if(job, None, ALL_TYPES, predictor)
        assert [r.gpu_type for r in rows] == list(ALL_TYPES)
        table = predictor.predict_table({name: job.features}, ALL_TYPES)
        for row in rows:
            _check_row(row, name, row.gpu_type, None)
            assert row.throughput == table.isolated(name, row.gpu_type)  # the predictor's own figure
        assert any(r.fits for r in rows), f"{name} fits no catalog GPU type"


def test_every_zoo_job_next_to_one_partner(predictor):
    partner = resolve_job(PARTNER)
    for name in ZOO_JOBS:
        rows = predict_what_if(resolve_job(name), partner, ALL_TYPES, predictor)
        assert len(rows) == len(ALL_TYPES)
        for row in rows:
            _check_row(row, name, row.gpu_type, PARTNER)


def test_alone_figures_are_placements_option_costs(predictor):
    """Spot check: each alone row equals the 'alone' option placement's costing gives on that type."""
    job = resolve_job("ResNet-50 (batch size 64)")
    types = ("h100", "a100", "k80", "t4")
    rows = {r.gpu_type: r for r in predict_what_if(job, None, types, predictor)}
    table = predictor.predict_table({job.job_type: job.features}, types)
    work = 1_000.0
    new = Job("new", job.job_type, 1e-6, work)
    problem = PlacementProblem.build([Gpu(f"{t}-0", t) for t in types], [new], table)
    choices = {c.gpu_type: c for c in options_for(problem, FleetState(problem), new).choices}
    assert set(choices) == {t for t, r in rows.items() if r.fits}
    for t, c in choices.items():
        assert rows[t].throughput == c.throughput
        assert rows[t].power_w == pytest.approx(c.power_w)
        assert rows[t].energy_per_step_j == pytest.approx(c.energy_j / work)


def test_partner_figures_are_placements_join_costs(predictor):
    """Spot check: next to a running partner, the row equals placement's 'join' option on that type:
    same throughputs, board power = the join's added power + the partner's alone power, and
    J/step = the join's energy to completion per step while the partner outlasts the job."""
    job, partner = resolve_job("ResNet-50 (batch size 64)"), resolve_job(PARTNER)
    types = ("h100", "v100", "a100")
    rows = {r.gpu_type: r for r in predict_what_if(job, partner, types, predictor)}
    table = predictor.predict_table({job.job_type: job.features, partner.job_type: partner.features}, types)
    for t in types:
        row = rows[t]
        assert row.fits
        tj, tk = table.pair(job.job_type, partner.job_type, t)
        assert (row.throughput, row.partner_throughput) == (tj, tk)
        work = tj * 100.0  # 100 s of sharing; the partner has 1000 s of work left
        running = Job("running", partner.job_type, 1e-6, tk * 1_000.0, gpus=(f"{t}-0",))
        new = Job("new", job.job_type, 1e-6, work)
        problem = PlacementProblem.build([Gpu(f"{t}-0", t)], [running, new], table)
        (join,) = [c for c in options_for(problem, FleetState(problem), new).choices if c.partner == "running"]
        assert (join.throughput, join.partner_throughput) == (tj, tk)
        k_alone = problem.energy.power_alone(t, problem.throughputs.activity(running, t))
        assert row.power_w == pytest.approx(join.power_w + k_alone)
        assert row.energy_per_step_j == pytest.approx(join.energy_j / work)


def test_logged_measurement_is_used_and_labelled(predictor):
    import polars as pl

    from gogh_flows.predict.service import observations_frame

    job = resolve_job("LM (batch size 20)")
    obs = observations_frame(pl.DataFrame({"job_type": [job.job_type], "gpu_type": ["v100"],
                                           "partner": [None], "throughput": [12.5]}))
    rows = {r.gpu_type: r for r in predict_what_if(job, None, ("v100", "t4"), predictor, obs)}
    assert rows["v100"].throughput == 12.5 and rows["v100"].source == "measured"
    assert rows["t4"].source == "predicted"


def test_a_job_too_big_for_some_types_gets_rows_not_a_crash(predictor):
    job = resolve_job(model="ResNet-50", batch_size=384)  # a non-Gavel size (~38 GB): from layer features
    rows = {r.gpu_type: r for r in predict_what_if(job, None, ALL_TYPES, predictor)}
    assert rows["h100"].fits and rows["a100"].fits  # 80 GB
    assert not rows["k80"].fits and not rows["t4"].fits  # 12 and 16 GB
    assert rows["k80"].note == "does not fit in memory"
    for t, row in rows.items():
        _check_row(row, job.job_type, t, None)
    pair = {r.gpu_type: r for r in predict_what_if(job, resolve_job(PARTNER), ("h100", "t4"), predictor)}
    assert not pair["t4"].fits and pair["t4"].throughput == 0 and pair["t4"].partner_throughput == 0


# -- the command, in-process ------------------------------------------------------------------
def test_cli_json_schema_and_values(predictor, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["predict", "--job", "ResNet-50 (batch size 64)", "--gpu", "h100,A100", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "ResNet-50 (batch size 64) alone" in shown and "h100" in shown and "gogh-p1 v1" in shown
    doc = json.loads(out.read_text())
    rows = doc["predictions"]
    assert [r["gpu_type"] for r in rows] == ["h100", "a100"]
    expected = predict_what_if(resolve_job("ResNet-50 (batch size 64)"), None, ("h100", "a100"), predictor)
    for r, e in zip(rows, expected, strict=True):
        assert ROW_KEYS <= set(r)
        assert r["partner"] is None and r["partner_throughput"] is None
        assert r["throughput"] == e.throughput and r["power_w"] == e.power_w
        assert r["energy_per_step_j"] == e.energy_per_step_j
    assert doc["predictors"]["p1_version"] == 1 and doc["measurements"] == 0


def test_cli_partner_by_model_and_batch_size(predictor, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["predict", "--model", "resnet-50", "--batch-size", "64", "--partner-model", "Transformer",
                 "--partner-batch-size", "64", "--gpu", "v100", "--json", str(out)]) == 0
    assert "partner steps/s" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["predictions"]
    assert ROW_KEYS <= set(row)
    assert (row["job_type"], row["partner"]) == ("ResNet-50 (batch size 64)", PARTNER)
    assert row["throughput"] > 0 and row["partner_throughput"] > 0 and row["fits"]
    assert math.isfinite(row["power_w"]) and math.isfinite(row["energy_per_step_j"])


def test_cli_defaults_to_every_catalog_type(predictor, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["predict", "--job", "A3C", "--json", str(out)]) == 0
    assert [r["gpu_type"] for r in json.loads(out.read_text())["predictions"]] == list(ALL_TYPES)


def test_an_inference_job_is_titled_as_one(predictor, capsys):
    """"[inference]" in a job type is text: read as rich markup it vanished from the title."""
    assert main(["predict", "--job", "LM (batch size 20) [inference]", "--gpu", "v100"]) == 0
    assert "LM (batch size 20) [inference] alone" in capsys.readouterr().out


def test_cli_reads_the_measurement_log(placement_home, tmp_path, capsys):
    """A run logged under $GOGH_HOME is an observation of this prediction, as it is of a placement's."""
    import shutil

    from gogh_flows.flows.blocks import PredictorRegistry, state_dir
    from gogh_flows.tracking.measurements import Measurement, MeasurementLog

    home, _ = placement_home
    assert state_dir() == home.resolve()
    log = MeasurementLog(PredictorRegistry().resolved_tracking_uri(), state_dir() / "measurements")
    log.log(Measurement(
        run_id="r1", flow_name="t", job_type="LM (batch size 20)", family="LM", batch_size=20, gpu_id="t4-0",
        gpu_type="t4", device="t4-0", partners=(), required_throughput=1.0, predicted_throughput=None,
        steps=100.0, duration_s=10.0, throughput=10.0, mean_power_w=60.0, energy_j=600.0,
        status="completed", telemetry="emulated", started_at=time.time()), defer=True)
    out = tmp_path / "p.json"
    try:
        assert main(["predict", "--job", "LM (batch size 20)", "--gpu", "t4", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["measurements"] == 1
        assert doc["predictions"][0]["throughput"] == 10.0 and doc["predictions"][0]["source"] == "measured"
        assert main(["predict", "--job", "LM (batch size 20)", "--gpu", "t4", "--no-measurements",
                     "--json", str(out)]) == 0
        assert json.loads(out.read_text())["predictions"][0]["source"] == "predicted"
    finally:  # the module's other tests expect a home with nothing logged
        shutil.rmtree(log.root)


@pytest.mark.parametrize("argv, names", [
    (["--job", "ResNet-51 (batch size 64)"], ["ResNet-18", "ResNet-50 (16, 32, 64, 128)", "Recommendation", "A3C"]),
    (["--job", "ResNet-50"], ["which batch size", "16, 32, 64, 128"]),
    (["--job", "ResNet-50 (batch size 0)"], ["batch_size", "Transformer (16, 32, 64, 128, 256)"]),
    (["--model", "Transformer"], ["--batch-size", "16, 32, 64, 128, 256"]),
    (["--job", "LM (batch size 20)", "--partner", "bogus"], ["--partner 'bogus'", "CycleGAN"]),
    (["--job", "LM (batch size 20)", "--gpu", "h100,h200"], ["'h200'", "a10, a100, a40, h100, k80, l4, p100, t4, v100"]),
    ([], ["--job"]),
])
def test_bad_names_give_one_line_naming_the_valid_ones(argv, names, capsys):
    assert main(["predict", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("gogh: error: ") and "\n" not in err and "Traceback" not in captured.err
    for name in names:
        assert name in err


def test_the_footer_names_the_fallback_when_the_registry_is_down(tmp_path, gogh_models, monkeypatch, capsys):
    """With MLflow unreachable the table comes from the cached versions or the built-in prior; the
    footer said "gogh-p1 vNone + gogh-p2 vNone (champion at ...)", as if the champion answered."""
    import socket

    from gogh_flows.flows.predictors import forget_predictor_sources

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GOGH_HOME", str(tmp_path))
    monkeypatch.setenv("GOGH_MODELS_DIR", str(gogh_models))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    forget_predictor_sources()
    try:
        assert main(["predict", "--job", "LM (batch size 20)", "--gpu", "t4"]) == 0
    finally:
        forget_predictor_sources()
    out = capsys.readouterr().out
    # why, in the line itself (a refused champion read "(unavailable)" while the registry answered)
    assert (f"predictors: the built-in prior 'synthetic', not the champion at http://127.0.0.1:{port}: "
            f"MLflow is unreachable (TrackingUnavailableError: MLflow tracking server at http://127.0.0.1:{port} is "
            "unreachable") in " ".join(out.split())
    assert "vNone" not in out


def test_cli_predicts_with_a_folder_of_predictors_before_they_are_registered(predictor, gogh_models, tmp_path,
                                                                              capsys):
    """What `gogh predictors train --out DIR` wrote could only be asked through a registry block
    made for it; --predictors DIR answers with it directly (P1 alone when it has no p2/)."""
    import shutil

    from gogh_flows.predict.io import load_p1, load_p2
    from gogh_flows.predict.service import ThroughputPredictor

    mine = tmp_path / "my-predictors"
    shutil.copytree(gogh_models / "gavel", mine)
    name = "ResNet-50 (batch size 64)"
    job = resolve_job(name)
    for refiner in (True, False):
        out = tmp_path / f"p-{refiner}.json"
        assert main(["predict", "--job", name, "--gpu", "v100,k80", "--predictors", str(mine),
                     "--json", str(out)]) == 0
        shown = capsys.readouterr().out
        assert "not the registry's" in shown and ("P1 + P2" in shown) == refiner
        doc = json.loads(out.read_text())
        assert doc["predictors"] == {"folder": str(mine.resolve()), "refiner": refiner}
        expected = predict_what_if(job, None, ("v100", "k80"), ThroughputPredictor(
            load_p1(mine / "p1"), load_p2(mine / "p2") if refiner else None))
        assert [r["throughput"] for r in doc["predictions"]] == [e.throughput for e in expected]
        shutil.rmtree(mine / "p2", ignore_errors=True)
    # the registry's champion (the synthetic prior here) predicts otherwise: the folder was used
    champion = predict_what_if(job, None, ("v100",), predictor)[0].throughput
    assert champion != expected[0].throughput
    shutil.rmtree(mine / "p1")
    assert main(["predict", "--job", name, "--predictors", str(mine)]) == 2
    assert "has no p1/ folder" in capsys.readouterr().err
    assert main(["predict", "--job", name, "--predictors", "gavel", "--registry", "mine"]) == 2
    assert "not both" in capsys.readouterr().err

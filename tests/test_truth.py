import json

import polars as pl
import pytest

from gogh_flows.catalog import UnknownGpuTypeError, gpu_types
from gogh_flows.truth.gavel import GavelFormatError, parse_gavel_throughputs, read_gavel_json
from gogh_flows.truth.synthetic import SyntheticFleet, synthetic_table
from gogh_flows.truth.table import ThroughputLookupError, ThroughputTable
from gogh_flows.workloads import DEFAULT_BATCH_SIZES, FAMILIES, job_type_name, zoo_features


# -- Gavel reader ------------------------------------------------------------------------
def test_reads_gavel_measurements(gavel_table):
    t = gavel_table
    assert t.gpu_types == ("k80", "p100", "v100")
    assert len(t.job_types) == 26
    # 3 worker types x (83 isolated keys + 26 x 26 single-GPU pair entries)
    assert len(t) == 3 * (83 + 676)
    assert t.isolated("A3C", "v100") == pytest.approx(7.175767179667988)
    own, partner = t.pair("A3C", "ResNet-18 (batch size 16)", "v100")
    assert (own, partner) == pytest.approx((5.573234466541688, 32.353384328946916))
    # Consistent in both directions, as the data promise.
    assert t.pair("ResNet-18 (batch size 16)", "A3C", "v100") == pytest.approx((partner, own))
    assert t.scale_factors("ResNet-50 (batch size 64)") == (1, 2, 4, 8)
    assert t.scale_factors("A3C") == (1,)


def test_gavel_physical_cluster_file_differs_only_in_isolated(gavel_dir):
    sim = read_gavel_json(gavel_dir, which="simulation")
    phys = read_gavel_json(gavel_dir, which="physical_cluster")
    assert sim.pair("LM (batch size 20)", "A3C", "p100") == phys.pair("LM (batch size 20)", "A3C", "p100")
    assert phys.isolated("ResNet-50 (batch size 128)", "k80") == 0.0
    assert sim.isolated("ResNet-50 (batch size 128)", "k80") == pytest.approx(0.347, abs=1e-3)


def _write(tmp_path, data) -> str:
    p = tmp_path / "t.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


@pytest.mark.parametrize(
    "data, match",
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"v100": {"ResNet": {"null": 1.0}}}, "tuple literal"),
        ({"v100": {"('A', 1)": {"x": 1.0}}}, "'null'"),
        ({"v100": {"('A', 1)": {"null": -1.0}}}, "throughput >= 0"),
        ({"v100": {"('A', 1)": {"null": 1.0, "('B', 1)": [1.0]}}}, r"\[own, partner\]"),
        ({"v100": {"('A', 1)": {"null": "fast"}}}, "throughput >= 0"),
    ],
)
def test_malformed_gavel_file_is_named(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(GavelFormatError, match=match) as info:
        read_gavel_json(path)
    assert "t.json" in str(info.value)


def test_missing_gavel_file_says_where_to_point(tmp_path):
    with pytest.raises(FileNotFoundError, match="GOGH_GAVEL_DIR"):
        read_gavel_json(tmp_path / "nope.json")


def test_gavel_key_is_never_evaluated_as_code():
    data = {"v100": {"__import__('os').system('echo hi')": {"null": 1.0}}}
    with pytest.raises(GavelFormatError, match="tuple literal"):
        parse_gavel_throughputs(data)


# -- table -------------------------------------------------------------------------------
def test_table_lookups_and_errors():
    t = ThroughputTable.from_rows([
        {"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "throughput": 4.0, "activity": 0.7},
        {"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "partner": "a",
         "throughput": 3.0, "partner_throughput": 3.0},
    ])
    assert t.isolated("a", "v100") == 4.0
    assert t.activity("a", "v100") == 0.7
    assert t.pair("a", "a", "v100") == (3.0, 3.0)
    assert t.pair("a", "b", "v100") == (0.0, 0.0)  # unmeasured pairs never look safe
    with pytest.raises(ThroughputLookupError, match="'b' is not in the throughput table"):
        t.isolated("b", "v100")
    with pytest.raises(ThroughputLookupError, match="GPU type 'k80'"):
        t.isolated("a", "k80")
    with pytest.raises(ThroughputLookupError, match="scale factors available"):
        t.isolated("a", "v100", 4)


def test_table_rejects_negative_throughput_and_missing_columns():
    with pytest.raises(ValueError, match="throughput must be a finite number >= 0"):
        ThroughputTable.from_rows([{"job_type": "a", "gpu_type": "v100", "scale_factor": 1, "throughput": -2.0}])
    with pytest.raises(ValueError, match="missing column"):
        ThroughputTable(pl.DataFrame({"job_type": ["a"]}))


def test_table_parquet_round_trip(tmp_path):
    t = synthetic_table(["v100", "t4"])
    t.write_parquet(tmp_path / "t.parquet")
    back = ThroughputTable.read_parquet(tmp_path / "t.parquet")
    assert back.frame.equals(t.frame)
    assert back.pair("A3C", "CycleGAN", "t4") == t.pair("A3C", "CycleGAN", "t4")


# -- synthetic fleet ---------------------------------------------------------------------
def test_synthetic_covers_every_catalog_gpu_and_zoo_job():
    t = synthetic_table()
    assert set(t.gpu_types) == {g.name for g in gpu_types()}
    expected = {job_type_name(f, b) for f in FAMILIES for b in DEFAULT_BATCH_SIZES[f]}
    assert set(t.job_types) == expected


def test_synthetic_is_seeded_and_stable():
    a = SyntheticFleet(gpu_types=("v100", "t4"), seed=3).table()
    b = SyntheticFleet(gpu_types=("v100", "t4"), seed=3).table()
    c = SyntheticFleet(gpu_types=("v100", "t4"), seed=4).table()
    assert a.frame.equals(b.frame)
    assert not a.frame.equals(c.frame)
    # Noise is keyed per entry: adding a GPU type does not change the others.
    d = SyntheticFleet(gpu_types=("v100", "t4", "h100"), seed=3).table()
    jt = "ResNet-50 (batch size 64)"
    assert d.isolated(jt, "v100") == a.isolated(jt, "v100")


def test_synthetic_newer_gpus_are_faster_for_big_models():
    t = synthetic_table()
    jt = "ResNet-50 (batch size 64)"
    assert t.isolated(jt, "h100") > t.isolated(jt, "a100") > t.isolated(jt, "v100") > t.isolated(jt, "k80")


def test_synthetic_pairs_stay_within_gavels_range():
    t = synthetic_table()
    f = t.frame.filter(pl.col("partner").is_not_null() & (pl.col("throughput") > 0))
    iso = t.isolated_frame().filter(pl.col("scale_factor") == 1)
    f = (
        f.join(iso.select("job_type", "gpu_type", pl.col("throughput").alias("iso_a")), on=["job_type", "gpu_type"])
        .join(iso.select(pl.col("job_type").alias("partner"), "gpu_type", pl.col("throughput").alias("iso_b")),
              on=["partner", "gpu_type"])
        .with_columns(combined=pl.col("throughput") / pl.col("iso_a") + pl.col("partner_throughput") / pl.col("iso_b"))
    )
    assert f.height > 1000
    assert f["combined"].min() >= 1.0 - 1e-9
    assert f["combined"].max() <= 2.0 + 1e-9
    assert (f["throughput"] <= f["iso_a"] + 1e-9).all()


def test_synthetic_memory_limit_gives_zero():
    big = zoo_features("ResNet-50", 1024)
    fleet = SyntheticFleet(gpu_types=("k80", "h100"), jobs={"r50-huge": big, "a3c": zoo_features("A3C", 20)}, noise=0)
    t = fleet.table()
    assert big.memory_bytes_estimate > 0.9 * 12e9
    assert t.isolated("r50-huge", "k80") == 0.0
    assert t.pair("r50-huge", "a3c", "k80") == (0.0, 0.0)


def test_synthetic_gangs_are_aggregate_and_sublinear():
    t = synthetic_table()
    jt = "ResNet-50 (batch size 64)"
    one, four = t.isolated(jt, "v100", 1), t.isolated(jt, "v100", 4)
    assert one < four <= 4 * one * 1.2  # noise is per entry


def test_synthetic_any_batch_size_and_user_model():
    import torch

    from gogh_flows.workloads import extract_features

    user = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    feats = extract_features(user, torch.randn(32, 256))
    t = SyntheticFleet(gpu_types=("l4",), jobs={"mlp": feats, "r18-48": zoo_features("ResNet-18", 48)}).table()
    assert t.isolated("mlp", "l4") > 0
    assert t.isolated("r18-48", "l4") > 0


def test_synthetic_rejects_unknown_gpu_type():
    with pytest.raises(UnknownGpuTypeError, match="x100"):
        SyntheticFleet(gpu_types=("x100",))


def test_a_relative_gavel_path_that_is_missing_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """The default ../shared/data/gavel is relative to the working directory: from elsewhere the
    error shows where that led."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="from the working directory") as info:
        read_gavel_json("data/nope.json")
    assert str(tmp_path / "data" / "nope.json") in str(info.value)


def test_the_default_data_folder_is_found_beside_the_checkout_from_any_working_directory(tmp_path, monkeypatch):
    """A user running `gogh simulate --truth gavel` from their own folder got "not found" for data
    that sat beside the checkout: ../shared/data was only looked for from the working directory."""
    from gogh_flows import datapaths
    from gogh_flows.power_model import data_dir
    from gogh_flows.truth.gavel import gavel_dir

    beside = tmp_path / "checkout-side" / "shared" / "data"
    (beside / "gavel").mkdir(parents=True)
    monkeypatch.setattr(datapaths, "BESIDE_CHECKOUT", beside)
    monkeypatch.delenv("GOGH_GAVEL_DIR", raising=False)
    monkeypatch.delenv("GOGH_DATA_DIR", raising=False)
    elsewhere = tmp_path / "work" / "project"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    assert gavel_dir() == beside / "gavel"
    assert data_dir() == beside
    # from the working directory first, as the docs always said
    (tmp_path / "work" / "shared" / "data" / "gavel").mkdir(parents=True)
    assert gavel_dir().resolve() == (tmp_path / "work" / "shared" / "data" / "gavel").resolve()
    # the variable wins, and with nothing anywhere the error names both places
    monkeypatch.setenv("GOGH_GAVEL_DIR", str(tmp_path / "mine"))
    assert gavel_dir() == tmp_path / "mine"
    monkeypatch.delenv("GOGH_GAVEL_DIR")
    monkeypatch.setattr(datapaths, "BESIDE_CHECKOUT", tmp_path / "none")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="beside the checkout") as info:
        read_gavel_json(None)
    assert str(tmp_path / "none" / "gavel") in str(info.value)


def test_board_variants_run_at_their_datasheet_figures_under_the_catalog_name():
    gpus = ("v100", "a100", "t4")
    sxm = SyntheticFleet(gpu_types=gpus).table()
    site = SyntheticFleet(gpu_types=gpus, boards={"v100": "v100-pcie", "a100": "a100-pcie-40gb"}).table()
    assert site.gpu_types == sxm.gpu_types and site.source == "synthetic(seed=0, a100=a100-pcie-40gb, v100=v100-pcie)"
    ratio = lambda j, g: site.isolated(j, g) / sxm.isolated(j, g)  # noqa: E731
    # a compute-bound model on a PCIe V100 (14 against 15.7 TFLOPS) runs at most 14/15.7 as fast;
    # a memory-bound one on a 40 GB A100 (1,555 against 2,039 GB/s) loses; the T4 is untouched
    assert 0.88 < ratio("ResNet-50 (batch size 32)", "v100") < 0.95
    assert ratio("Recommendation (batch size 2048)", "a100") < 0.95
    assert all(ratio(j, "t4") == 1.0 for j in sxm.job_types if sxm.isolated(j, "t4") > 0)
    # a type without a variant is untouched, pairs and activity too
    assert site.frame.filter(pl.col("gpu_type") == "t4").equals(sxm.frame.filter(pl.col("gpu_type") == "t4"))


def test_a_job_an_emulated_worker_learns_runs_on_the_tables_own_boards():
    """A user's model is computed from its features when it first runs on an emulated fleet: on
    the fleet's board variants and seed, not the catalog's figures."""
    from gogh_flows.runtime.worker import _learn_job

    job = "ResNet-50 (batch size 48)"  # not among the tables' job types
    tables = {b: ThroughputTable(t.frame, source=t.source, fleet=t.fleet) for b, t in (
        ("pcie", synthetic_table(("v100", "a100"), boards={"v100": "v100-pcie"})),
        ("sxm", synthetic_table(("v100", "a100"))))}
    for t in tables.values():
        assert not t.knows(job)
        _learn_job(t, job, zoo_features("ResNet-50", 48))
    direct = SyntheticFleet(gpu_types=("v100", "a100"), jobs={job: zoo_features("ResNet-50", 48)},
                            boards={"v100": "v100-pcie"}).table()
    assert tables["pcie"].isolated(job, "v100") == pytest.approx(direct.isolated(job, "v100"))
    assert tables["pcie"].isolated(job, "v100") < 0.95 * tables["sxm"].isolated(job, "v100")
    assert tables["pcie"].isolated(job, "a100") == pytest.approx(tables["sxm"].isolated(job, "a100"))


@pytest.mark.parametrize(("boards", "match"), [
    ({"v100": "v100-sxm9"}, "unknown board variant 'v100-sxm9'; known: a100-pcie-40gb"),
    ({"v100": "a100-pcie-40gb"}, "board variant 'a100-pcie-40gb' is a board of type 'a100', not 'v100': map it under 'a100'"),
    ({"h100": "a100-pcie-40gb"}, r"boards names 'h100', which this fleet lacks \(v100, a100\); name a type of the fleet"),
])
def test_a_wrong_board_variant_is_named(boards, match):
    with pytest.raises(ValueError, match=match):
        SyntheticFleet(gpu_types=("v100", "a100"), boards=boards)


def test_a_trained_models_truth_is_recorded_so_any_folder_can_read_it(gavel_dir, tmp_path, monkeypatch):
    """`gogh predictors train --truth ../shared/data/gavel/...` recorded the path as typed: a
    retraining run from another folder (a `gogh serve` process) could not read it and learned from
    its logged runs alone, and `gogh predictors calibrate` was refused. Gavel's file is recorded
    as `gavel`, any other as an absolute path; a relative path recorded before is still read."""
    import shutil

    from gogh_flows.truth import load_truth, readable_truth, recorded_truth

    monkeypatch.setenv("GOGH_GAVEL_DIR", str(gavel_dir))
    sim = gavel_dir / "simulation_throughputs.json"
    assert recorded_truth(str(sim)) == "gavel"
    assert recorded_truth("synthetic") == "synthetic" and recorded_truth("gavel") == "gavel"
    ours = tmp_path / "data" / "ours.json"
    ours.parent.mkdir()
    shutil.copy(gavel_dir / "physical_cluster_throughputs.json", ours)
    monkeypatch.chdir(tmp_path)
    assert recorded_truth("data/ours.json") == str(ours)  # absolute: readable from anywhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    # a path recorded relative to another folder (the shipped Gavel prior's) is found by its name
    assert readable_truth("../shared/data/gavel/simulation_throughputs.json") == "gavel"
    physical = readable_truth("../shared/data/gavel/physical_cluster_throughputs.json")
    assert physical == str(gavel_dir / "physical_cluster_throughputs.json")
    assert load_truth(physical).job_types == load_truth("gavel").job_types
    # what cannot be found is returned as recorded, so the error that follows names it; a file of one's
    # own that shares a name with Gavel's, outside a gavel/ folder, is not taken for Gavel's
    assert readable_truth("../data/ours.json") == "../data/ours.json"
    assert readable_truth("../mine/simulation_throughputs.json") == "../mine/simulation_throughputs.json"
    assert readable_truth(str(ours)) == str(ours)

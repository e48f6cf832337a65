"""ThroughputPredictor: the table the placement layer reads, and the refiner's training."""

from __future__ import annotations

import math
from dataclasses import replace

import polars as pl
import pytest

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.p1 import P1Config, train_p1
from gogh_flows.predict.p2 import P2Config
from gogh_flows.predict.service import (
    SITE_KEY,
    ThroughputPredictor,
    fit_refiner,
    fit_site_offsets,
    observations_frame,
    training_entries,
)
from gogh_flows.predict.site import SiteOffsets
from gogh_flows.truth.synthetic import synthetic_table
from gogh_flows.truth.table import ThroughputTable

GPUS = ("k80", "v100", "a100")
TRAIN_JOBS = (
    "A3C", "LM (batch size 20)", "Recommendation (batch size 1024)", "ResNet-18 (batch size 64)",
    "ResNet-50 (batch size 128)", "ResNet-50 (batch size 32)", "Transformer (batch size 64)",
)
NEW = "CycleGAN"  # never seen by P1 or P2 here


@pytest.fixture(scope="module")
def setup():
    full = MeasuredSet.from_table(synthetic_table(GPUS))
    data = full.subset(TRAIN_JOBS)
    p1 = train_p1(data, P1Config(hidden=8, epochs=40, pair_rows_per_epoch=256))
    p2 = fit_refiner(p1, {}, observations_frame(), base=data, config=P2Config(hidden=8, epochs=60))
    return full, data, p1, p2


def _truth_rows(full: MeasuredSet, job: str) -> dict[str, float]:
    return dict(zip(full.iso.filter(pl.col("job") == job)["gpu"], full.iso.filter(pl.col("job") == job)["throughput"]))


def test_observations_frame_schema_and_validation():
    f = observations_frame([{"job_type": "A3C", "gpu_type": "k80", "throughput": 2.0},
                            {"job_type": "A3C", "gpu_type": "k80", "partner": "A3C", "throughput": 1.0}])
    assert f.columns == ["job_type", "gpu_type", "partner", "throughput"]
    assert f["partner"].to_list() == [None, "A3C"]
    assert observations_frame().height == 0
    assert observations_frame(f.drop("partner"))["partner"].null_count() == 2
    with pytest.raises(ValueError, match="lacks"):
        observations_frame([{"job_type": "A3C", "throughput": 1.0}])
    with pytest.raises(ValueError, match=">= 0"):
        observations_frame([{"job_type": "A3C", "gpu_type": "k80", "throughput": -1.0}])


def test_table_has_every_job_type_and_pair_with_zero_where_it_does_not_fit(setup):
    full, data, p1, p2 = setup
    jobs = {n: full.jobs[n] for n in (*TRAIN_JOBS[:4], "ResNet-50 (batch size 128)", NEW)}
    table = ThroughputPredictor(p1, p2).predict_table(jobs, GPUS)
    assert isinstance(table, ThroughputTable)
    j, g = len(jobs), len(GPUS)
    assert len(table) == j * g + j * (j + 1) // 2 * g
    assert set(table.job_types) == set(jobs) and set(table.gpu_types) == set(GPUS)
    assert table.isolated("ResNet-50 (batch size 128)", "k80") == 0.0  # 12 GB is too little
    assert table.pair("ResNet-50 (batch size 128)", "A3C", "k80") == (0.0, 0.0)
    assert table.isolated("A3C", "a100") > 0
    assert all(v > 0 for v in table.pair("A3C", "A3C", "v100"))


def test_observed_entries_come_back_as_observed(setup):
    full, _, p1, p2 = setup
    jobs = {n: full.jobs[n] for n in ("A3C", "ResNet-18 (batch size 64)", NEW)}
    obs = observations_frame([
        {"job_type": "A3C", "gpu_type": "v100", "throughput": 2.0},
        {"job_type": "A3C", "gpu_type": "v100", "throughput": 8.0},  # geometric mean 4.0
        {"job_type": NEW, "gpu_type": "k80", "partner": "A3C", "throughput": 0.5},
        {"job_type": "ResNet-18 (batch size 64)", "gpu_type": "a100", "throughput": 0.0},
    ])
    for pred in (ThroughputPredictor(p1, p2), ThroughputPredictor(p1)):
        table = pred.predict_table(jobs, GPUS, obs)
        assert table.isolated("A3C", "v100") == pytest.approx(4.0)
        assert table.pair(NEW, "A3C", "k80")[0] == pytest.approx(0.5)
        assert table.isolated("ResNet-18 (batch size 64)", "a100") == 0.0


def test_without_p2_the_table_is_p1(setup):
    full, _, p1, _ = setup
    jobs = {n: full.jobs[n] for n in ("A3C", NEW)}
    table = ThroughputPredictor(p1).predict_table(jobs, GPUS)
    pred = p1.predict(jobs, GPUS, partners=jobs)
    for a, na in enumerate(jobs):
        for k, g in enumerate(GPUS):
            assert table.isolated(na, g) == pytest.approx(pred.isolated[a, k], rel=1e-6)
            for b, nb in enumerate(jobs):
                assert table.pair(na, nb, g)[0] == pytest.approx(
                    min(pred.pair[a, b, k], pred.pair[b, a, k]) if na == nb else pred.pair[a, b, k], rel=1e-6)


def test_a_job_outside_p2s_layout_still_gets_p1_values(setup):
    full, _, p1, p2 = setup
    assert NEW not in p2.layout.partners
    jobs = {n: full.jobs[n] for n in ("A3C", NEW)}
    table = ThroughputPredictor(p1, p2).predict_table(jobs, GPUS)
    pred = p1.predict(jobs, GPUS, partners=jobs)
    for k, g in enumerate(GPUS):
        iso = table.isolated(NEW, g)
        assert iso > 0 and math.isfinite(iso)
        # next to another job P2 never saw as a partner: P1's slowdown on the refined isolated value
        ratio = pred.pair[1, 1, k] / pred.isolated[1, k]
        assert table.pair(NEW, NEW, g)[0] == pytest.approx(iso * ratio, rel=1e-5)
    # GPU types P2 was not trained for are pure P1
    t4 = ThroughputPredictor(p1, p2).predict_table(jobs, ("t4",))
    assert t4.isolated(NEW, "t4") == pytest.approx(p1.predict(jobs, ("t4",)).isolated[1, 0], rel=1e-6)


def test_one_observation_moves_the_other_types_toward_the_truth(setup):
    full, _, p1, p2 = setup
    pred = ThroughputPredictor(p1, p2)
    truth = _truth_rows(full, NEW)
    jobs = {NEW: full.jobs[NEW]}
    before = ThroughputPredictor(p1).predict_table(jobs, GPUS)  # P1 alone
    after = pred.predict_table(jobs, GPUS, observations_frame(
        [{"job_type": NEW, "gpu_type": "v100", "throughput": truth["v100"]}]))
    err = lambda t, g: abs(math.log(t.isolated(NEW, g) / truth[g]))  # noqa: E731
    others = [g for g in GPUS if g != "v100" and truth.get(g, 0) > 0]
    assert sum(err(after, g) for g in others) < sum(err(before, g) for g in others)


def test_a_measured_sibling_moves_the_unmeasured_entries_of_its_family(setup):
    full, _, p1, p2 = setup
    sib, new, other = "ResNet-50 (batch size 32)", "ResNet-50 (batch size 64)", "LM (batch size 20)"
    jobs = {new: full.jobs[new], other: full.jobs[other]}
    p1_sib = p1.predict({sib: full.jobs[sib]}, GPUS).isolated[0]
    obs = observations_frame([{"job_type": sib, "gpu_type": "k80", "throughput": float(p1_sib[0]) / 3}])
    plain = ThroughputPredictor(p1, p2).predict_table(jobs, GPUS)
    moved = ThroughputPredictor(p1, p2).predict_table(jobs, GPUS, obs)
    p1_new = p1.predict({new: full.jobs[new]}, GPUS).isolated[0]
    assert moved.isolated(new, "k80") == pytest.approx(p1_new[0] / 3, rel=1e-5)  # the family's error
    assert moved.isolated(new, "v100") == pytest.approx(plain.isolated(new, "v100"))  # no evidence there
    assert moved.isolated(other, "k80") == pytest.approx(plain.isolated(other, "k80"))  # another family
    ratio = plain.pair(new, other, "k80")[0] / plain.isolated(new, "k80")
    assert moved.pair(new, other, "k80")[0] == pytest.approx(moved.isolated(new, "k80") * ratio, rel=1e-5)
    # P1 alone (no refiner) does not learn from siblings
    assert ThroughputPredictor(p1).predict_table(jobs, GPUS, obs).isolated(new, "k80") == pytest.approx(
        ThroughputPredictor(p1).predict_table(jobs, GPUS).isolated(new, "k80"))


def test_refine_error_scores_held_out_measurements(setup):
    full, _, p1, p2 = setup
    rows = full.iso.filter(pl.col("job") == NEW)
    train = observations_frame([{"job_type": NEW, "gpu_type": rows["gpu"][0], "throughput": rows["throughput"][0]}])
    test = observations_frame(
        [{"job_type": NEW, "gpu_type": g, "throughput": t} for g, t in zip(rows["gpu"][1:], rows["throughput"][1:])]
        + [{"job_type": NEW, "gpu_type": "v100", "partner": "A3C", "throughput": 1.0}])
    res = ThroughputPredictor(p1, p2).refine_error(full.jobs, train, test)
    assert res["n"] == test.height and res["isolated_n"] == test.height - 1 and res["colocated_n"] == 1
    assert 0 <= res["isolated_mape"] < 10 and res["mape"] >= 0
    with pytest.raises(ValueError, match="no features"):
        ThroughputPredictor(p1, p2).refine_error({}, train, test)


def test_refine_error_predicts_a_repeated_entry_without_its_own_earlier_measurement(setup):
    """A held-out run of an entry measured before is not scored against that measurement (any
    refiner would return it): it is predicted from the job's other entries, as a placement would."""
    full, _, p1, p2 = setup
    rows = full.iso.filter(pl.col("job") == NEW)
    (g0, t0), (g1, t1) = list(zip(rows["gpu"], rows["throughput"]))[:2]
    train = observations_frame([{"job_type": NEW, "gpu_type": g0, "throughput": t0},
                                {"job_type": NEW, "gpu_type": g1, "throughput": t1}])
    test = observations_frame([{"job_type": NEW, "gpu_type": g1, "throughput": t1}])  # a repeat of a trained entry
    predictor = ThroughputPredictor(p1, p2)
    echoed = predictor.refine_error(full.jobs, train, test, hide_same_entry=False)
    assert echoed["mape"] == pytest.approx(0.0, abs=1e-9)  # it only read the earlier measurement back
    honest = predictor.refine_error(full.jobs, train, test)
    only_other = predictor.refine_error(full.jobs, train.head(1), test, hide_same_entry=False)
    assert honest["mape"] == pytest.approx(only_other["mape"]) and honest["mape"] > 0


def test_fit_refiner_learns_from_logged_observations_of_a_new_job(setup):
    full, data, p1, _ = setup
    rows = [{"job_type": NEW, "gpu_type": g, "throughput": t}
            for g, t in _truth_rows(full, NEW).items() if t > 0]
    rows += [{"job_type": "A3C", "gpu_type": "v100", "partner": NEW, "throughput": 1.5}]
    p2 = fit_refiner(p1, {NEW: full.jobs[NEW]}, observations_frame(rows), base=data,
                     config=P2Config(hidden=8, epochs=5))
    assert NEW in p2.layout.partners and p2.layout.gpus == data.gpus
    assert p2.trained_on["observations"] == len(rows)
    with pytest.raises(ValueError, match="no layer features"):
        fit_refiner(p1, {}, observations_frame([{"job_type": "my-model", "gpu_type": "k80", "throughput": 1.0}]))


def test_a_fleets_runs_of_an_entry_are_averaged_with_the_base_datas_figure_in_training():
    base = MeasuredSet.from_table(synthetic_table(("v100", "t4")))
    job = "ResNet-50 (batch size 32)"
    prior = base.iso.filter((pl.col("job") == job) & (pl.col("gpu") == "v100"))["throughput"][0]
    entries = training_entries(observations_frame([{"job_type": job, "gpu_type": "v100", "throughput": prior * 0.8},
                                                   {"job_type": job, "gpu_type": "v100", "throughput": prior * 0.9}]),
                               base)
    # the fleet's runs of the entry (their geometric mean) beside the base's figure
    assert entries[(job, None, "v100")] == pytest.approx(math.log(prior) + (math.log(0.8) + math.log(0.9)) / 4)
    t4 = base.iso.filter((pl.col("job") == job) & (pl.col("gpu") == "t4"))["throughput"][0]
    assert entries[(job, None, "t4")] == pytest.approx(math.log(t4))  # unmeasured here: the base's
    assert training_entries(observations_frame([{"job_type": job, "gpu_type": "v100", "throughput": 3.0}]), None) == {
        (job, None, "v100"): pytest.approx(math.log(3.0))}


def test_site_offsets_are_shrunk_means_and_move_a_measured_job_only_when_anchored():
    off = SiteOffsets.fit([("v100", -0.2), ("v100", -0.2), ("v100", -0.2), ("a100", 0.1), ("t4", math.nan)])
    assert off.unmeasured == {"v100": pytest.approx(-0.6 / 5), "a100": pytest.approx(0.1 / 3)}
    assert off.measurements == {"v100": 3, "a100": 1} and not off.anchored
    assert off.factors(["v100", "a100", "k80"]) == pytest.approx([math.exp(-0.12), math.exp(0.1 / 3), 1.0])
    # measured on the A100: left to the refiner, or (anchored) moved by the difference from the A100's offset
    assert off.factors(["v100", "a100", "k80"], measured_on=["a100"]) == pytest.approx([1.0, 1.0, 1.0])
    anchored = replace(off, anchored=True)
    assert anchored.factors(["v100", "a100", "k80"], measured_on=["a100"]) == pytest.approx(
        [math.exp(-0.12 - 0.1 / 3), 1.0, math.exp(-0.1 / 3)])
    for o in (off, anchored):
        assert SiteOffsets.from_dict(o.to_dict()) == o
    assert not SiteOffsets() and not SiteOffsets.from_dict(None)


def test_a_refiner_carries_the_fleets_per_type_offset_to_jobs_with_nothing_measured(setup):
    """A fleet whose V100s run 15% slower than the prior's world, on every job: the offsets
    learned from some jobs move the others' predictions; a job's own measured types stand."""
    full, data, p1, p2 = setup
    bare = ThroughputPredictor(p1, p2)
    measured = list(TRAIN_JOBS[:5])
    jobs = {j: full.jobs[j] for j in measured}
    before = bare.predict_table(jobs, GPUS)
    obs = observations_frame([{"job_type": j, "gpu_type": g, "throughput": before.isolated(j, g) * (0.85 if g == "v100" else 1)}
                              for j in measured for g in ("v100", "k80") if before.isolated(j, g) > 0])
    off = fit_site_offsets(bare, full.jobs, obs)
    # five jobs of four families (ResNet-50 twice: its sibling's run moves it, as a placement would)
    assert math.log(0.85) * 5 / 7 - 0.03 < off.unmeasured["v100"] < math.log(0.85) * 4 / 7
    assert abs(off.unmeasured["k80"]) < 0.03 and off.measurements["v100"] == 5
    site = replace(p2, trained_on={**p2.trained_on, SITE_KEY: off.to_dict()})
    new = {NEW: full.jobs[NEW]}
    plain, moved = bare.predict_table(new, GPUS), ThroughputPredictor(p1, site).predict_table(new, GPUS)
    f = math.exp(off.unmeasured["v100"])
    assert moved.isolated(NEW, "v100") == pytest.approx(plain.isolated(NEW, "v100") * f, rel=1e-5)
    assert moved.isolated(NEW, "a100") == pytest.approx(plain.isolated(NEW, "a100"), rel=1e-6)
    assert moved.pair(NEW, NEW, "v100")[0] == pytest.approx(plain.pair(NEW, NEW, "v100")[0] * f, rel=1e-5)
    # measured on the K80: its V100 entry moves by the V100's offset less the K80's when anchored
    seen = observations_frame([{"job_type": NEW, "gpu_type": "k80", "throughput": 0.5}])
    plain = bare.predict_table(new, GPUS, seen)
    for anchored, factor in ((False, 1.0), (True, math.exp(off.unmeasured["v100"] - off.unmeasured["k80"]))):
        site = replace(p2, trained_on={**p2.trained_on, SITE_KEY: replace(off, anchored=anchored).to_dict()})
        moved = ThroughputPredictor(p1, site).predict_table(new, GPUS, seen)
        assert moved.isolated(NEW, "v100") == pytest.approx(plain.isolated(NEW, "v100") * factor, rel=1e-5)
        assert moved.isolated(NEW, "k80") == 0.5


def test_a_job_its_measured_siblings_moved_is_not_moved_again_by_the_site_offsets(setup):
    """The sibling's measurement carries the site's difference already: offsets on top counted
    it twice (0.64x where the board runs at 0.8x, found in review)."""
    full, data, p1, p2 = setup
    off = SiteOffsets({"v100": math.log(0.8)}, False, {"v100": 10})
    site = replace(p2, trained_on={**p2.trained_on, SITE_KEY: off.to_dict()})
    job, sibling, other = "ResNet-50 (batch size 64)", "ResNet-50 (batch size 32)", "A3C"
    jobs = {j: full.jobs[j] for j in (job, other)}
    seen = observations_frame([{"job_type": sibling, "gpu_type": "v100", "throughput": 0.8 * full.iso.filter(
        (pl.col("job") == sibling) & (pl.col("gpu") == "v100"))["throughput"][0]}])
    plain = ThroughputPredictor(p1, p2).predict_table(jobs, GPUS, seen)
    moved = ThroughputPredictor(p1, site).predict_table(jobs, GPUS, seen)
    assert moved.isolated(job, "v100") == pytest.approx(plain.isolated(job, "v100"), rel=1e-6)
    assert moved.isolated(other, "v100") == pytest.approx(plain.isolated(other, "v100") * 0.8, rel=1e-5)

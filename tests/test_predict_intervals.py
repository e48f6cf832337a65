"""Calibrated intervals: the refiner's lower bounds at a risk level (gogh_flows/predict/intervals.py)."""

from __future__ import annotations

import math

import pytest

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.evaluate import EvalConfig, calibrate_refiner, out_of_family_p1
from gogh_flows.predict.intervals import CASES, LEVELS, Intervals, NoIntervalsError
from gogh_flows.predict.layout import Layout
from gogh_flows.predict.p1 import P1Config, train_p1
from gogh_flows.predict.p2 import P2Config, train_p2
from gogh_flows.predict.service import ThroughputPredictor, observations_frame
from gogh_flows.truth.synthetic import synthetic_table

GPUS = ("k80", "v100", "a100")
JOBS = ("A3C", "LM (batch size 20)", "Recommendation (batch size 1024)", "ResNet-18 (batch size 64)",
        "ResNet-50 (batch size 32)", "Transformer (batch size 64)")
CFG = EvalConfig(p1=P1Config(hidden=8, epochs=20, pair_rows_per_epoch=128), p2=P2Config(hidden=8, epochs=20))


@pytest.fixture(scope="module")
def trained():
    data = MeasuredSet.from_table(synthetic_table(GPUS)).subset(JOBS)
    layout = Layout(data.gpus, data.names)
    oof = out_of_family_p1(data, layout, dict(data.jobs), CFG.p1)
    p1 = train_p1(data, CFG.p1)
    p2 = train_p2(layout, oof, layout.truth(data, data.names), CFG.p2)
    intervals, ensemble = calibrate_refiner(data, oof, CFG)
    p2.trained_on["intervals"] = intervals.to_dict()
    return data, p1, p2, intervals


def test_the_calibration_gives_a_half_width_per_case_growing_with_the_level(trained):
    *_, intervals = trained
    assert intervals.levels == LEVELS and set(intervals.halfwidths) == set(CASES)
    for case in CASES:
        widths = intervals.halfwidths[case]
        assert all(math.isfinite(w) and w >= 0 for w in widths)
        assert list(widths) == sorted(widths)
    assert "families left out in turn" in intervals.calibration
    assert Intervals.from_dict(intervals.to_dict()) == intervals


def test_halfwidths_interpolate_between_levels_and_refuse_outside_them():
    iv = Intervals(LEVELS, {c: (0.0, 0.1, 0.2, 0.3, 0.4, 0.5) for c in CASES})
    assert iv.halfwidth("isolated", 0.85) == pytest.approx(0.35)
    with pytest.raises(ValueError, match="outside the calibrated 0.5-0.95"):
        iv.halfwidth("isolated", 0.99)
    with pytest.raises(ValueError, match="half-width per level"):
        Intervals(LEVELS, {"isolated": (0.1,)})


def test_lower_bounds_keep_measured_entries_and_shrink_the_rest_by_what_is_known(trained):
    data, p1, p2, intervals = trained
    predictor = ThroughputPredictor(p1, p2)
    jobs = {n: data.jobs[n] for n in ("LM (batch size 20)", "ResNet-50 (batch size 32)")}
    obs = observations_frame([{"job_type": "LM (batch size 20)", "gpu_type": "v100", "throughput": 7.0}])
    point = predictor.predict_table(jobs, GPUS, obs)
    low = predictor.predict_table(jobs, GPUS, obs, risk=0.9)
    lm, r50 = "LM (batch size 20)", "ResNet-50 (batch size 32)"
    assert low.isolated(lm, "v100") == pytest.approx(7.0)  # measured: planned at its measurement
    assert low.isolated(lm, "a100") == pytest.approx(
        point.isolated(lm, "a100") * math.exp(-intervals.halfwidth("isolated_1obs", 0.9)))
    assert low.isolated(r50, "a100") == pytest.approx(
        point.isolated(r50, "a100") * math.exp(-intervals.halfwidth("isolated", 0.9)))
    assert low.pair(r50, lm, "k80")[0] == pytest.approx(
        point.pair(r50, lm, "k80")[0] * math.exp(-intervals.halfwidth("colocated", 0.9)))
    # a higher level plans more cautiously
    lower = predictor.predict_table(jobs, GPUS, obs, risk=0.95)
    assert lower.isolated(r50, "a100") <= low.isolated(r50, "a100")


def test_a_refiner_without_intervals_says_how_to_get_them(trained):
    data, p1, _, _ = trained
    with pytest.raises(NoIntervalsError, match="gogh predictors calibrate"):
        ThroughputPredictor(p1).predict_table({"A3C": data.jobs["A3C"]}, GPUS, risk=0.8)

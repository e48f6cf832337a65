"""Sibling transfer: a family's measured job types correct its unmeasured entries."""

import numpy as np
import pytest

from gogh_flows.predict.siblings import sibling_transfer

# GPU types (k80, p100, v100); the prior thinks v100 is 4x a k80 for every job
PRIOR = {"R-a": np.array([1.0, 2.0, 4.0]), "R-b": np.array([2.0, 4.0, 8.0]),
         "X-c": np.array([1.0, 2.0, 4.0])}
FAM = {"R-a": "R", "R-b": "R", "X-c": "X"}


def test_anchored_estimate_moves_the_ratio_by_the_siblings_error():
    # R-b really runs only 1.5x faster on a v100 than on a k80 (the prior said 4x)
    measured = {"R-a": {0: 3.0}, "R-b": {0: 2.0, 2: 3.0}}
    out = sibling_transfer(PRIOR, PRIOR, measured, FAM, ["R-a"])["R-a"]
    assert out[0] == pytest.approx(1.0)  # measured entries are not touched here (rows carry them)
    assert out[2] == pytest.approx(3.0 * 4.0 * (1.5 / 4.0))  # own anchor x prior ratio x sibling error
    assert out[1] == pytest.approx(2.0)  # no sibling measured p100: the refined row stays


def test_unanchored_estimate_shifts_the_prior_by_the_siblings_error():
    measured = {"R-b": {1: 1.0}}  # R-b is 4x slower on a p100 than predicted
    out = sibling_transfer(PRIOR, PRIOR, measured, FAM, ["R-a"])["R-a"]
    assert out[1] == pytest.approx(0.5)
    assert out[0] == pytest.approx(1.0) and out[2] == pytest.approx(4.0)


def test_several_siblings_are_averaged_in_log_space():
    prior = {**PRIOR, "R-d": np.array([1.0, 1.0, 1.0])}
    measured = {"R-b": {1: 1.0}, "R-d": {1: 4.0}}  # errors x1/4 and x4: geometric mean x1
    out = sibling_transfer(prior, prior, measured, {**FAM, "R-d": "R"}, ["R-a"])["R-a"]
    assert out[1] == pytest.approx(2.0)


def test_other_families_and_jobs_without_a_family_neither_give_nor_take():
    measured = {"X-c": {1: 100.0}}
    out = sibling_transfer(PRIOR, PRIOR, measured, FAM)
    np.testing.assert_allclose(out["R-a"], PRIOR["R-a"])
    out = sibling_transfer(PRIOR, PRIOR, {"R-b": {1: 1.0}}, {**FAM, "R-a": None}, ["R-a"])
    np.testing.assert_allclose(out["R-a"], PRIOR["R-a"])


def test_entries_predicted_zero_stay_zero():
    rows = {**PRIOR, "R-a": np.array([1.0, 0.0, 4.0])}  # does not fit on a p100
    out = sibling_transfer(rows, PRIOR, {"R-b": {1: 1.0, 2: 1.0}}, FAM, ["R-a"])["R-a"]
    assert out[1] == 0.0 and out[2] == pytest.approx(0.5)


def test_sibling_protocol_scores_what_measured_siblings_add():
    """One entry of a job revealed, its siblings fully measured: they fix P1's wrong ratios."""
    from gogh_flows.predict.evaluate import score_siblings, with_siblings
    from gogh_flows.predict.layout import Layout

    layout = Layout(("k80", "p100", "v100"), ())
    names = ["R-1", "R-2", "R-3", "R-4"]
    p1 = np.log(np.array([[1.0, 2.0, 4.0], [2.0, 4.0, 8.0], [3.0, 6.0, 12.0], [4.0, 8.0, 16.0]]))
    # the family really is flat across GPU types: P1's 4x v100/k80 ratio is wrong for all of them
    truth = np.log(np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0], [4.0, 4.0, 4.0]]))

    def shifted(i, obs, sibs):  # P1 moved to the job's own observation
        return np.where(np.isfinite(obs), obs, p1[i] + np.nanmean(obs - p1[i]))

    def shared(i, obs, sibs):
        seen = sibs.copy()
        seen[i] = obs
        refined = np.stack([shifted(k, seen[k], sibs) for k in range(len(names))])
        return with_siblings(refined, p1, seen, layout, names, {n: "R" for n in names})[i]

    own = score_siblings(shifted, truth, layout, repeats=5, seed=0)
    assert own > 0.4  # shifting P1's shape to one observation keeps its wrong ratios
    assert score_siblings(shared, truth, layout, repeats=5, seed=0) == pytest.approx(0.0, abs=1e-9)


def test_the_nearest_batch_size_weighs_most():
    prior = {"F (batch size 32)": np.array([1.0, 1.0]), "F (batch size 64)": np.array([1.0, 1.0]),
             "F (batch size 1024)": np.array([1.0, 1.0])}
    fam = {n: "F" for n in prior}
    sizes = {"F (batch size 32)": 32, "F (batch size 64)": 64, "F (batch size 1024)": 1024}
    measured = {"F (batch size 64)": {1: 2.0}, "F (batch size 1024)": {1: 0.5}}  # errors x2 and x1/2
    out = sibling_transfer(prior, prior, measured, fam, ["F (batch size 32)"], batch_size=sizes)
    w64, w1024 = np.exp(-2.0 * 1), np.exp(-2.0 * 5)
    expected = np.exp((w64 * np.log(2.0) + w1024 * np.log(0.5)) / (w64 + w1024))
    assert out["F (batch size 32)"][1] == pytest.approx(expected)
    assert expected > 1.9  # the sibling one doubling away decides
    flat = sibling_transfer(prior, prior, measured, fam, ["F (batch size 32)"])  # no sizes: equal weights
    assert flat["F (batch size 32)"][1] == pytest.approx(1.0)


def test_inference_runs_are_a_sibling_group_of_their_own():
    from gogh_flows.predict.siblings import family_and_batch

    assert family_and_batch("ResNet-50 (batch size 64)") == ("ResNet-50", 64)
    assert family_and_batch("ResNet-50 (batch size 64) [inference]") == ("ResNet-50 (inference)", 64)
    assert family_and_batch("my-own-net") == (None, None)

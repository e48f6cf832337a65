"""The demo's energy account (gogh_flows/demo.py): drawn, and always on over a common window."""

from __future__ import annotations

import json

import polars as pl
import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.demo import DEMO_FLEET, DemoJob, always_on_kwh, busy_s, wave_rows
from gogh_flows.placement_demo import run_demo


def _rows(spec):
    return pl.DataFrame([{"gpu_id": g, "duration_s": d, "run_energy_j": e, "energy_j": e, "logged_at": t,
                          "extra": json.dumps({})} for g, d, e, t in spec])


def test_always_on_adds_each_empty_gpus_idle_draw_over_the_common_window():
    rows = _rows([("v100-0", 3600.0, 1.0e6, 1.0), ("v100-0", 1800.0, 0.5e6, 2.0), ("a100-1", 7200.0, 2.0e6, 3.0)])
    assert busy_s(rows) == {"v100-0": 3600.0, "a100-1": 7200.0}
    window = 7200.0
    idle = sum(get_gpu_type(t).idle_w * n for t, n in DEMO_FLEET.items()) * window
    idle -= get_gpu_type("v100").idle_w * 3600.0 + get_gpu_type("a100").idle_w * 7200.0  # busy time is in the runs
    assert always_on_kwh([rows], [window]) == pytest.approx((3.5e6 + idle) / 3.6e6)


def test_wave_rows_follow_the_log_order():
    plan = [[DemoJob("a", "LM", 20, 1.0, 10, 0)], [DemoJob("b", "LM", 20, 1.0, 10, 1), DemoJob("c", "LM", 20, 1.0, 10, 1)]]
    rows = _rows([("v100-0", 1.0, 1.0, 3.0), ("v100-1", 1.0, 1.0, 1.0), ("k80-0", 1.0, 1.0, 2.0)])
    first, second = wave_rows(rows, plan)
    assert first["gpu_id"].to_list() == ["v100-1"] and second["gpu_id"].to_list() == ["k80-0", "v100-0"]


def test_wave_only_comparison_says_its_percentages_in_words():
    comparison = run_demo(seed=0).comparison
    ours = comparison.filter(pl.col("policy") == "optimizer")["energy vs optimizer"][0]
    assert ours == "+0.0%"
    assert all(v.endswith("%") and v[0] in "+-" and v != "-0.0%" for v in comparison["energy vs optimizer"])


def test_a_cheaper_runner_up_says_why_it_was_not_chosen():
    """In a wave decided together a job can give up its cheapest slot; the table says why, and only then."""
    table = run_demo(seed=0).explanation.filter(pl.col("runner_up").is_not_null())
    cheaper = table.filter(pl.col("runner_up_energy_kwh") < pl.col("pred_energy_kwh"))
    assert cheaper.height > 0  # the demo's wave contends for its H100s
    assert cheaper["runner_up_not_chosen_because"].null_count() == 0
    assert all("same decision" in why or "total energy" in why or "pairs with" in why
               for why in cheaper["runner_up_not_chosen_because"])
    dearer = table.filter(pl.col("runner_up_energy_kwh") >= pl.col("pred_energy_kwh"))
    assert dearer["runner_up_not_chosen_because"].null_count() == dearer.height


@pytest.mark.parametrize("p1, p2, says", [
    (0.050, 0.030, "the refiner helped"),
    (0.0498, 0.0496, "no clear difference"),  # a demo printed 5.0% against 5.0% as "helped"
    (0.030, 0.050, "made it worse"),
])
def test_the_demo_calls_a_refiner_win_only_when_it_is_one(p1, p2, says):
    from gogh_flows.demo import _refiner_verdict

    assert says in _refiner_verdict(p1, p2)


@pytest.mark.parametrize("per_wave, says", [
    ([0.050, 0.050, 0.013], "fell"),
    ([0.040, 0.020, 0.042], "no clear change"),  # down and back up: the last wave is what it says
    ([0.020, 0.030, 0.045], "rose"),
    ([0.050, float("nan"), float("nan")], "too few waves"),
])
def test_the_demo_says_which_way_the_placement_error_went(per_wave, says):
    """Issue 13: if a run of the demo does not show the error falling, its summary says so."""
    from gogh_flows.demo import _trend_verdict

    assert _trend_verdict(per_wave).startswith(says)


def test_the_plot_takes_a_wave_with_no_comparable_run(tmp_path):
    """A wave whose every run changed company has no placement-time error (None in the summary)."""
    from gogh_flows.demo import _plot

    summary = {"energy_kwh_gogh": 4.9, "energy_kwh_greedy_fastest": 5.8, "energy_kwh_always_on_gogh": 5.4,
               "energy_kwh_always_on_greedy_fastest": 6.4, "sla_attainment": 1.0, "sla_attainment_greedy_fastest": 1.0,
               "placement_mape_per_wave": [0.05, None, 0.013], "p1_mape": 0.04, "p2_mape_after_retrain": 0.039}
    _plot(summary, None, None, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 0


def test_the_placement_error_leaves_out_runs_in_other_company_and_runs_at_a_trial_limit():
    from gogh_flows.demo import _as_predicted

    extras = [{}, {"partners_changed": "placed alone, ran next to LM"}, {"limit_trial_w": "250"},
              {"power_limit_w": "325"}, {"limit_trial_w": "250", "partners_changed": "placed alone, ran next to LM"}]
    assert _as_predicted(extras) == ([True, False, False, True, False], 2, 2)  # the last counted for both


def test_a_retraining_with_too_few_measurements_is_reported_with_its_reason():
    """`gogh demo --waves 2 --wave-size 3` printed "challenger vNone MAPE nan%": the flow had not
    retrained (too few measurements) and the demo formatted the missing figures."""
    from gogh_flows.demo import _retraining_line

    skipped = {"promoted": False, "reason": "only 3 usable measurements in /x (need 4); nothing retrained",
               "measurements": 3, "champion_version": 1}
    line = _retraining_line(skipped)
    assert line.startswith("not retrained: only 3 usable measurements") and "nan" not in line and "None" not in line
    done = {"promoted": True, "challenger_version": 3, "challenger_mape": 0.037, "champion_mape": 0.045,
            "p1_mape": 0.037, "trust_scale": 0.05, "seconds": 4.2}
    assert _retraining_line(done) == ("(4 s) challenger v3 MAPE 3.7% (corrections up to P1 error 0.05) vs "
                                      "champion 4.5%, P1 alone 3.7%: promoted")


def test_the_demos_site_runs_slower_than_the_priors_world_on_its_pcie_boards_only():
    from gogh_flows.demo import DEMO_BOARDS, _site_truth, plan_waves
    from gogh_flows.truth.synthetic import synthetic_table

    assert set(DEMO_BOARDS) == {"v100", "a100"}
    truth = _site_truth(plan_waves(synthetic_table(["k80", "v100", "t4", "a100"], boards=DEMO_BOARDS), 3, 8, 0), 0)
    assert truth["k80"] == truth["t4"] == 0.0
    assert -0.10 < truth["v100"] < -0.03 and -0.10 < truth["a100"] < 0.0

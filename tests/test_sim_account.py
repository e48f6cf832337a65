"""One window for every policy: always-on and parked energy from one run, fair ratios."""

from __future__ import annotations

import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.placement import Gpu, get_policy
from gogh_flows.sim.account import busy_gpu_hours, energy_accounts
from gogh_flows.sim.engine import SimConfig, simulate
from gogh_flows.sim.run import parse_cluster, run_policies
from test_sim_engine import J, _random_stream, _table


def test_hand_computed_window_charges_the_early_finisher_its_idle_tail():
    v100, t4 = get_gpu_type("v100"), get_gpu_type("t4")
    gpus = [Gpu("v", "v100"), Gpu("t", "t4")]
    fast = simulate([J("x", "a", 1000.0, 0.0, 8.0)], gpus, _table(), get_policy("greedy-fastest"))
    assert fast.end_s == pytest.approx(100.0)  # 1000 steps at 10/s on the V100
    # first-fit with the T4 listed first: 1000 steps at 4/s, so it sets the window's end
    slow = simulate([J("x", "a", 1000.0, 0.0, 2.0)], gpus[::-1], _table(), get_policy("first-fit"))
    assert slow.end_s == pytest.approx(250.0) and slow.jobs["x"].gpu_type == "t4"
    acc = energy_accounts({"greedy-fastest": fast, "first-fit": slow})
    assert acc["greedy-fastest"].window_s == 250.0 == acc["first-fit"].window_s
    # by hand (activity 0.5): V100 busy 40 + 0.5 x 260 = 170 W, T4 busy 10 + 0.5 x 60 = 40 W
    assert (v100.idle_w, v100.tdp_w, t4.idle_w, t4.tdp_w) == (40, 300, 10, 70)
    # greedy-fastest, always on: 100 s of the V100 busy and the T4 idle (17,000 + 1,000 J), then
    # both idle (50 W) for the 150 s the window runs on past its end: 25,500 J
    assert acc["greedy-fastest"].always_on_kwh * 3.6e6 == pytest.approx(25_500.0)
    # first-fit: 250 s of the T4 busy and the V100 idle (10,000 + 10,000 J), no tail
    assert acc["first-fit"].always_on_kwh * 3.6e6 == pytest.approx(20_000.0)
    # parked: only what the boards with a job drew
    assert acc["greedy-fastest"].parked_kwh * 3.6e6 == pytest.approx(17_000.0)
    assert acc["first-fit"].parked_kwh * 3.6e6 == pytest.approx(10_000.0)
    assert acc["first-fit"].always_on_vs["greedy-fastest"] == pytest.approx(20_000 / 25_500)
    assert acc["first-fit"].parked_vs["greedy-fastest"] == pytest.approx(10_000 / 17_000)
    assert "oracle" not in acc["first-fit"].parked_vs  # only references that ran


def test_busy_gpu_hours_say_where_the_work_went():
    gpus = [Gpu("v", "v100"), Gpu("t", "t4")]
    fast = simulate([J("x", "a", 1000.0, 0.0, 8.0)], gpus, _table(), get_policy("greedy-fastest"))
    slow = simulate([J("x", "a", 1000.0, 0.0, 2.0)], gpus, _table(), get_policy("first-fit"))
    assert busy_gpu_hours(fast) == pytest.approx({"v100": 100.0 / 3600, "t4": 0.0})
    assert busy_gpu_hours(slow)["v100"] + busy_gpu_hours(slow)["t4"] == pytest.approx(slow.end_s / 3600)
    # many jobs of one type (no pair to share a board), gangs among them, no moves: the busy
    # GPU-hours are each job's time on its GPUs times their number
    jobs = [j for j in _random_stream(40, seed=7) if j.job_type == "a"]
    assert any(j.num_gpus == 2 for j in jobs)
    run = run_policies(jobs, parse_cluster("v100=3,t4=3"), _table(), ["greedy-fastest"],
                       config=SimConfig(rebalance=False))["greedy-fastest"]
    on_gpus: dict[str, float] = {}
    for j in jobs:
        r = run.jobs[j.id]
        on_gpus[r.gpu_type] = on_gpus.get(r.gpu_type, 0.0) + j.num_gpus * (r.finished_s - r.placed_s) / 3600
    assert busy_gpu_hours(run) == pytest.approx({t: on_gpus.get(t, 0.0) for t in ("v100", "t4")})


def test_parked_account_of_an_always_on_run_equals_a_parked_run():
    jobs = _random_stream(25, seed=7)
    gpus = parse_cluster("v100=3,t4=3")
    names = ["oracle", "greedy-fastest", "first-fit"]
    on = run_policies(jobs, gpus, _table(), names, config=SimConfig(rebalance=False))
    off = run_policies(jobs, gpus, _table(), names, config=SimConfig(rebalance=False, park_idle=True))
    a_on, a_off = energy_accounts(on), energy_accounts(off, parked_run=True)
    for n in names:
        assert on[n].end_s == pytest.approx(off[n].end_s)  # same decisions either way
        assert a_on[n].parked_kwh == pytest.approx(a_off[n].parked_kwh, rel=1e-9)
        assert a_on[n].always_on_kwh == pytest.approx(a_off[n].always_on_kwh, rel=1e-9)
        assert a_on[n].always_on_vs["oracle"] == pytest.approx(a_on[n].always_on_kwh / a_on["oracle"].always_on_kwh)
    assert a_on["oracle"].always_on_vs["oracle"] == 1.0 and a_on["oracle"].parked_vs["greedy-fastest"] > 0


def test_the_plot_shows_the_common_window_not_each_runs_own_energy(tmp_path):
    """`gogh simulate --plot` ranked policies by each run's own energy, which can reverse the
    table's common-window ranking (a new user's report); it now plots the table's figures."""
    from gogh_flows.sim.plots import energy_points, plot_comparison

    gpus = [Gpu("v", "v100"), Gpu("t", "t4")]
    fast = simulate([J("x", "a", 1000.0, 0.0, 8.0)], gpus, _table(), get_policy("greedy-fastest"))
    # first-fit on the T4 listed first: slower, so it sets the window's end
    slow = simulate([J("x", "a", 1000.0, 0.0, 2.0)], gpus[::-1], _table(), get_policy("first-fit"))
    assert slow.end_s > fast.end_s
    results = {"greedy-fastest": fast, "first-fit": slow}
    acc = energy_accounts(results)
    points = energy_points(results)
    for name, res in results.items():
        assert points[name] == (res.summary()["sla_attainment"], acc[name].always_on_kwh, acc[name].parked_kwh)
    # the early finisher is charged its idle tail: own-run energy would have favoured it
    assert points["greedy-fastest"][1] * 3.6e6 > fast.energy_j
    png = plot_comparison(results, tmp_path / "p.png", seed=3)
    assert png.stat().st_size > 0

import dataclasses

import pytest

from gogh_flows.catalog import UnknownGpuTypeError
from gogh_flows.sim.run import SIM_POLICIES, make_policy, parse_cluster, run_policies
from test_sim_engine import _random_stream, _table


def test_parse_cluster():
    gpus = parse_cluster("V100=2, t4=3")
    assert [g.id for g in gpus] == ["v100-0", "v100-1", "t4-0", "t4-1", "t4-2"]
    assert {g.gpu_type for g in gpus} == {"v100", "t4"}


@pytest.mark.parametrize("spec, err, match", [
    ("v100", ValueError, "TYPE=COUNT"),
    ("v100=0", ValueError, "TYPE=COUNT"),
    ("v100=2,v100=3", ValueError, "twice"),
    ("x100=4", UnknownGpuTypeError, "x100"),
    ("", ValueError, "no GPUs"),
])
def test_parse_cluster_errors(spec, err, match):
    with pytest.raises(err, match=match):
        parse_cluster(spec)


def test_every_policy_runs_on_the_identical_stream():
    jobs = _random_stream(30, seed=4)
    gpus = parse_cluster("v100=3,t4=3")
    seen = []
    results = run_policies(jobs, gpus, _table(), SIM_POLICIES,
                           progress=lambda name, done, total: seen.append((name, total)))
    assert list(results) == list(SIM_POLICIES)
    for name, res in results.items():
        assert set(res.jobs) == {j.id for j in jobs}, name
        assert res.summary()["jobs_completed"] == 30, name
    assert {name for name, _ in seen} == set(SIM_POLICIES) and all(t == 30 for _, t in seen)
    # The reference plans with the truth: it never runs a job below its requirement.
    assert results["oracle"].summary()["sla_attainment"] == pytest.approx(1.0)


def test_unknown_policy_is_named_before_anything_runs():
    with pytest.raises(ValueError, match="unknown simulation policy 'fastest'"):
        run_policies([], parse_cluster("v100=1"), _table(), ["oracle", "fastest"])


def test_interleaved_first_fit_alternates_gpu_types():
    from gogh_flows.placement import Job, PlacementProblem, get_policy
    from gogh_flows.placement.baselines import interleaved_order

    gpus = parse_cluster("v100=2,t4=3", capacity=1)
    order = [g.id for g in interleaved_order(gpus)]
    assert order == ["v100-0", "t4-0", "v100-1", "t4-1", "t4-2"]
    assert sorted(order) == sorted(g.id for g in gpus)
    # On an idle fleet listed V100 first, plain first-fit fills the V100s first; the
    # interleaved variant takes one GPU of each type in turn.
    jobs = [Job(f"j{i}", "a", 1.0, 100.0) for i in range(4)]
    problem = PlacementProblem.build(gpus, jobs, _table())
    plain = {a.job_id: a.gpus[0] for a in get_policy("first-fit").place(problem).assignments}
    mixed = {a.job_id: a.gpus[0] for a in get_policy("first-fit-interleaved").place(problem).assignments}
    assert [plain[f"j{i}"] for i in range(4)] == ["v100-0", "v100-1", "t4-0", "t4-1"]
    assert [mixed[f"j{i}"] for i in range(4)] == ["v100-0", "t4-0", "v100-1", "t4-1"]


def test_rebalancing_follows_each_policy_objective():
    from gogh_flows.sim.engine import rebalance_objective

    table = _table()
    expected = {"oracle": "energy", "greedy-fastest": "time", "greedy-efficiency": "energy",
                "greedy-min-power": None, "first-fit": None, "first-fit-interleaved": None,
                "random": None}
    assert set(expected) == set(SIM_POLICIES)
    expected["greedy-fastest+cap"] = "time"
    for name, objective in expected.items():
        assert rebalance_objective(make_policy(name, table).policy) == objective, name


def test_simulate_cli_knows_the_interleaved_policy_and_rebalance_options(gavel_dir, tmp_path):
    import json

    from gogh_flows.cli import main

    args = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
            "--trace", str(gavel_dir / "traces" / "physical_cluster" / "small_test.trace"),
            "--cluster", "v100=2,p100=2,k80=4", "--capacity", "1",
            "--policy", "greedy-fastest,first-fit-interleaved", "--seed", "1"]
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    assert main([*args, "--migration-s", "30", "--rebalance-gain", "0.3", "--json", str(on)]) == 0
    assert main([*args, "--no-rebalance", "--json", str(off)]) == 0
    data_on, data_off = json.loads(on.read_text()), json.loads(off.read_text())
    assert set(data_on["policies"]) == {"greedy-fastest", "first-fit-interleaved"}
    assert (data_on["rebalance"], data_on["rebalance_gain"], data_on["migration_s"]) == (True, 0.3, 30.0)
    assert data_off["rebalance"] is False
    assert all(p["rebalances"] == 0 for p in data_off["policies"].values())
    assert data_on["policies"]["first-fit-interleaved"]["rebalances"] == 0


def test_jobs_left_unfinished_are_said_under_the_table_with_what_they_mean_for_the_ratios():
    """With noise a job can miss its requirement on every type and stay unfinished; only the
    jobs_unfinished column showed it, while the docs call such energy figures not comparable."""
    from gogh_flows.sim.cli import unfinished_notes

    none = {0: {"oracle": {"jobs_unfinished": 0}, "greedy-fastest": {"jobs_unfinished": 0}}}
    assert unfinished_notes(none) == []
    alike = {0: {"oracle": {"jobs_unfinished": 1}, "greedy-fastest": {"jobs_unfinished": 1}}}
    (note,) = unfinished_notes(alike)
    assert note.startswith("note: every policy left 1 job(s) unfinished") and "alike for every policy" in note
    differ = {1: {"oracle": {"jobs_unfinished": 0}, "gogh": {"jobs_unfinished": 2}}, 2: none[0]}
    (note,) = unfinished_notes(differ)
    assert note.startswith("note (seed 1): policies left different numbers of jobs unfinished (oracle 0, gogh 2)")
    assert "not comparable" in note
    # ...and the spread over seeds marks the policy that did less work on some seed
    from gogh_flows.sim.cli import fewer_done

    assert fewer_done(differ) == {"gogh"} and fewer_done(alike) == set() and fewer_done(none) == set()


def test_the_capped_greedy_baseline_places_as_greedy_fastest_at_its_cap_and_is_lifted_when_short():
    """The simple baseline for ``+limits``: greedy-fastest's GPU, every board at one fraction of its range."""
    from gogh_flows.energy import EnergyModel
    from gogh_flows.placement import Job, PlacementProblem, get_policy
    from gogh_flows.placement.baselines import CappedGreedyFastest
    from gogh_flows.placement.problem import level_watts

    gpus = parse_cluster("v100=2,t4=2")
    jobs = [Job(f"j{i}", "a", 1.0, 100.0) for i in range(3)]
    problem = PlacementProblem.build(gpus, jobs, _table())
    fastest = get_policy("greedy-fastest").place(problem)
    capped = make_policy("greedy-fastest+cap", _table()).policy.place(problem)
    assert [(a.job_id, a.gpus) for a in capped.assignments] == [(a.job_id, a.gpus) for a in fastest.assignments]
    assert all(a.power_limit_w == level_watts(EnergyModel().gpu(a.gpu_type), 0.0) for a in capped.assignments)
    with pytest.raises(ValueError, match="cap_fraction is a share"):
        CappedGreedyFastest(cap_fraction=1.5)
    # in the simulator a job short of its requirement at the cap is lifted once observed (300 s after
    # it starts): jobs long enough to be observed keep their requirement nearly all their lives
    stream = [dataclasses.replace(j, total_steps=j.total_steps * 100) for j in _random_stream(30, seed=4)]
    results = run_policies(stream, parse_cluster("v100=3,t4=3"), _table(), ["greedy-fastest", "greedy-fastest+cap"])
    assert results["greedy-fastest+cap"].summary()["jobs_completed"] == 30
    assert results["greedy-fastest+cap"].summary()["sla_attainment"] >= 0.98


def test_the_floor_may_use_the_limit_levels_when_the_capped_baseline_runs():
    """A floor without the levels a policy used is no floor for it: the capped baseline beat it."""
    from gogh_flows.sim.cli import _floor_levels
    from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS

    assert _floor_levels(["greedy-fastest", "greedy-fastest+cap"]) == DEFAULT_LIMIT_LEVELS
    assert _floor_levels(["greedy-fastest", "oracle"]) == ()


def test_the_policies_decide_with_the_energy_model_given_and_the_boards_draw_the_same():
    """``energy`` is what the policies decide with (an always-on fleet's draw above idle, say);
    the boards' draw, and so every figure of a policy that decides without it, is the same."""
    import gogh_flows.sim.run as run_module
    from gogh_flows.energy import EnergyModel

    jobs, gpus = _random_stream(12, seed=3), parse_cluster("v100=2,t4=2")
    above_idle = EnergyModel(count_idle=False)
    plain = run_policies(jobs, gpus, _table(), ["greedy-fastest"])["greedy-fastest"]
    given = run_policies(jobs, gpus, _table(), ["greedy-fastest"], energy=above_idle)["greedy-fastest"]
    untimed = [{k: v for k, v in r.summary().items() if "_ms" not in k} for r in (plain, given)]  # decision times vary
    assert given.energy_j == pytest.approx(plain.energy_j) and untimed[0] == untimed[1]
    seen = []
    real = run_module.simulate
    run_module.simulate = lambda *a, **kw: seen.append(kw["energy"]) or real(*a, **kw)
    try:
        run_policies(jobs, gpus, _table(), ["oracle+limits"], energy=above_idle)
    finally:
        run_module.simulate = real
    assert seen == [above_idle]

"""Waiting for an efficient GPU (placement.patience), in the core and in the simulator."""

from __future__ import annotations

import pytest

from gogh_flows.energy import EnergyModel
from gogh_flows.placement import GoghOptimizer, Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.options import FleetState
from gogh_flows.placement.patience import HELD, HeldAhead, Patience, _free_times, hold_for_efficiency
from gogh_flows.placement.problem import TableThroughputs
from gogh_flows.sim.engine import SimConfig, simulate
from gogh_flows.sim.run import DEFAULT_LIMIT_LEVELS, WAIT_POLICIES, WAIT_S, make_policy, run_policies
from gogh_flows.sim.traces import TraceJob
from gogh_flows.truth.table import ThroughputTable


def _table() -> ThroughputTable:
    """'gain' runs 20x faster on the H100 (about half the energy per step of the T4)."""
    rows = []
    for gpu, tput in (("h100", 200.0), ("t4", 10.0)):
        rows.append({"job_type": "gain", "gpu_type": gpu, "scale_factor": 1, "throughput": tput, "activity": 0.9})
    return ThroughputTable.from_rows(rows)


def _busy_h100(first_steps: float = 2e5) -> tuple[PlacementProblem, object]:
    """The H100 runs one 'gain' job (2e5 steps: free in 1000 s); a second arrives with only the T4 free."""
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    jobs = [Job("first", "gain", 1.0, first_steps, gpus=("h",)), Job("new", "gain", 1.0, 1e6)]
    problem = PlacementProblem.build(gpus, jobs, _table())
    placement = GoghOptimizer().place(problem)
    assert placement.assignment("new").gpu_type == "t4"
    return problem, placement


def test_a_new_job_is_held_for_a_type_that_saves_enough_energy():
    problem, placement = _busy_h100()
    kept, held = hold_for_efficiency(placement, problem, {"new": 0.0}, Patience(3600.0))
    assert "new" not in kept.placed_ids and set(held) == {"new"}
    why = next(w for w in kept.waiting if w.job_id == "new").reason
    assert why.startswith(HELD) and "h100" in why and "t4" in why and "3600 s" in why
    saving = float(why.split(" would use ")[1].split("%")[0]) / 100
    assert 0.3 < saving < 0.9


@pytest.mark.parametrize("waited, patience", [
    (3600.0, Patience(3600.0)),  # waited long enough: it takes what is free
    (0.0, Patience(3600.0, min_saving=0.95)),  # the H100 would not save 95%
    (0.0, Patience(0.0)),  # no patience: never held
])
def test_a_job_is_not_held_past_its_patience_or_for_a_small_saving(waited, patience):
    problem, placement = _busy_h100()
    kept, held = hold_for_efficiency(placement, problem, {"new": waited}, patience)
    assert held == {} and kept.assignment("new").gpu_type == "t4"


def test_only_the_jobs_named_as_waiting_can_be_held():
    problem, placement = _busy_h100()
    kept, held = hold_for_efficiency(placement, problem, {}, Patience(3600.0))
    assert held == {} and kept is placement


@pytest.mark.parametrize("running_on_t4", [False, True], ids=["a-new-pair", "a-join"])
def test_a_job_sharing_a_board_is_never_held(running_on_t4):
    """Its partner was placed counting on it: holding one half of a pair (or a job joining a
    running one) would leave the other planned next to a job that is not there."""
    rows = [r for r in _table().frame.iter_rows(named=True) if r["partner"] is None]
    rows.append({"job_type": "gain", "gpu_type": "t4", "scale_factor": 1, "partner": "gain", "throughput": 8.0,
                 "partner_throughput": 8.0})
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 2)]
    jobs = [Job("first", "gain", 1.0, 2e5, gpus=("h",)), Job("new", "gain", 1.0, 1e6),
            Job("other", "gain", 1.0, 1e6, gpus=("t",) if running_on_t4 else ())]
    problem = PlacementProblem.build(gpus, jobs, ThroughputTable.from_rows(rows))
    placement = GoghOptimizer().place(problem)
    new = placement.assignment("new")
    assert new.gpu_type == "t4" and new.partner == "other"
    waited = {"new": 0.0} if running_on_t4 else {"new": 0.0, "other": 0.0}
    kept, held = hold_for_efficiency(placement, problem, waited, Patience(3600.0))
    assert held == {} and kept is placement
    # alone on the T4, the same job would have been held for the H100
    alone = PlacementProblem.build(gpus, jobs[:2], ThroughputTable.from_rows(rows))
    assert set(hold_for_efficiency(GoghOptimizer().place(alone), alone, {"new": 0.0}, Patience(3600.0))[1]) == {"new"}


@pytest.mark.parametrize("kwargs, match", [
    ({"max_wait_s": -1.0}, "max_wait_s"), ({"max_wait_s": float("inf")}, "max_wait_s"),
    ({"max_wait_s": 60.0, "min_saving": 0.0}, "min_saving"), ({"max_wait_s": 60.0, "min_saving": 1.0}, "min_saving"),
])
def test_patience_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Patience(**kwargs)


def _stream() -> list[TraceJob]:
    # 'first' holds the H100 for 1e6 / 200 = 5000 s; 'second' arrives at 100 s and would be done
    # on the T4 (2000 s) before the H100 frees, so nothing moves it there later
    return [TraceJob("first", "gain", 1e6, 1, 0.0, required_throughput=5.0),
            TraceJob("second", "gain", 2e4, 1, 100.0, required_throughput=5.0)]


def _run(patience: Patience | None):
    policy = GoghOptimizer(name="oracle")
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    return simulate(_stream(), gpus, _table(), policy, planning=TableThroughputs(_table()), patience=patience)


def test_the_simulator_holds_a_job_until_the_efficient_gpu_frees_and_saves_energy():
    now, waited = _run(None), _run(Patience(6 * 3600.0))
    assert now.jobs["second"].gpu_type == "t4" and now.jobs["second"].placed_s == 100.0
    second = waited.jobs["second"]
    assert second.gpu_type == "h100"
    assert second.placed_s == pytest.approx(waited.jobs["first"].finished_s)  # the moment the H100 freed
    assert waited.energy_j < now.energy_j
    assert waited.summary()["sla_attainment"] == pytest.approx(1.0)


def test_the_simulator_places_a_held_job_when_its_patience_runs_out():
    short = _run(Patience(1000.0))
    second = short.jobs["second"]
    assert second.gpu_type == "t4" and second.placed_s == pytest.approx(100.0 + 1000.0)
    assert short.summary()["jobs_completed"] == 2


def test_within_reach_the_simulator_does_not_hold_a_job_for_a_gpu_that_frees_after_its_patience():
    """The H100 frees at 5000 s; a job that may wait 1000 s from 100 s would wait for nothing."""
    now = _run(Patience(1000.0, within_reach=True))
    second = now.jobs["second"]
    assert second.gpu_type == "t4" and second.placed_s == pytest.approx(100.0)


def test_wait_policies_build_on_the_optimisers_with_the_fixed_patience():
    assert "oracle+limits+fleet+wait" in WAIT_POLICIES and "greedy-fastest+wait" not in WAIT_POLICIES
    p = make_policy("oracle+limits+fleet+wait", _table())
    assert p.patience == Patience(WAIT_S) and p.reoptimize_s > 0 and p.policy.power_limit_levels
    assert p.policy.power_limit_levels == DEFAULT_LIMIT_LEVELS
    # a run may name its own levels (benchmarks/limit_levels.py compares them), through every modifier
    assert make_policy("oracle+limits+fleet+wait", _table(), limit_levels=(0.0, 0.5)).policy.power_limit_levels == (0.0, 0.5)
    res = run_policies(_stream(), [Gpu("h", "h100", 1), Gpu("t", "t4", 1)], _table(), ["oracle", "oracle+wait"])
    assert res["oracle+wait"].jobs["second"].gpu_type == "h100" and res["oracle"].jobs["second"].gpu_type == "t4"


def test_a_wait_policys_patience_can_be_set_per_run():
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    short = run_policies(_stream(), gpus, _table(), ["oracle+wait"],
                         patience=Patience(1000.0))["oracle+wait"]
    assert short.jobs["second"].gpu_type == "t4" and short.jobs["second"].placed_s == pytest.approx(1100.0)


def test_gogh_simulate_sets_the_patience_and_refuses_it_without_a_wait_policy(gavel_dir, tmp_path, capsys):
    import json

    from gogh_flows.cli import main

    base = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace", "generate:12",
            "--rate", "4", "--cluster", "v100=2,p100=2,k80=2"]
    out = tmp_path / "s.json"
    assert main([*base, "--policy", "oracle,oracle+wait", "--wait-hours", "0.5", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["wait_hours"] == 0.5 and figures["wait_saving"] == 0.1 and figures["wait_within_reach"] is False
    assert main([*base, "--policy", "oracle+wait", "--wait-within-reach", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["wait_within_reach"] is True
    assert set(figures["policies"]) == {"oracle", "oracle+wait"}
    capsys.readouterr()
    assert main([*base, "--policy", "oracle", "--wait-hours", "1"]) == 2
    assert "apply to the +wait policies" in capsys.readouterr().err
    assert main([*base, "--policy", "oracle", "--wait-within-reach"]) == 2
    assert "--wait-within-reach apply to the +wait policies" in capsys.readouterr().err
    assert main([*base, "--policy", "oracle+wait", "--wait-saving", "1.5"]) == 2
    assert "--wait-saving must be a share of energy in (0, 1)" in capsys.readouterr().err


def test_held_jobs_do_not_keep_the_jobs_behind_them_from_free_gpus():
    """A whole decision window of held jobs used to read as a full fleet: a job behind them that
    only the (free) T4s can run waited until the holds ran out."""
    rows = [{"job_type": "gain", "gpu_type": g, "scale_factor": 1, "throughput": t, "activity": 0.9}
            for g, t in (("h100", 200.0), ("t4", 10.0))]
    rows += [{"job_type": "plain", "gpu_type": "t4", "scale_factor": 1, "throughput": 10.0, "activity": 0.9},
             {"job_type": "plain", "gpu_type": "h100", "scale_factor": 1, "throughput": 0.0, "activity": 0.9}]
    table = ThroughputTable.from_rows(rows)
    gpus = [Gpu("h", "h100", 1), *(Gpu(f"t{i}", "t4", 1) for i in range(4))]
    stream = [TraceJob("first", "gain", 1e6, 1, 0.0, required_throughput=5.0),
              *(TraceJob(f"held{i}", "gain", 2e4, 1, 100.0 + i, required_throughput=5.0) for i in range(3)),
              TraceJob("plain", "plain", 2e4, 1, 200.0, required_throughput=5.0)]
    res = simulate(stream, gpus, table, GoghOptimizer(name="oracle"), planning=TableThroughputs(table),
                   config=SimConfig(decision_window=3), patience=Patience(3000.0))
    assert res.jobs["plain"].placed_s == 200.0 and res.jobs["plain"].gpu_type == "t4"
    assert all(res.jobs[f"held{i}"].placed_s == pytest.approx(3100.0 + i) for i in range(3))  # patience ran out


def test_no_job_is_held_for_a_type_that_is_free_or_that_it_could_never_get():
    rows = [{"job_type": "gain", "gpu_type": g, "scale_factor": s, "throughput": x * s, "activity": 0.9}
            for g, x in (("h100", 200.0), ("a100", 150.0), ("t4", 10.0)) for s in (1, 2)]
    table = ThroughputTable.from_rows(rows)
    # greedy-fastest takes the free H100 though the free A100 would use less energy: waiting
    # would change nothing, the A100 is free now
    free_both = PlacementProblem.build([Gpu("h", "h100", 1), Gpu("a", "a100", 1)], [Job("new", "gain", 1.0, 1e6)],
                                       table)
    fastest = get_policy("greedy-fastest").place(free_both)
    assert fastest.assignment("new").gpu_type == "h100"
    assert hold_for_efficiency(fastest, free_both, {"new": 0.0}, Patience(3600.0))[1] == {}
    # a 2-GPU gang: the H100s are of capacities 1 and 2, never two of one class, so no wait helps
    split = PlacementProblem.build([Gpu("h1", "h100", 1), Gpu("h2", "h100", 2), Gpu("t1", "t4", 1),
                                    Gpu("t2", "t4", 1)], [Job("gang", "gain", 1.0, 1e6, 2)], table)
    placed = GoghOptimizer().place(split)
    assert hold_for_efficiency(placed, split, {"gang": 0.0}, Patience(3600.0))[1] == {}


def test_an_always_on_fleet_holds_for_the_dynamic_saving_only():
    """Idle draw is paid either way with GPUs always on: a type that saves 17% counting the
    boards' idle power but 12.5% without it is worth a hold at 15% only when idle GPUs park."""
    table = ThroughputTable.from_rows([
        {"job_type": "gain", "gpu_type": g, "scale_factor": 1, "throughput": t, "activity": 0.9}
        for g, t in (("h100", 120.0), ("t4", 10.0))])
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    problem = PlacementProblem.build(gpus, [Job("first", "gain", 1.0, 2e5, gpus=("h",)),
                                            Job("new", "gain", 1.0, 1e6)], table)
    placement = GoghOptimizer().place(problem)
    patience = Patience(3600.0, min_saving=0.15)
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, patience)[1]) == {"new"}
    dynamic = EnergyModel(count_idle=False)
    assert hold_for_efficiency(placement, problem, {"new": 0.0}, patience, energy=dynamic)[1] == {}


def test_within_reach_a_job_is_held_only_for_a_type_predicted_to_free_before_its_patience_runs_out():
    """The H100's job has 5000 s left at 200 steps/s: a run that may wait an hour is not held for
    it (it would wait the hour and then take what is free); one that may wait two hours is."""
    problem, placement = _busy_h100(first_steps=1e6)
    reach = dict(within_reach=True)
    assert hold_for_efficiency(placement, problem, {"new": 0.0}, Patience(3600.0, **reach))[1] == {}
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, Patience(7200.0, **reach))[1]) == {"new"}
    # what it has waited already counts against the time left
    assert hold_for_efficiency(placement, problem, {"new": 3000.0}, Patience(7200.0, **reach))[1] == {}
    # by default a job is held for any busy type, however long its line
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, Patience(3600.0))[1]) == {"new"}


def test_a_board_s_limit_and_a_partner_lengthen_the_wait_for_it():
    """The predicted end of a GPU's occupants is at its power limit, and a pair runs at its shared
    rates until one ends, the other then alone."""
    rows = [{"job_type": "gain", "gpu_type": g, "scale_factor": 1, "throughput": t, "activity": 0.9}
            for g, t in (("h100", 200.0), ("t4", 10.0))]
    rows.append({"job_type": "gain", "gpu_type": "h100", "scale_factor": 1, "partner": "gain", "throughput": 100.0,
                 "partner_throughput": 100.0})
    table = ThroughputTable.from_rows(rows)

    def ends(*running: Job) -> float:
        problem = PlacementProblem.build([Gpu("h", "h100", 2), Gpu("t", "t4", 1)], list(running), table)
        return _free_times(problem, FleetState(problem), "h100")[0]

    full = ends(Job("first", "gain", 1.0, 6e5, gpus=("h",)))
    assert full == pytest.approx(3000.0)  # 6e5 steps at 200/s
    assert ends(Job("first", "gain", 1.0, 6e5, gpus=("h",), power_limit_w=200.0)) > 1.05 * full  # H100 at 200 W
    # 'a' (1e5 steps at 100/s shared) ends at 1000 s; 'b' has 4e5 of its 5e5 left, alone at 200/s
    assert ends(Job("a", "gain", 1.0, 1e5, gpus=("h",)), Job("b", "gain", 1.0, 5e5, gpus=("h",))) == \
        pytest.approx(1000.0 + 4e5 / 200.0)


def test_a_job_behind_a_line_of_held_jobs_is_not_held_when_the_line_outlasts_its_patience():
    """Two jobs already held for the one H100 (1000 s each there) put a third, whose patience is
    2500 s, behind 1000 s (the H100's own job) + 2000 s: it takes the T4 now."""
    problem, placement = _busy_h100()
    line = HeldAhead([("h100", 1, 1000.0), ("h100", 1, 1000.0)])
    patience = Patience(2500.0, within_reach=True)
    assert hold_for_efficiency(placement, problem, {"new": 0.0}, patience, ahead=line)[1] == {}
    short_line = HeldAhead([("h100", 1, 1000.0)])
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, patience, ahead=short_line)[1]) == {"new"}
    assert short_line.jobs[-1][:2] == ("h100", 1)  # the hold joins the line for the next job behind it
    # a line for another type is not this type's
    other = HeldAhead([("a100", 1, 1e9)])
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, patience, ahead=other)[1]) == {"new"}


def test_within_reach_the_simulator_sees_the_line_of_jobs_it_held_before():
    """Three jobs arrive behind the H100's job (1000 s left); each would take 5000 s on the H100
    (1e6 steps at 200/s) and may wait 3 h: the first two are held (the second starts at about
    6000 s), the third would start after 11000 s, so it starts on a T4 at once (and moves to the
    H100 when it frees, as any running job may)."""
    gpus = [Gpu("h", "h100", 1), *(Gpu(f"t{i}", "t4", 1) for i in range(3))]
    stream = [TraceJob("first", "gain", 2e5, 1, 0.0, required_throughput=5.0),
              *(TraceJob(f"n{i}", "gain", 1e6, 1, 10.0 + i, required_throughput=5.0) for i in range(3))]
    res = simulate(stream, gpus, _table(), GoghOptimizer(name="oracle"), planning=TableThroughputs(_table()),
                   patience=Patience(3 * 3600.0, within_reach=True))
    assert sorted(res.jobs[f"n{i}"].placed_s for i in range(2)) == pytest.approx([1000.0, 6000.0])
    assert res.jobs["n2"].placed_s == pytest.approx(12.0)
    # without the line, all three were held, one until its patience ran out (10 s + 3 h)
    blind = simulate(stream, gpus, _table(), GoghOptimizer(name="oracle"), planning=TableThroughputs(_table()),
                     patience=Patience(3 * 3600.0))
    assert sorted(blind.jobs[f"n{i}"].placed_s for i in range(3)) == pytest.approx([1000.0, 6000.0, 10810.0])


def test_within_reach_a_job_held_leaves_its_gpu_to_the_jobs_after_it():
    """A is placed on the T4 and held for the H100 (free in 200 s); B, placed on the K80, cannot
    reach the H100 behind A (200 s + A's 1000 s there, past its 1000 s patience), but the T4 that A
    leaves is free: B is held for it, not left on the K80 as if A still ran there for 20,000 s."""
    from gogh_flows.placement.result import Assignment, Placement

    rows = [{"job_type": "gain", "gpu_type": g, "scale_factor": 1, "throughput": t, "activity": 0.9}
            for g, t in (("h100", 1000.0), ("t4", 50.0), ("k80", 5.0))]
    table = ThroughputTable.from_rows(rows)
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1), Gpu("k", "k80", 1)]
    jobs = [Job("first", "gain", 1.0, 2e5, gpus=("h",)), Job("A", "gain", 1.0, 1e6), Job("B", "gain", 1.0, 1e6)]
    problem = PlacementProblem.build(gpus, jobs, table)
    placement = Placement("test", (Assignment("A", "t4", ("t",), 50.0, 1.0), Assignment("B", "k80", ("k",), 5.0, 1.0)),
                          (), "heuristic", float("nan"), 0.0)
    _, held = hold_for_efficiency(placement, problem, {"A": 0.0, "B": 0.0}, Patience(1000.0, within_reach=True))
    assert held["A"].startswith("h100 would use") and held["B"].startswith("t4 would use"), held


def test_within_reach_the_line_spans_the_simulator_s_decision_windows():
    """With one job per decision window, the jobs held in earlier windows of the same pass are
    still ahead in the line: the third of three jobs for the one H100 is not held."""
    gpus = [Gpu("h", "h100", 1), *(Gpu(f"t{i}", "t4", 1) for i in range(3))]
    stream = [TraceJob("first", "gain", 2e5, 1, 0.0, required_throughput=5.0),
              *(TraceJob(f"n{i}", "gain", 1e6, 1, 10.0, required_throughput=5.0) for i in range(3))]
    res = simulate(stream, gpus, _table(), GoghOptimizer(name="oracle"), planning=TableThroughputs(_table()),
                   config=SimConfig(decision_window=1), patience=Patience(3 * 3600.0, within_reach=True))
    starts = sorted(res.jobs[f"n{i}"].placed_s for i in range(3))
    assert starts == pytest.approx([10.0, 1000.0, 6000.0])  # one on a T4 at once, two held for the H100

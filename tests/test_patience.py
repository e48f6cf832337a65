"""Waiting for an efficient GPU (placement.patience), in the core and in the simulator."""

from __future__ import annotations

import pytest

from gogh_flows.energy import EnergyModel
from gogh_flows.placement import GoghOptimizer, Gpu, Job, PlacementProblem, get_policy
from gogh_flows.placement.patience import HELD, Patience, hold_for_efficiency
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


def _busy_h100() -> tuple[PlacementProblem, object]:
    """The H100 runs one 'gain' job; a second arrives with only the T4 free."""
    gpus = [Gpu("h", "h100", 1), Gpu("t", "t4", 1)]
    jobs = [Job("first", "gain", 1.0, 1e6, gpus=("h",)), Job("new", "gain", 1.0, 1e6)]
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
    jobs = [Job("first", "gain", 1.0, 1e6, gpus=("h",)), Job("new", "gain", 1.0, 1e6),
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
    short = run_policies(_stream(), gpus, _table(), ["oracle+wait"], patience=Patience(1000.0))["oracle+wait"]
    assert short.jobs["second"].gpu_type == "t4" and short.jobs["second"].placed_s == pytest.approx(1100.0)


def test_gogh_simulate_sets_the_patience_and_refuses_it_without_a_wait_policy(gavel_dir, tmp_path, capsys):
    import json

    from gogh_flows.cli import main

    base = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace", "generate:12",
            "--rate", "4", "--cluster", "v100=2,p100=2,k80=2"]
    out = tmp_path / "s.json"
    assert main([*base, "--policy", "oracle,oracle+wait", "--wait-hours", "0.5", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["wait_hours"] == 0.5 and figures["wait_saving"] == 0.1
    assert set(figures["policies"]) == {"oracle", "oracle+wait"}
    capsys.readouterr()
    assert main([*base, "--policy", "oracle", "--wait-hours", "1"]) == 2
    assert "apply to the +wait policies" in capsys.readouterr().err
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
    problem = PlacementProblem.build(gpus, [Job("first", "gain", 1.0, 1e6, gpus=("h",)),
                                            Job("new", "gain", 1.0, 1e6)], table)
    placement = GoghOptimizer().place(problem)
    patience = Patience(3600.0, min_saving=0.15)
    assert set(hold_for_efficiency(placement, problem, {"new": 0.0}, patience)[1]) == {"new"}
    dynamic = EnergyModel(count_idle=False)
    assert hold_for_efficiency(placement, problem, {"new": 0.0}, patience, energy=dynamic)[1] == {}

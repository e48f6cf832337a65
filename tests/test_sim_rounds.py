"""The round-based engine and Gavel's policies (sim.rounds, sim.gavel)."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gogh_flows.catalog import get_gpu_type
from gogh_flows.placement import Gpu
from gogh_flows.sim.account import energy_accounts
from gogh_flows.sim.engine import SimConfig
from gogh_flows.sim.gavel import GAVEL_POLICIES, GavelFifo, make_gavel_policy
from gogh_flows.sim.hadar import HADAR_POLICIES, make_hadar_policy
from gogh_flows.sim.rounds import AllocationState, RoundConfig, round_order, simulate_rounds
from gogh_flows.sim.run import PEER_POLICIES, make_peer, parse_cluster, prepare_jobs, run_policies
from gogh_flows.sim.traces import read_trace
from test_sim_engine import J, _random_stream, _table

LP_POLICIES = ("gavel-max-min-fairness", "gavel-min-total-duration", "gavel-energy-slo")


def _state(rate, scale, capacity, remaining=None, required=None, watts=None) -> AllocationState:
    rate = np.asarray(rate, dtype=float)
    m, n = rate.shape
    return AllocationState(
        now_s=0.0, job_ids=tuple(f"j{i}" for i in range(m)), types=tuple(f"t{c}" for c in range(n)),
        rate=rate, watts=np.ones_like(rate) * 100.0 if watts is None else np.asarray(watts, dtype=float),
        scale=np.asarray(scale, dtype=float),
        remaining=np.full(m, 1000.0) if remaining is None else np.asarray(remaining, dtype=float),
        required=np.zeros(m) if required is None else np.asarray(required, dtype=float),
        arrival_s=np.arange(m, dtype=float), capacity=np.asarray(capacity, dtype=float))


@st.composite
def _states(draw):
    m, n = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    rate = np.array([[draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0])) for _ in range(n)] for _ in range(m)])
    scale = [draw(st.sampled_from([1, 1, 2, 4])) for _ in range(m)]
    capacity = [draw(st.integers(1, 8)) for _ in range(n)]
    remaining = [draw(st.floats(10, 1e5)) for _ in range(m)]
    watts = np.array([[draw(st.floats(50, 400)) for _ in range(n)] for _ in range(m)])
    required = rate.max(axis=1) * draw(st.floats(0.0, 0.5))
    return _state(rate, scale, capacity, remaining, required, watts)


@settings(max_examples=60, deadline=None)
@given(_states(), st.sampled_from(["gavel-fifo-perf", *LP_POLICIES, *HADAR_POLICIES]))
def test_every_allocation_fits_the_cluster(state, name):
    """Time fractions in [0, 1], at most 1 per job (HadarE: one per copy), no type
    over-committed, none where a job cannot run."""
    pol = make_peer(name)
    x = pol.allocate(state)
    assert x.shape == state.rate.shape
    assert (x >= -1e-9).all() and (x <= 1 + 1e-9).all()
    assert (x.sum(axis=1) <= getattr(pol, "max_copies", 1) + 1e-6).all()
    assert ((state.scale[:, None] * x).sum(axis=0) <= state.capacity + 1e-6).all()
    assert (x[state.rate <= 0] == 0).all()


def test_energy_slo_meets_every_requirement_it_can_at_least_energy():
    # Two jobs, one fast hungry type and one slow frugal one: the requirements force job 0
    # onto the fast type part of the time; job 1's requirement fits on the frugal type.
    state = _state(rate=[[10.0, 4.0], [10.0, 4.0]], scale=[1, 1], capacity=[1, 1],
                   required=[6.0, 3.0], watts=[[300.0, 60.0], [300.0, 60.0]])
    x = make_gavel_policy("gavel-energy-slo").allocate(state)
    got = (state.rate * x).sum(axis=1)
    assert (got >= state.required - 1e-6).all()
    # Per watt the slow type is 4/60 > 10/300: it is filled; the fast one only as needed.
    assert x[:, 1].sum() == pytest.approx(1.0)


def test_energy_slo_drops_requirements_it_cannot_meet_as_gavel_does():
    state = _state(rate=[[10.0], [10.0]], scale=[1, 1], capacity=[1], required=[8.0, 8.0])
    x = make_gavel_policy("gavel-energy-slo").allocate(state)
    assert x.sum() == pytest.approx(1.0)  # the whole GPU is still given out


def test_min_total_duration_is_the_exact_optimum():
    # One GPU, 100 and 300 steps at 1 step/s: both done together at T = 400 s at best.
    state = _state(rate=[[1.0], [1.0]], scale=[1, 1], capacity=[1], remaining=[100.0, 300.0])
    x = make_gavel_policy("gavel-min-total-duration").allocate(state)
    assert x[:, 0] == pytest.approx([0.25, 0.75])


def test_max_min_fairness_equalises_normalised_throughput():
    # Job 0 runs 4x faster on t0, job 1 equally on both.
    state = _state(rate=[[4.0, 1.0], [1.0, 1.0]], scale=[1, 1], capacity=[1, 1])
    x = make_gavel_policy("gavel-max-min-fairness").allocate(state)
    equal = state.rate @ (state.capacity / state.capacity.sum())
    norm = (state.rate * x).sum(axis=1) / equal
    # Job 1 can have at most all of its time (on either type: 1 step/s), its equal share
    # (1 step/s) and no more; job 0 is then held at least to its own equal share.
    assert norm.min() == pytest.approx(1.0, rel=1e-6)
    assert norm[0] >= 1.0 - 1e-6


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="gavel-max-min-fairness"):
        make_gavel_policy("gavel-nope")


def test_round_order_is_fastest_first():
    assert round_order(["k80", "v100", "p100"]) == ["v100", "p100", "k80"]
    assert get_gpu_type("v100").fp32_tflops > get_gpu_type("k80").fp32_tflops


def test_time_slicing_on_one_gpu_by_hand():
    """Two equal jobs on one V100 under max-min fairness alternate round by round."""
    jobs = [J("x", "a", 7200.0, 0.0, 1.0), J("y", "a", 7200.0, 0.0, 1.0)]  # 720 s of work each at 10/s
    res = simulate_rounds(jobs, [Gpu("v", "v100")], _table(), make_gavel_policy("gavel-max-min-fairness"))
    ends = sorted(r.finished_s for r in res.jobs.values())
    assert ends == pytest.approx([1080.0, 1440.0])  # rounds of 360 s: x, y, x, y (or y first)
    assert res.end_s == pytest.approx(1440.0)
    v100 = get_gpu_type("v100")
    busy = v100.idle_w + 0.5 * (v100.tdp_w - v100.idle_w)  # activity 0.5 for job type "a"
    assert res.energy_j == pytest.approx(busy * 1440.0)
    s = res.summary()
    # Each ran 720 s of its span; the other rounds it waited count below its requirement.
    assert s["sla_attainment"] == pytest.approx((720 + 720) / (1080 + 1440 - 360), rel=1e-6)
    assert s["met_on_average"] == 1.0  # 7200 steps over >= 1080 s is >= 1 step/s


@pytest.mark.parametrize("name", PEER_POLICIES)
def test_conservation_and_power_integral(name):
    jobs = _random_stream(40, seed=3)
    gpus = [Gpu(f"v{i}", "v100") for i in range(3)] + [Gpu(f"t{i}", "t4") for i in range(3)]
    res = simulate_rounds(jobs, gpus, _table(), make_peer(name), config=RoundConfig(round_s=60.0))
    for j in jobs:
        rec = res.jobs[j.id]
        assert rec.finished_s is not None, j.id
        assert rec.steps_done == pytest.approx(j.total_steps, abs=1.0)
        assert rec.finished_s >= rec.placed_s >= rec.arrival_s
    assert res.energy_j == pytest.approx(sum((b - a) * w for a, b, w in res.power_trace))
    assert res.decision_ms, "the allocator was never called"


def test_noise_and_parking_follow_the_config():
    jobs = _random_stream(20, seed=1)
    gpus = [Gpu("v0", "v100"), Gpu("t0", "t4")]
    pol = "gavel-max-min-fairness"
    a = simulate_rounds(jobs, gpus, _table(), make_gavel_policy(pol), config=RoundConfig(seed=2, noise=0.1))
    b = simulate_rounds(jobs, gpus, _table(), make_gavel_policy(pol), config=RoundConfig(seed=2, noise=0.1))
    c = simulate_rounds(jobs, gpus, _table(), make_gavel_policy(pol), config=RoundConfig(seed=2))
    assert a.end_s == b.end_s and a.end_s != c.end_s
    parked = simulate_rounds(jobs, gpus, _table(), make_gavel_policy(pol), config=RoundConfig(park_idle=True))
    assert parked.energy_j < c.energy_j


def test_peers_run_beside_the_placement_policies_with_one_energy_account():
    jobs = _random_stream(30, seed=4)
    gpus = parse_cluster("v100=3,t4=3")
    names = ["greedy-fastest", "oracle", *PEER_POLICIES]
    results = run_policies(jobs, gpus, _table(), names, config=SimConfig(seed=1))
    accounts = energy_accounts(results)
    window = max(r.end_s for r in results.values())
    for name in names:
        assert results[name].policy == name
        assert accounts[name].window_s == window
        assert accounts[name].always_on_kwh >= accounts[name].parked_kwh > 0


def test_bad_round_settings_are_refused():
    with pytest.raises(ValueError, match="round_s"):
        RoundConfig(round_s=0)
    with pytest.raises(ValueError, match="noise"):
        RoundConfig(noise=2.0)


def test_a_job_no_type_can_run_is_reported_unfinished():
    jobs = [J("x", "a", 100.0, 0.0, 1.0), J("z", "a", 100.0, 0.0, 1.0, num_gpus=4)]
    res = simulate_rounds(jobs, [Gpu("v", "v100")], _table(), make_gavel_policy("gavel-fifo-perf"))
    assert res.unfinished == ["z"] and res.jobs["x"].finished_s is not None


def _gavel_testbed(gavel_dir, gavel_table):
    gpus = parse_cluster("v100=8,p100=16,k80=24", capacity=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jobs = prepare_jobs(read_trace(gavel_dir / "traces" / "physical_cluster" / "max_min_fairness.trace"),
                            gavel_table, gpus, seed=0, q_low=0.001, q_high=0.001)
    return jobs, gpus


@pytest.mark.parametrize("policy, jct_h, total_h, tol", [
    # Gavel's own simulator, seed 0 (issue: the peers). fifo and fifo-perf reproduce it
    # exactly; max-min fairness within 5% (GLOP returns a vertex, ECOS an interior point).
    (GavelFifo(seed=0, c4fa400=True), 9.97, 54.59, 0.005),
    (make_gavel_policy("gavel-fifo-perf"), 5.42, 20.09, 0.005),
    (make_gavel_policy("gavel-max-min-fairness"), 4.06, 17.76, 0.05),
])
def test_calibration_against_gavels_own_figures(gavel_dir, gavel_table, policy, jct_h, total_h, tol):
    jobs, gpus = _gavel_testbed(gavel_dir, gavel_table)
    res = simulate_rounds(jobs, gpus, gavel_table, policy)
    s = res.summary()
    assert s["avg_jct_s"] / 3600 == pytest.approx(jct_h, rel=tol)
    assert res.end_s / 3600 == pytest.approx(total_h, rel=tol)


def test_every_gavel_name_is_a_simulation_policy():
    assert set(GAVEL_POLICIES) <= set(PEER_POLICIES)


def test_hadar_leaves_a_fast_type_to_the_job_that_gains_most():
    """Prices rise as the fast type fills: the job that loses little on the slow type takes
    it, and the fast GPU goes to a later job that would run 10x slower elsewhere."""
    state = _state(rate=[[10.0, 1.0], [10.0, 9.0], [10.0, 1.0]], scale=[1, 1, 1], capacity=[2, 2])
    x = make_hadar_policy("hadar").allocate(state)
    assert x.tolist() == [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    fifo = make_gavel_policy("gavel-fifo-perf").allocate(state)
    assert fifo[2].tolist() == [0.0, 1.0]  # first come, fastest type: the last job gets the slow one


def test_hadare_forks_a_job_onto_free_types_and_its_copies_add_up():
    jobs = [J("x", "a", 1400.0, 0.0, 1.0)]  # job type "a": 10 steps/s on a V100, 4 on a T4
    gpus = [Gpu("v", "v100"), Gpu("t", "t4")]
    res = simulate_rounds(jobs, gpus, _table(), make_hadar_policy("hadare"))
    assert res.jobs["x"].finished_s == pytest.approx(100.0)  # 1400 steps at 10 + 4 steps/s
    alone = simulate_rounds(jobs, gpus, _table(), make_hadar_policy("hadar"))
    assert alone.jobs["x"].finished_s == pytest.approx(140.0)
    with pytest.raises(ValueError, match="hadare"):
        make_hadar_policy("hadarx")


# -- RLTune-style peer (sim.rltune) ---------------------------------------------------------


def test_rltune_placement_objective_by_hand():
    """Two 8-GPU nodes, 8 and 3 free; a 2-GPU job, the next one needs 1. Taking both from the
    whole node leaves (6, 3): 2 partly free, spread 3, both fit -> 2 + 0.9 - 1 = 1.9; taking
    them from the other leaves (8, 1): 1 + 2.1 - 1 = 2.1; splitting is worse still."""
    from gogh_flows.sim.rltune import _place_on_type

    assert _place_on_type((8, 3), (8, 8), 2, 1) == (pytest.approx(1.9), (2, 0))
    assert _place_on_type((1, 0), (8, 8), 2, 1) is None


def test_rltune_runs_started_jobs_to_completion_and_frees_their_nodes():
    from gogh_flows.sim.rltune import QUEUE, RLTuneAllocator

    alloc = RLTuneAllocator()
    state = _state(rate=[[2.0, 1.0], [2.0, 1.0], [2.0, 0.0]], scale=[4, 4, 8], capacity=[8, 4])
    x = alloc.allocate(state)
    assert x.sum(axis=1).tolist() == [1.0, 1.0, 0.0]  # FCFS: the 8-GPU job finds no room
    # The first job ended; the others keep their GPUs (no preemption); the big one still waits
    later = _state(rate=[[2.0, 1.0], [2.0, 0.0]], scale=[4, 8], capacity=[8, 4])
    later = AllocationState(**{**later.__dict__, "job_ids": ("j1", "j2")})
    y = alloc.allocate(later)
    assert y[0].tolist() == x[1].tolist() and y[1].sum() == 0.0
    obs, mask = alloc.observe(later, [1], {"j1": 0, "j2": 1})
    assert obs.shape == (QUEUE, 7) and not mask[0] and not mask[QUEUE]  # nothing may start: no wait either


def test_rltune_agent_saves_and_loads_as_safetensors_only(tmp_path):
    import torch

    from gogh_flows.sim.rltune import RLTuneNet, load_rltune, save_rltune

    net = RLTuneNet(hidden=8)
    save_rltune(net, tmp_path / "agent", {"episodes": 0})
    assert sorted(p.name for p in (tmp_path / "agent").iterdir()) == ["config.json", "weights.safetensors"]
    back, config = load_rltune(tmp_path / "agent")
    for a, b in zip(net.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    assert config["trained_on"] == {"episodes": 0}
    (tmp_path / "agent" / "weights.safetensors").write_bytes(b"not the weights")
    with pytest.raises(ValueError, match="SHA-256"):
        load_rltune(tmp_path / "agent")
    with pytest.raises(FileNotFoundError, match="gogh rltune train"):
        load_rltune(tmp_path / "nowhere")


def test_rltune_training_runs_ppo_and_records_its_curve(gavel_dir, tmp_path):
    import torch

    from gogh_flows.sim.rltune import RLTuneNet
    from gogh_flows.sim.rltune_train import TrainConfig, train_rltune
    from gogh_flows.truth.gavel import read_gavel_json

    truth = read_gavel_json(gavel_dir / "simulation_throughputs.json")
    cfg = TrainConfig(episodes=2, jobs_per_episode=24, batch_episodes=2, rate_per_hour=4.0, hidden=8)
    torch.manual_seed(cfg.seed)
    before = RLTuneNet(hidden=8).state_dict()
    net, curve = train_rltune(truth, gavel_dir, cfg)
    assert [r["episode"] for r in curve] == [0, 1]
    assert all(-1.0 <= r["reward"] <= 1.0 and r["decisions"] > 0 for r in curve)
    assert any(not torch.equal(a, b) for a, b in zip(before.values(), net.state_dict().values()))
    with pytest.raises(ValueError, match="episodes"):
        TrainConfig(episodes=0)


def test_the_shipped_rltune_agent_runs_as_a_peer():
    jobs = _random_stream(20, seed=2)
    gpus = [Gpu(f"v{i}", "v100") for i in range(3)] + [Gpu(f"t{i}", "t4") for i in range(3)]
    res = simulate_rounds(jobs, gpus, _table(), make_peer("rltune"))
    assert not res.unfinished and res.decision_ms


def test_rltune_wait_is_bounded_and_the_agent_decides_again():
    """A wait holds until the next arrival or end, or 600 s, whichever is first: an agent that
    waits once, with GPUs free and nothing due for an hour, decides again at 600 s."""
    from gogh_flows.sim.rltune import MAX_HOLD_S, QUEUE, RLTuneAllocator

    calls = []

    def wait_once(obs, mask):
        calls.append(obs.copy())
        if mask[QUEUE] and len(calls) == 2:
            return QUEUE
        return int(mask.argmax())

    jobs = [J("x0", "a", 36000.0, 0.0, 1.0), J("x1", "a", 36000.0, 0.0, 1.0)]  # an hour each on a V100
    res = simulate_rounds(jobs, [Gpu(f"v{i}", "v100") for i in range(2)], _table(),
                          RLTuneAllocator(chooser=wait_once), config=RoundConfig(round_s=60.0))
    assert not res.unfinished
    start = sorted(r.placed_s for r in res.jobs.values())
    assert start[0] == 0.0 and start[1] == pytest.approx(MAX_HOLD_S)
    assert calls[2][0, 0] == pytest.approx(MAX_HOLD_S / (12 * 3600))  # it saw its wait grow


def test_rltune_train_command_refuses_bad_settings_in_one_line(tmp_path, capsys, gavel_dir, monkeypatch):
    from gogh_flows.cli import main

    monkeypatch.setenv("GOGH_GAVEL_DIR", str(gavel_dir))
    assert main(["rltune", "train", "--out", str(tmp_path / "a"), "--episodes", "0"]) == 2
    assert "--episodes must be a whole number >= 1, got 0" in capsys.readouterr().err
    assert main(["rltune", "train", "--out", str(tmp_path / "a"), "--jobs", "-2"]) == 2
    assert "--jobs must be a whole number >= 1, got -2" in capsys.readouterr().err
    assert main(["rltune", "train", "--out", str(tmp_path / "a"), "--rate", "0"]) == 2
    assert "--rate must be arrivals per hour > 0" in capsys.readouterr().err
    assert main(["rltune", "train", "--out", str(tmp_path / "a"), "--truth", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    # an agent already there (the shipped one, say) is not replaced unless asked
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    assert main(["rltune", "train", "--out", str(tmp_path / "b"), "--episodes", "1"]) == 2
    assert "already holds an agent" in capsys.readouterr().err
    assert (tmp_path / "b" / "config.json").read_text() == "{}"


def test_gogh_simulate_runs_the_peers_beside_ours(tmp_path, gavel_dir):
    import json

    from gogh_flows.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"),
                 "--trace", str(gavel_dir / "traces" / "physical_cluster" / "max_min_fairness.trace"),
                 "--cluster", "v100=8,p100=16,k80=24", "--policy", "greedy-fastest,gavel-fifo-perf,hadar,rltune",
                 "--json", str(out)]) == 0
    policies = json.loads(out.read_text())["policies"]
    assert set(policies) == {"greedy-fastest", "gavel-fifo-perf", "hadar", "rltune"}
    assert all(p["jobs_completed"] == 96 and "met_on_average" in p for p in policies.values())


def test_moves_between_gpu_types_count_as_migrations():
    jobs = _random_stream(30, seed=4)
    gpus = parse_cluster("v100=3,t4=3")
    results = run_policies(jobs, gpus, _table(), ["gavel-max-min-fairness", "gavel-fifo-perf"], config=SimConfig(seed=1))
    assert results["gavel-max-min-fairness"].migrations > 0  # time slicing moves jobs between types
    assert results["gavel-max-min-fairness"].summary()["migrations"] == results["gavel-max-min-fairness"].migrations


def test_gogh_simulate_takes_an_rltune_agent_trained_elsewhere_and_refuses_a_stray_risk_level(
        tmp_path, gavel_dir, capsys):
    from gogh_flows.cli import main
    from gogh_flows.sim.rltune import RLTuneNet, save_rltune

    save_rltune(RLTuneNet(hidden=8), tmp_path / "agent", {"episodes": 0})
    base = ["simulate", "--truth", str(gavel_dir / "simulation_throughputs.json"), "--trace", "generate:12",
            "--rate", "4", "--cluster", "v100=2,p100=2"]
    assert main([*base, "--policy", "rltune", "--rltune-model", str(tmp_path / "agent"),
                 "--json", str(tmp_path / "s.json")]) == 0
    assert main([*base, "--policy", "rltune", "--rltune-model", str(tmp_path / "none")]) == 2
    assert "gogh rltune train" in capsys.readouterr().err
    assert main([*base, "--policy", "oracle", "--risk-level", "0.9"]) == 2
    assert "--risk-level applies to the learned policies' refiner (gogh" in capsys.readouterr().err
    # gogh-p1 alone: it plans with P1's points, so a level would be recorded and never used
    assert main([*base, "--policy", "gogh-p1", "--risk-level", "0.9"]) == 2
    assert "gogh is not among ['gogh-p1']" in capsys.readouterr().err

import pytest

from gogh_flows.catalog import UnknownGpuTypeError
from gogh_flows.sim.run import SIM_POLICIES, parse_cluster, run_policies
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

import pytest

from gogh_flows.catalog import get_gpu_type
from gogh_flows.energy import EnergyModel, Occupant, kwh


def test_power_by_state_follows_catalog():
    m, v = EnergyModel(), get_gpu_type("v100")
    assert m.idle_power("v100") == v.idle_w
    assert m.power_alone("v100", 1.0) == pytest.approx(v.tdp_w)
    assert m.power_alone("v100", 0.5) == pytest.approx(v.idle_w + 0.5 * (v.tdp_w - v.idle_w))
    # Two half-slowed jobs at activity 0.8 together load the GPU to 0.8.
    assert m.power_shared("v100", ((0.8, 0.5), (0.8, 0.5))) == pytest.approx(
        v.idle_w + 0.8 * (v.tdp_w - v.idle_w)
    )
    # Load is capped at the TDP.
    assert m.power_shared("v100", ((1.0, 0.9), (1.0, 0.9))) == pytest.approx(v.tdp_w)


def test_energy_alone_hand_computed():
    m, v = EnergyModel(), get_gpu_type("v100")
    occ = Occupant(work=3600.0, isolated=2.0, activity=0.5)  # 1800 s
    expected = (v.idle_w + 0.5 * (v.tdp_w - v.idle_w)) * 1800
    assert m.energy_alone("v100", occ) == pytest.approx(expected)
    assert m.energy_alone("v100", occ, num_gpus=4) == pytest.approx(4 * expected)
    # Always-on accounting charges only the draw above idle.
    assert EnergyModel(count_idle=False).energy_alone("v100", occ) == pytest.approx(
        0.5 * (v.tdp_w - v.idle_w) * 1800
    )


def test_energy_pair_survivor_speeds_back_up():
    m, v = EnergyModel(), get_gpu_type("a100")
    idle, dyn = v.idle_w, v.tdp_w - v.idle_w
    a = Occupant(work=100.0, isolated=2.0, activity=0.6, shared=1.0)  # 100 s shared
    b = Occupant(work=1000.0, isolated=10.0, activity=0.4, shared=5.0)  # would take 200 s
    overlap = 100.0
    load = min(1.0, 0.6 * 0.5 + 0.4 * 0.5)
    left = 1000.0 - overlap * 5.0  # 500 steps at 10/s alone
    expected = (idle + load * dyn) * overlap + (idle + 0.4 * dyn) * left / 10.0
    assert m.energy_pair("a100", a, b) == pytest.approx(expected)
    assert m.energy("a100", [a, b]) == pytest.approx(expected)
    assert m.energy("a100", []) == 0.0


def test_sharing_saves_energy_when_jobs_leave_the_gpu_idle():
    m = EnergyModel()
    a = Occupant(work=1000.0, isolated=10.0, activity=0.3, shared=8.0)
    b = Occupant(work=1000.0, isolated=10.0, activity=0.3, shared=8.0)
    apart = m.energy_alone("h100", Occupant(1000.0, 10.0, 0.3)) * 2
    assert m.energy_pair("h100", a, b) < apart


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(work=-1, isolated=1, activity=0.5), "work"),
        (dict(work=1, isolated=0, activity=0.5), "isolated"),
        (dict(work=1, isolated=1, activity=1.5), "activity"),
        (dict(work=1, isolated=1, activity=0.5, shared=0.0), "shared"),
    ],
)
def test_bad_occupant_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Occupant(**kwargs)


def test_more_than_two_occupants_is_refused():
    o = Occupant(1.0, 1.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="at most 2"):
        EnergyModel().energy("v100", [o, o, o])


def test_kwh():
    assert kwh(3.6e6) == 1.0


@pytest.mark.parametrize("gpu", ["v100", "a100", "k80", "h100"])
def test_at_limits_over_arrays_is_at_limit_element_by_element(gpu):
    """The array twin (used by the energy floor) must answer as the scalar one the simulator uses."""
    import numpy as np

    model = EnergyModel()
    g = model.gpu(gpu)
    p0 = np.linspace(g.idle_w + 5, g.tdp_w, 7)
    lo, hi = g.power_limit_range_w
    limits = np.linspace(lo, hi + 20, 9)
    slow, board = model.at_limits(gpu, p0[:, None], limits[None, :])
    for i, p in enumerate(p0):
        for k, lim in enumerate(limits):
            assert (slow[i, k], board[i, k]) == pytest.approx(model.at_limit(gpu, float(p), float(lim)), rel=1e-12)

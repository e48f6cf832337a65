"""A user's own nn.Module on the emulated fleet: placed, measured and learned from under its own job type."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gogh_flows import current_placement, gogh_placed
from gogh_flows.flows.session import open_sessions
from gogh_flows.truth.synthetic import SyntheticFleet
from gogh_flows.truth.table import ThroughputTable
from gogh_flows.workloads.features import extract_features
from gogh_flows.workloads.zoo import zoo_features

pytestmark = pytest.mark.usefixtures("prefect_server")


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_table_absorbs_a_new_job_type_and_its_pairs_with_the_known_ones():
    lm = zoo_features("LM", 20)
    mine = extract_features(TinyMLP(), torch.randn(32, 64), batch_size=32)
    fleet = SyntheticFleet(gpu_types=("v100", "t4"), jobs={"LM (batch size 20)": lm, "TinyMLP": mine})
    base = ThroughputTable.from_rows([r for r in fleet.table().frame.iter_rows(named=True)
                                      if r["job_type"] != "TinyMLP" and r["partner"] != "TinyMLP"])
    assert not base.knows("TinyMLP")
    assert base.absorb(ThroughputTable.from_rows(fleet.rows_for("TinyMLP"))) == 1
    whole = fleet.table()
    assert base.isolated("TinyMLP", "v100") == pytest.approx(whole.isolated("TinyMLP", "v100"))
    assert base.pair("LM (batch size 20)", "TinyMLP", "t4") == pytest.approx(whole.pair("LM (batch size 20)", "TinyMLP", "t4"))
    assert base.isolated("LM (batch size 20)", "t4") == whole.isolated("LM (batch size 20)", "t4")  # untouched
    assert base.absorb(ThroughputTable.from_rows(fleet.rows_for("TinyMLP"))) == 0


def test_a_users_own_model_runs_on_the_emulated_fleet_and_is_learned_by_job_type(gogh_home):
    @gogh_placed(model=TinyMLP(), example_inputs=torch.randn(32, 64), batch_size=32, min_throughput=1.0,
                 work_steps=200)
    def train() -> dict:
        p = current_placement()
        p.advance(200)
        return {"gpu": p.gpu_type, "predicted": p.predicted_throughput}

    first = train()
    session = list(open_sessions().values())[0]
    frame = session.measurements.read()
    row = frame.row(0, named=True)
    assert row["job_type"] == "TinyMLP (batch size 32)" and row["status"] == "completed"
    assert row["telemetry"] == "emulated" and row["throughput"] > 0
    # the measurement is an observation of its own job type, which the next placement uses
    obs = session.observations.get()
    assert "TinyMLP (batch size 32)" in obs["job_type"].to_list()
    second = train()
    assert second["predicted"] != pytest.approx(first["predicted"], rel=1e-6)

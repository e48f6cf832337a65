"""Placement: the problem, the GOGH optimiser and the baselines, behind one ``place()``."""

from __future__ import annotations

from collections.abc import Callable

from gogh_flows.placement.baselines import (
    FirstFit,
    FirstFitInterleaved,
    GreedyEfficiency,
    GreedyFastest,
    GreedyMinPower,
    RandomPolicy,
)
from gogh_flows.placement.optimizer import GoghOptimizer
from gogh_flows.placement.problem import (
    Gpu,
    Job,
    PlacementProblem,
    TableThroughputs,
    Throughputs,
)
from gogh_flows.placement.result import Assignment, Choice, Explanation, Placement, Waiting
from gogh_flows.placement.verify import final_occupancy, placement_energy, violations

POLICIES: dict[str, Callable[..., object]] = {
    "optimizer": GoghOptimizer,
    "first-fit": FirstFit,
    "first-fit-interleaved": FirstFitInterleaved,
    "random": RandomPolicy,
    "greedy-fastest": GreedyFastest,
    "greedy-min-power": GreedyMinPower,
    "greedy-efficiency": GreedyEfficiency,
}
BASELINES = tuple(n for n in POLICIES if n != "optimizer")


def get_policy(name: str, **options: object):
    """A policy object by name; every policy has ``place(problem) -> Placement``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown placement policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None
    return factory(**options)


__all__ = [
    "Assignment", "BASELINES", "Choice", "Explanation", "FirstFit", "FirstFitInterleaved", "GoghOptimizer", "Gpu",
    "GreedyEfficiency", "GreedyFastest", "GreedyMinPower", "Job", "POLICIES", "Placement",
    "PlacementProblem", "RandomPolicy", "TableThroughputs", "Throughputs", "Waiting",
    "final_occupancy", "get_policy", "placement_energy", "violations",
]

"""gogh-flows: energy-aware placement of Prefect flow runs on mixed-generation GPU fleets (GOGH).

The public API is imported lazily, so the pure core (``gogh_flows.placement``,
``gogh_flows.predict``, ...) can be used without importing Prefect, Dask or MLflow.
"""

from __future__ import annotations

from typing import Any

from gogh_flows.logs import quiet_by_default

quiet_by_default()  # MLflow's INFO lines off unless GOGH_VERBOSE=1 (gogh_flows/logs.py)

_LAZY = {
    "gogh_placed": "gogh_flows.flows.decorator",
    "current_placement": "gogh_flows.flows.current",
    "CurrentPlacement": "gogh_flows.flows.current",
    "GpuCluster": "gogh_flows.flows.blocks",
    "PredictorRegistry": "gogh_flows.flows.blocks",
    "PlacementPolicy": "gogh_flows.flows.blocks",
    "PlacementTimeout": "gogh_flows.flows.placer",
    "InfeasibleRequirement": "gogh_flows.flows.placer",
    "RunLost": "gogh_flows.flows.placer",
    "refine_predictors": "gogh_flows.flows.retrain",
    "JobSpec": "gogh_flows.workloads.job",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gogh_flows' has no attribute {name!r}")

"""The Prefect layer: ``@gogh_placed``, its blocks, the measurement hook and the retraining flow."""

from gogh_flows.flows.blocks import (
    GpuCluster,
    PlacementPolicy,
    PredictorRegistry,
    apply_block_documents,
)
from gogh_flows.flows.current import CurrentPlacement, current_placement
from gogh_flows.flows.decorator import gogh_placed
from gogh_flows.flows.placer import PlacementTimeout, RunPlacement
from gogh_flows.flows.retrain import refine_predictors, serve_refiner

__all__ = [
    "CurrentPlacement", "GpuCluster", "PlacementPolicy", "PlacementTimeout", "PredictorRegistry",
    "RunPlacement", "apply_block_documents", "current_placement", "gogh_placed",
    "refine_predictors", "serve_refiner",
]

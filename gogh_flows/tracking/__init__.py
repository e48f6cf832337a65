"""MLflow adapter: the model registry (weights-only directories) and the measurement log.

This package is an adapter: it may import mlflow; the pure core (predict, placement,
energy, sim) must never import it.
"""

from gogh_flows.tracking.errors import ModelNotFoundError, TrackingUnavailableError, UnsafeArtifactError
from gogh_flows.tracking.measurements import Measurement, MeasurementLog, read_measurements
from gogh_flows.tracking.registry import ModelRef, ModelRegistry, parse_model_ref
from gogh_flows.tracking.safety import verify_weights_only

__all__ = [
    "Measurement",
    "MeasurementLog",
    "ModelNotFoundError",
    "ModelRef",
    "ModelRegistry",
    "TrackingUnavailableError",
    "UnsafeArtifactError",
    "parse_model_ref",
    "read_measurements",
    "verify_weights_only",
]

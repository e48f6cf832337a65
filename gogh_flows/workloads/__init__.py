"""Workloads: per-layer features of torch models and the Gavel model zoo."""

from gogh_flows.workloads.features import (
    OP_KINDS,
    LayerFeature,
    WorkloadFeatures,
    extract_features,
)
from gogh_flows.workloads.zoo import (
    DEFAULT_BATCH_SIZES,
    FAMILIES,
    ZooModel,
    build_model,
    family_of,
    job_type_name,
    parse_job_kind,
    parse_job_type,
    zoo_features,
)
from gogh_flows.workloads.job import JobSpec

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "FAMILIES",
    "JobSpec",
    "OP_KINDS",
    "LayerFeature",
    "WorkloadFeatures",
    "ZooModel",
    "build_model",
    "extract_features",
    "family_of",
    "job_type_name",
    "parse_job_kind",
    "parse_job_type",
    "zoo_features",
]

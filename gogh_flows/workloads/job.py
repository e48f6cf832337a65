"""``JobSpec``: what a user says about a run, validated where they say it.

It is a pydantic model because it sits at the boundary with users (decorator
arguments, CLI flags, block documents): a bad value is rejected with a message
that names the field, before anything is placed or run.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gogh_flows import catalog
from gogh_flows.workloads.features import WorkloadFeatures, extract_features
from gogh_flows.workloads.zoo import DEFAULT_BATCH_SIZES, canonical_family, job_type_name, zoo_features

#: Fraction of a GPU's memory a job may use (CUDA context, allocator slack).
MEMORY_HEADROOM = 0.9


class JobSpec(BaseModel):
    """One ML job: its model, batch size, throughput requirement and amount of work."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(min_length=1)
    family: str | None = None  # a zoo family ("ResNet-50", ...) or None for a user model
    batch_size: int = Field(gt=0)
    kind: Literal["training", "inference"] = "training"
    required_throughput: float = Field(gt=0, description="steps per second the run must get")
    work_steps: int = Field(gt=0, description="steps the run has to do")
    num_gpus: Literal[1, 2, 4, 8] = 1
    features: WorkloadFeatures | None = None
    job_type: str = ""

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return canonical_family(value)
        except ValueError as exc:
            raise ValueError(f"{exc}; use JobSpec.from_model for your own torch model") from None

    @field_validator("required_throughput")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"required_throughput must be a finite number of steps/s, got {value!r}")
        return value

    @model_validator(mode="after")
    def _complete(self) -> JobSpec:
        if self.features is None and self.family is not None:
            object.__setattr__(self, "features", zoo_features(self.family, self.batch_size, self.kind))
        if not self.job_type:
            jt = job_type_name(self.family, self.batch_size, self.kind) if self.family else self.name
            object.__setattr__(self, "job_type", jt)
        if self.features is not None:
            _check_fits_somewhere(self)
        return self

    @classmethod
    def from_zoo(cls, family: str, batch_size: int, **kwargs: Any) -> JobSpec:
        kwargs.setdefault("name", f"{family}-bs{batch_size}")
        return cls(family=family, batch_size=batch_size, **kwargs)

    @classmethod
    def from_model(
        cls, name: str, model: torch.nn.Module, example_inputs: Any, **kwargs: Any
    ) -> JobSpec:
        """A job for a user's own model; features come from one forward pass on ``meta``."""
        kind = kwargs.get("kind", "training")
        feats = extract_features(model, example_inputs, kind=kind)
        kwargs.setdefault("batch_size", feats.batch_size)
        return cls(name=name, features=feats, **kwargs)

    @property
    def memory_gb(self) -> float:
        return self.features.memory_bytes_estimate / 1e9 if self.features else 0.0


def _check_fits_somewhere(spec: JobSpec) -> None:
    need = spec.features.memory_bytes_estimate  # type: ignore[union-attr]
    most = max(g.memory_bytes for g in catalog.gpu_types())
    if need > MEMORY_HEADROOM * most:
        biggest = ", ".join(g.name for g in catalog.gpu_types() if g.memory_bytes == most)
        raise ValueError(
            f"job {spec.name!r} needs about {need / 1e9:.1f} GB of GPU memory at batch_size "
            f"{spec.batch_size}, more than any GPU type in the catalog holds (the largest, "
            f"{biggest}, have {most / 1e9:g} GB); lower batch_size (it is per GPU, so a gang "
            "does not help)" + (f"; Gavel measured {spec.family} at batch_size "
                                f"{', '.join(map(str, DEFAULT_BATCH_SIZES[spec.family]))}" if spec.family else "")
        )

"""Power and energy-to-completion model (see docs/energy.md for the assumptions).

A GPU draws its idle power plus a share of its dynamic range (TDP - idle) that
grows with how busy its jobs keep it:

* idle:            ``P = idle``
* one job:         ``P = idle + a_j * (TDP - idle)``
* two jobs share:  ``P = idle + min(1, a_j * r_j + a_k * r_k) * (TDP - idle)``

``a_j`` is the job's *activity* on that GPU type (the fraction of the dynamic
range it draws alone) and ``r_j = shared / isolated`` throughput: a job slowed
down by its partner issues proportionally less work, so it draws less.

Energy to completion of a GPU's occupants integrates that power until the last
one finishes: while two jobs share, both progress at their shared rates; when
the first finishes, the survivor speeds back up to its isolated rate. This is
the quantity the optimiser minimises and the baselines are scored with, so the
two are compared on exactly the same yardstick.

Idle accounting: with ``count_idle=True`` (default) an occupied GPU's idle
power is charged to its jobs and an empty GPU is assumed parked, which is how a
job's energy is reported to users. With ``count_idle=False`` idle power is
treated as paid anyway (an always-on fleet) and only the draw above idle counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gogh_flows.catalog import GpuType, get_gpu_type

#: Activity assumed when a source has no power information: training jobs keep
#: a datacenter GPU near, but below, its TDP (typical nvidia-smi readings).
DEFAULT_ACTIVITY = 0.8
J_PER_KWH = 3.6e6


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class Occupant:
    """A job on a GPU, as the energy model needs it."""

    work: float  # remaining steps
    isolated: float  # steps/s alone on this GPU type
    activity: float  # fraction of the dynamic power range it draws alone
    shared: float | None = None  # steps/s while sharing with the other occupant

    def __post_init__(self) -> None:
        if self.work < 0:
            raise ValueError(f"work must be >= 0 steps, got {self.work!r}")
        if self.isolated <= 0:
            raise ValueError(f"isolated throughput must be > 0 steps/s, got {self.isolated!r}")
        if self.shared is not None and self.shared <= 0:
            raise ValueError(f"shared throughput must be > 0 steps/s, got {self.shared!r}")
        _check_unit("activity", self.activity)


@dataclass(frozen=True)
class EnergyModel:
    """Power by GPU state and energy to completion, from catalog figures."""

    count_idle: bool = True
    gpu_types: Mapping[str, GpuType] | None = None
    # Catalog lookups resolved once per model: this sits on the optimiser's hot path.
    _resolved: dict[str, GpuType] = field(default_factory=dict, repr=False, compare=False)

    def gpu(self, gpu_type: str | GpuType) -> GpuType:
        if isinstance(gpu_type, GpuType):
            return gpu_type
        hit = self._resolved.get(gpu_type)
        if hit is not None:
            return hit
        if self.gpu_types is not None and gpu_type in self.gpu_types:
            found = self.gpu_types[gpu_type]
        else:
            found = get_gpu_type(gpu_type)
        self._resolved[gpu_type] = found
        return found

    def _levels(self, gpu_type: str | GpuType) -> tuple[float, float]:
        """(charged idle W, dynamic range W) under the idle accounting in force."""
        g = self.gpu(gpu_type)
        return (g.idle_w if self.count_idle else 0.0), g.tdp_w - g.idle_w

    # -- power by state ---------------------------------------------------------------
    def idle_power(self, gpu_type: str | GpuType) -> float:
        return self.gpu(gpu_type).idle_w

    def power_alone(self, gpu_type: str | GpuType, activity: float) -> float:
        _check_unit("activity", activity)
        g = self.gpu(gpu_type)
        return g.idle_w + activity * (g.tdp_w - g.idle_w)

    def power_shared(
        self, gpu_type: str | GpuType, loads: tuple[tuple[float, float], tuple[float, float]]
    ) -> float:
        """Power with two jobs sharing; ``loads`` = ((activity, shared/isolated), ...) per job."""
        g = self.gpu(gpu_type)
        load = min(1.0, sum(a * r for a, r in loads))
        return g.idle_w + load * (g.tdp_w - g.idle_w)

    # -- energy to completion ---------------------------------------------------------
    def energy_alone(self, gpu_type: str | GpuType, occ: Occupant, num_gpus: int = 1) -> float:
        """Joules for ``occ`` to finish alone (on each of ``num_gpus`` GPUs of a gang)."""
        idle, dyn = self._levels(gpu_type)
        return num_gpus * (idle + occ.activity * dyn) * occ.work / occ.isolated

    def energy_pair(self, gpu_type: str | GpuType, a: Occupant, b: Occupant) -> float:
        """Joules until both of two co-located jobs finish (survivor speeds back up)."""
        if a.shared is None or b.shared is None:
            raise ValueError("both occupants of a shared GPU need their shared throughput")
        idle, dyn = self._levels(gpu_type)
        ta, tb = a.work / a.shared, b.work / b.shared
        overlap = min(ta, tb)
        load = min(1.0, a.activity * a.shared / a.isolated + b.activity * b.shared / b.isolated)
        energy = (idle + load * dyn) * overlap
        survivor = a if ta > tb else b
        left = survivor.work - overlap * survivor.shared  # type: ignore[operator]
        if left > 0:
            energy += (idle + survivor.activity * dyn) * left / survivor.isolated
        return energy

    def energy(self, gpu_type: str | GpuType, occupants: tuple[Occupant, ...] | list[Occupant]) -> float:
        """Energy to completion of a single GPU's occupants (0, 1 or 2 jobs)."""
        if len(occupants) == 0:
            return 0.0
        if len(occupants) == 1:
            return self.energy_alone(gpu_type, occupants[0])
        if len(occupants) == 2:
            return self.energy_pair(gpu_type, occupants[0], occupants[1])
        raise ValueError(
            f"the energy model covers at most 2 co-located jobs (pairwise data), got {len(occupants)}"
        )


def kwh(joules: float) -> float:
    return joules / J_PER_KWH


__all__ = ["DEFAULT_ACTIVITY", "EnergyModel", "J_PER_KWH", "Occupant", "kwh"]

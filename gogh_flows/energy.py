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

Power limits (docs/energy.md, "Power limits in the decision"): every method takes an optional
``limit_w``, the board's power limit (None: its maximum, the default). Below the maximum a
limit slows the board's jobs by a common factor and caps its draw, as the power-limit model
(:mod:`gogh_flows.power_limits`, fitted on Zeus's measured curves) predicts from the draw at
full power. One limit holds for the whole board, so two jobs sharing it slow down together.

Idle accounting: with ``count_idle=True`` (default) an occupied GPU's idle
power is charged to its jobs and an empty GPU is assumed parked, which is how a
job's energy is reported to users. With ``count_idle=False`` idle power is
treated as paid anyway (an always-on fleet) and only the draw above idle counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from gogh_flows.catalog import GpuType, get_gpu_type
from gogh_flows.power_limits import PowerLimitModel, default_limit_model

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
    #: how a board answers a power limit; None: the shipped model (``gogh power fit``)
    limit_model: PowerLimitModel | None = None
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

    # -- power limits -----------------------------------------------------------------
    def max_limit(self, gpu_type: str | GpuType) -> float:
        """The board's full-power limit: the top of its range, else its TDP."""
        g = self.gpu(gpu_type)
        return g.power_limit_range_w[1] if g.power_limit_range_w else g.tdp_w

    def at_limit(self, gpu_type: str | GpuType, p0_w: float, limit_w: float | None) -> tuple[float, float]:
        """(slowdown, board W) under ``limit_w`` for a board drawing ``p0_w`` at its maximum limit.

        Relative to the maximum limit, where the throughputs and activities were measured, so
        a board already held back there (a job drawing about TDP) is not charged twice.
        """
        if limit_w is None:
            return 1.0, p0_w
        g = self.gpu(gpu_type)
        top = self.max_limit(g)
        if limit_w >= top:
            return 1.0, p0_w
        model = self.limit_model or default_limit_model()
        s_top, p_top = model.response(p0_w, g.idle_w, top)
        s, p = model.response(p0_w, g.idle_w, limit_w)
        return s / s_top, min(p0_w, p * p0_w / p_top)

    def limit_slowdown(self, gpu_type: str | GpuType, p0_w: float, limit_w: float, full_w: float,
                       mean_w: float | None = None) -> float:
        """How much a board limit of ``limit_w`` slowed a run against the board's own full limit
        ``full_w`` (its default: a PCIe board's is below its type's), for a board drawing ``p0_w``
        at full power.

        A real run at a limit is measured at it, and the refiner learns rates at full power. 1
        where the board drew well below the limit (``mean_w`` < 0.9 of it): the limit did not bind.
        """
        if limit_w >= full_w or (mean_w is not None and mean_w < 0.9 * limit_w):
            return 1.0
        return self.at_limit(gpu_type, p0_w, limit_w)[0] / self.at_limit(gpu_type, p0_w, full_w)[0]

    def at_limits(self, gpu_type: str | GpuType, p0_w, limit_w) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`at_limit` over arrays of board draws and limits (broadcast together; a limit
        at or above the maximum leaves the board as it is)."""
        g = self.gpu(gpu_type)
        model = self.limit_model or default_limit_model()
        top = self.max_limit(g)
        p0, limit = np.broadcast_arrays(np.asarray(p0_w, float), np.asarray(limit_w, float))
        s, p = model.responses(p0, g.idle_w, limit)
        s_top, p_top = model.responses(p0, g.idle_w, top)
        at_top = limit >= top
        return np.where(at_top, 1.0, s / s_top), np.where(at_top, p0, np.minimum(p0, p * p0 / p_top))

    # -- power by state ---------------------------------------------------------------
    def idle_power(self, gpu_type: str | GpuType) -> float:
        return self.gpu(gpu_type).idle_w

    def power_alone(self, gpu_type: str | GpuType, activity: float, limit_w: float | None = None) -> float:
        _check_unit("activity", activity)
        g = self.gpu(gpu_type)
        p0 = g.idle_w + activity * (g.tdp_w - g.idle_w)
        return p0 if limit_w is None else self.at_limit(g, p0, limit_w)[1]

    def power_shared(
        self, gpu_type: str | GpuType, loads: tuple[tuple[float, float], tuple[float, float]],
        limit_w: float | None = None,
    ) -> float:
        """Power with two jobs sharing; ``loads`` = ((activity, shared/isolated), ...) per job.

        The shares are those at full power: a limit slows both jobs alike, so it caps the
        board's draw without changing who draws what.
        """
        g = self.gpu(gpu_type)
        load = min(1.0, sum(a * r for a, r in loads))
        p0 = g.idle_w + load * (g.tdp_w - g.idle_w)
        return p0 if limit_w is None else self.at_limit(g, p0, limit_w)[1]

    # -- energy to completion ---------------------------------------------------------
    def energy_alone(self, gpu_type: str | GpuType, occ: Occupant, num_gpus: int = 1,
                     limit_w: float | None = None, *, rate: float | None = None,
                     board_w: float | None = None) -> float:
        """Joules for ``occ`` to finish alone (on each of ``num_gpus`` GPUs of a gang).

        ``rate`` and ``board_w``: what runs of the job measured at ``limit_w`` (steps/s, board W),
        in place of the model's slowdown and draw there.
        """
        idle, dyn = self._levels(gpu_type)
        p0 = idle + occ.activity * dyn
        if limit_w is None and rate is None and board_w is None:
            return num_gpus * p0 * occ.work / occ.isolated
        g = self.gpu(gpu_type)
        slow, board = self.at_limit(g, g.idle_w + occ.activity * dyn, limit_w)
        seconds = occ.work / rate if rate else occ.work * slow / occ.isolated
        return num_gpus * ((board if board_w is None else board_w) - (g.idle_w - idle)) * seconds

    def alone_at(self, gpu_type: str | GpuType, occ: Occupant, limit_w: float | None, *, num_gpus: int = 1,
                 informed: Callable[[float, float], tuple[float, float | None]] | None = None
                 ) -> tuple[float, float]:
        """(steps/s, joules to finish) of ``occ`` alone at ``limit_w``: the model's slowdown and draw,
        or, where ``informed`` ((limit W, the model's rate) -> (rate, measured board W or None):
        ``PlacementProblem.informed``) says what runs of the job measured there, theirs. The one
        costing of a job alone that the optimiser's options and the verifier share."""
        if limit_w is None:
            return occ.isolated, self.energy_alone(gpu_type, occ, num_gpus=num_gpus)
        model_rate = occ.isolated / self.at_limit(gpu_type, self.power_alone(gpu_type, occ.activity), limit_w)[0]
        if informed is None:
            return model_rate, self.energy_alone(gpu_type, occ, num_gpus=num_gpus, limit_w=limit_w)
        rate, watts = informed(limit_w, model_rate)
        return rate, self.energy_alone(gpu_type, occ, num_gpus=num_gpus, limit_w=limit_w,
                                       rate=None if rate == model_rate else rate, board_w=watts)

    def board_alone_w(self, gpu_type: str | GpuType, occ: Occupant, limit_w: float | None,
                      informed: Callable[[float, float], tuple[float, float | None]] | None = None) -> float:
        """A board's draw with ``occ`` alone at ``limit_w``, as :meth:`alone_at` costs it: what runs
        of the job measured there where ``informed`` says they did, else the model's."""
        if limit_w is not None and informed is not None:
            watts = informed(limit_w, occ.isolated)[1]
            if watts is not None:
                return watts
        return self.power_alone(gpu_type, occ.activity, limit_w)

    def energy_pair(self, gpu_type: str | GpuType, a: Occupant, b: Occupant,
                    limit_w: float | None = None) -> float:
        """Joules until both of two co-located jobs finish (survivor speeds back up).

        Under a limit both run ``slowdown`` times slower while they share, and the survivor
        then runs at the same limit alone (one limit per board until it is re-chosen).
        """
        if a.shared is None or b.shared is None:
            raise ValueError("both occupants of a shared GPU need their shared throughput")
        g = self.gpu(gpu_type)
        idle, dyn = self._levels(g)
        unpaid = g.idle_w - idle  # idle power treated as paid anyway (always-on accounting)
        load = min(1.0, a.activity * a.shared / a.isolated + b.activity * b.shared / b.isolated)
        slow, board = self.at_limit(g, g.idle_w + load * dyn, limit_w)
        ta, tb = slow * a.work / a.shared, slow * b.work / b.shared
        overlap = min(ta, tb)
        energy = (board - unpaid) * overlap
        survivor = a if ta > tb else b
        left = survivor.work - overlap * survivor.shared / slow  # type: ignore[operator]
        if left > 0:
            s_alone, p_alone = self.at_limit(g, g.idle_w + survivor.activity * dyn, limit_w)
            energy += (p_alone - unpaid) * left * s_alone / survivor.isolated
        return energy

    def energy(self, gpu_type: str | GpuType, occupants: tuple[Occupant, ...] | list[Occupant],
               limit_w: float | None = None) -> float:
        """Energy to completion of a single GPU's occupants (0, 1 or 2 jobs)."""
        if len(occupants) == 0:
            return 0.0
        if len(occupants) == 1:
            return self.energy_alone(gpu_type, occupants[0], limit_w=limit_w)
        if len(occupants) == 2:
            return self.energy_pair(gpu_type, occupants[0], occupants[1], limit_w=limit_w)
        raise ValueError(
            f"the energy model covers at most 2 co-located jobs (pairwise data), got {len(occupants)}"
        )


def kwh(joules: float) -> float:
    return joules / J_PER_KWH


__all__ = ["DEFAULT_ACTIVITY", "EnergyModel", "J_PER_KWH", "Occupant", "kwh"]

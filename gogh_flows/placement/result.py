"""What a policy answers: assignments, waiting jobs, and why.

Every placement explains itself (DESIGN §4): the predicted figures of the chosen
slot, the best alternatives, and how many other slots were rejected for what
reason. The explanation is data, so it can be printed as a table, published as
a Prefect artifact or logged to MLflow without re-deriving anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import polars as pl

from gogh_flows.energy import kwh

# Why a slot was not used for a job.
TOO_SLOW = "too slow"
NO_MEMORY = "no memory"
FULL = "full"
HURTS_PARTNER = "partner below requirement"
NO_SHARING = "no sharing"  # gang jobs and capacity-1 GPUs do not share
NOT_ENOUGH_GPUS = "not enough free GPUs"


@dataclass(frozen=True, slots=True)
class Choice:
    """One way to run a job: where, with whom, and the predicted figures."""

    gpu_type: str
    gpus: tuple[str, ...]  # concrete GPUs, or a representative free one for an empty slot
    throughput: float  # predicted steps/s of the job there
    energy_j: float  # predicted incremental energy to completion of this decision
    power_w: float  # predicted increase of the GPU's power draw when the job starts
    partner: str | None = None  # co-located job id
    partner_throughput: float | None = None
    partner_is_new: bool = False
    power_limit_w: float | None = None  # the board's limit with this option; None: its maximum
    limit_saving_j: float = 0.0  # energy saved against the same slot at its reference limit

    @property
    def where(self) -> str:
        """Where, in words; a solo option names no GPU id, since any free one of its type will do."""
        at = "" if self.power_limit_w is None else f" at {self.power_limit_w:g} W"
        if self.partner is None:
            n = len(self.gpus)
            return (f"{n} free {self.gpu_type} (gang)" if n > 1 else f"free {self.gpu_type}, alone") + at
        place = ",".join(self.gpus) if self.gpus else f"free {self.gpu_type}"
        return f"{place} ({self.gpu_type}) with {self.partner}{at}"


@dataclass(frozen=True, slots=True)
class Explanation:
    job_id: str
    chosen: Choice | None
    alternatives: tuple[Choice, ...]  # best feasible options not chosen, cheapest first
    rejected: dict[str, int]  # reason -> number of slots rejected for it
    best_throughput: float  # best predicted throughput anywhere (ignoring occupancy)
    note: str = ""


@dataclass(frozen=True, slots=True)
class Assignment:
    job_id: str
    gpu_type: str
    gpus: tuple[str, ...]
    throughput: float
    energy_j: float  # a pair of arriving jobs splits its energy by their solo energies
    partner: str | None = None
    partner_throughput: float | None = None
    #: the limit to set on the job's GPU(s) (a join sets it for the partner too); None: maximum
    power_limit_w: float | None = None


@dataclass(frozen=True, slots=True)
class Waiting:
    job_id: str
    reason: str
    best_throughput: float  # best predicted throughput on any GPU type of the fleet


@dataclass(frozen=True)
class Placement:
    policy: str
    assignments: tuple[Assignment, ...]
    waiting: tuple[Waiting, ...]
    status: str  # "optimal", "feasible" (time limit hit) or "heuristic"
    gap: float  # relative optimality gap of the energy objective; nan for heuristics
    solve_ms: float
    explanations: dict[str, Explanation] = field(default_factory=dict)

    @property
    def energy_j(self) -> float:
        return sum(a.energy_j for a in self.assignments)

    @property
    def placed_ids(self) -> frozenset[str]:
        return frozenset(a.job_id for a in self.assignments)

    def assignment(self, job_id: str) -> Assignment:
        for a in self.assignments:
            if a.job_id == job_id:
                return a
        raise KeyError(f"job {job_id!r} was not placed by {self.policy}")

    def runner_up_reason(self, job_id: str, alt: Choice | None = None) -> str | None:
        """Why the runner-up (or ``alt``) was not chosen when it is predicted cheaper for this job than the choice.

        One arrival decided alone always gets its cheapest feasible option; several decided
        together (a wave) share the fleet, and the decision minimises their *total* energy, so
        a job may give up its cheapest slot to another arrival that would lose more without it.
        """
        ex = self.explanations.get(job_id)
        if ex is None or ex.chosen is None or not (ex.alternatives or alt):
            return None
        alt, mine = alt or ex.alternatives[0], self.assignment(job_id)
        if not alt.energy_j < mine.energy_j:
            return None
        others = [a for a in self.assignments if a.job_id != job_id]
        if alt.partner is not None and alt.partner_is_new:
            where = next((a for a in others if a.job_id == alt.partner), None)
            if where is not None:
                return (f"it pairs with {alt.partner}, which this decision placed on {','.join(where.gpus)} "
                        "instead: cheaper for both jobs together")
        took = [a.job_id for a in others if set(a.gpus) & set(alt.gpus)]
        if not took and alt.partner is None:
            took = [a.job_id for a in others if a.gpu_type == alt.gpu_type and a.partner is None]
        if took:
            return (f"{'its GPU' if alt.partner is not None else f'the free {alt.gpu_type} GPUs'} went to "
                    f"{', '.join(took[:3])} in the same decision, which saves more energy in total")
        return (f"the decision minimises the total energy of its {len(self.assignments)} arrivals, "
                "not each job's own")

    def to_frame(self) -> pl.DataFrame:
        """The explanation table: one row per arriving job."""
        rows = []
        for a in self.assignments:
            ex = self.explanations.get(a.job_id)
            alt = ex.alternatives[0] if ex and ex.alternatives else None
            rows.append({
                "job": a.job_id, "gpu_type": a.gpu_type, "gpus": ",".join(a.gpus),
                "partner": a.partner, "pred_steps_per_s": a.throughput,
                "pred_energy_kwh": kwh(a.energy_j), "power_limit_w": a.power_limit_w,
                "limit_saving_kwh": kwh(ex.chosen.limit_saving_j) if ex and ex.chosen else None,
                "runner_up": alt.where if alt else None,
                "runner_up_energy_kwh": kwh(alt.energy_j) if alt else None,
                "runner_up_not_chosen_because": self.runner_up_reason(a.job_id),
                "rejected": _fmt_rejected(ex.rejected) if ex else "",
            })
        for w in self.waiting:
            rows.append({
                "job": w.job_id, "gpu_type": None, "gpus": "(waiting)", "partner": None,
                "pred_steps_per_s": w.best_throughput, "pred_energy_kwh": None, "power_limit_w": None,
                "limit_saving_kwh": None,
                "runner_up": None, "runner_up_energy_kwh": None, "runner_up_not_chosen_because": None,
                "rejected": w.reason,
            })
        schema = {
            "job": pl.String, "gpu_type": pl.String, "gpus": pl.String, "partner": pl.String,
            "pred_steps_per_s": pl.Float64, "pred_energy_kwh": pl.Float64,
            "power_limit_w": pl.Float64, "limit_saving_kwh": pl.Float64, "runner_up": pl.String,
            "runner_up_energy_kwh": pl.Float64, "runner_up_not_chosen_because": pl.String, "rejected": pl.String,
        }
        return pl.DataFrame(rows, schema=schema)

    def summary(self) -> str:
        gap = "n/a" if math.isnan(self.gap) else f"{self.gap:.2%}"
        return (
            f"{self.policy}: {len(self.assignments)} placed, {len(self.waiting)} waiting, "
            f"{kwh(self.energy_j):.3f} kWh predicted, status {self.status}, gap {gap}, "
            f"{self.solve_ms:.1f} ms"
        )


def _fmt_rejected(rejected: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(rejected.items()) if n)

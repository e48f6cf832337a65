"""Energy of several policies' runs over one common window: the comparison that is fair.

Each simulation integrates its fleet's power until its own last completion, so a policy
that finishes later was charged more idle draw and one that finishes sooner got its idle
time for free: ``oracle`` once used 1.3% *more* energy than greedy placement on Gavel's
trace only because its makespan was 6% longer. Here every policy of a run is charged over
the same window, from 0 to the last completion of any of them, in two accountings:

* **always on**: every GPU draws at least its idle power for the whole window (a fleet
  that stays powered; what a data centre pays);
* **parked**: an empty GPU draws nothing (idle GPUs powered down or lent out); the energy
  then is what the jobs drew, so it is what a placement decision changes.

Both come from one run: the empty GPUs' idle draw is integrated from the run's occupancy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from gogh_flows.catalog import get_gpu_type
from gogh_flows.energy import kwh
from gogh_flows.sim.engine import SimResult

__all__ = ["EnergyAccount", "busy_gpu_hours", "energy_accounts", "empty_idle_j"]


@dataclass(frozen=True)
class EnergyAccount:
    """One policy's energy over the common window, and its ratios to the references of the run."""

    window_s: float
    always_on_kwh: float
    parked_kwh: float
    always_on_vs: Mapping[str, float]  # reference policy -> ratio (1.0 = same energy)
    parked_vs: Mapping[str, float]
    #: every GPU's idle draw over the window: the part of ``always_on_kwh`` no decision changes
    idle_floor_kwh: float = 0.0

    def as_row(self) -> dict[str, float]:
        row = {"window_h": self.window_s / 3600, "energy_kwh_on": self.always_on_kwh,
               "energy_kwh_parked": self.parked_kwh, "idle_floor_kwh": self.idle_floor_kwh}
        row.update({f"on_vs_{ref}": v for ref, v in self.always_on_vs.items()})
        row.update({f"parked_vs_{ref}": v for ref, v in self.parked_vs.items()})
        return row


def _idle_w(fleet: Mapping[str, int], busy: Mapping[str, int]) -> float:
    return sum((n - busy.get(t, 0)) * get_gpu_type(t).idle_w for t, n in fleet.items())


def _spans(result: SimResult) -> Iterator[tuple[Mapping[str, int], float]]:
    """The run's occupancy as (busy GPUs per type, seconds it lasted), from 0 to the run's end."""
    steps = sorted(result.occupancy, key=lambda s: s[0])
    for (t0, busy), (t1, _) in zip(steps, [*steps[1:], (result.end_s, {})]):
        t1 = min(t1, result.end_s)
        if t1 > t0:
            yield busy, t1 - t0


def empty_idle_j(result: SimResult) -> float:
    """Joules the run's empty GPUs would draw at idle from 0 to its end (its occupancy steps)."""
    return sum(_idle_w(result.fleet, busy) * s for busy, s in _spans(result))


def busy_gpu_hours(result: SimResult) -> dict[str, float]:
    """GPU-hours each GPU type of the fleet was busy (one or two jobs on a board count once).

    Where the work went explains a ratio the energy alone does not: a policy that sends more jobs
    to the scarce efficient type queues them for it and finishes later, which lengthens every
    policy's common window (docs/evaluation.md, issue 12's bar)."""
    out = {t: 0.0 for t in result.fleet}
    for busy, s in _spans(result):
        for t, n in busy.items():
            out[t] = out.get(t, 0.0) + n * s / 3600
    return out


def energy_accounts(results: Mapping[str, SimResult], *, parked_run: bool = False,
                    references: tuple[str, ...] = ("greedy-fastest", "oracle")) -> dict[str, EnergyAccount]:
    """Every policy's energy over the window 0 .. the latest end of any of them.

    ``parked_run`` says how the runs were simulated (``SimConfig.park_idle``): their own
    ``energy_j`` then left empty GPUs out, otherwise it included their idle draw. Ratios
    are to each reference policy that is among ``results``.
    """
    if not results:
        raise ValueError("energy_accounts needs at least one policy's result")
    window = max(r.end_s for r in results.values())
    on: dict[str, float] = {}
    parked: dict[str, float] = {}
    for name, r in results.items():
        fleet_idle = _idle_w(r.fleet, {})
        empty = empty_idle_j(r)
        own_on = r.energy_j + (empty if parked_run else 0.0)
        on[name] = own_on + fleet_idle * (window - r.end_s)
        parked[name] = r.energy_j if parked_run else r.energy_j - empty
    refs = [ref for ref in references if ref in results]
    return {
        name: EnergyAccount(
            window_s=window, always_on_kwh=kwh(on[name]), parked_kwh=kwh(parked[name]),
            always_on_vs={ref: on[name] / on[ref] if on[ref] > 0 else float("nan") for ref in refs},
            parked_vs={ref: parked[name] / parked[ref] if parked[ref] > 0 else float("nan") for ref in refs},
            idle_floor_kwh=kwh(_idle_w(results[name].fleet, {}) * window),
        )
        for name in results
    }

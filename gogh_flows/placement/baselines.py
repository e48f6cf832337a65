"""Baseline policies: one arriving job at a time, first come first served.

They see the same options as the optimiser (so every one of them respects
memory, capacity and the requirements of the job and its partner), at the limit
each GPU has: they stand for schedulers that do not choose power limits, so a
problem's ``power_limit_levels`` are not theirs to use (with levels, the options
would be the optimiser's limited ones, and greedy-fastest would no longer be the
fastest). They differ only in the rule that picks one:

* ``first-fit``: the first GPU in fleet order that can take the job. It never
  compares GPU types, so it stands for a heterogeneity-unaware scheduler; but a
  fleet listed fastest type first is then filled fastest type first.
* ``first-fit-interleaved``: first fit over the GPUs with their types
  interleaved (one GPU of each type in turn), so fleet order says nothing about
  speed: the fairer heterogeneity-unaware baseline.
* ``random``: a uniformly random feasible option (seeded).
* ``greedy-fastest``: the option with the highest predicted throughput.
* ``greedy-min-power``: the option that adds the least power draw.
* ``greedy-efficiency``: the least energy per step, on a GPU of its own.

``rebalance_objective`` says what a policy would move a *running* job to a
freed slot for in the simulator (docs/simulation.md): ``"time"``, ``"energy"``,
or None (never: first-fit and random do not compare GPU types, and
greedy-min-power ranks instantaneous power, which weighs no remaining work).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from gogh_flows.placement.options import FleetState, JobOptions, options_for, waiting_reason
from gogh_flows.placement.problem import Gpu, PlacementProblem, level_watts
from gogh_flows.placement.result import Assignment, Choice, Explanation, Placement, Waiting


def explain(
    opts: JobOptions, chosen: Choice | None, note: str = "", top: int = 3,
    option: Choice | None = None,
) -> Explanation:
    """``option`` is the enumerated option behind ``chosen`` when a policy re-built it."""
    taken = option if option is not None else chosen
    alternatives = sorted(
        (c for c in opts.choices if c is not taken), key=lambda c: (c.energy_j, -c.throughput)
    )[:top]
    return Explanation(
        job_id=opts.job.id, chosen=chosen, alternatives=tuple(alternatives),
        rejected=dict(opts.rejected), best_throughput=opts.best_throughput, note=note,
    )


@dataclass
class SequentialPolicy:
    """Places arriving jobs in order, each with :meth:`choose`, updating occupancy."""

    name: str = "sequential"
    rebalance_objective: ClassVar[str | None] = None

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        raise NotImplementedError

    def place(self, problem: PlacementProblem) -> Placement:
        start = time.perf_counter()
        if problem.power_limit_levels:
            problem = dataclasses.replace(problem, power_limit_levels=())
        state = FleetState(problem)
        assignments: list[Assignment] = []
        waiting: list[Waiting] = []
        explanations: dict[str, Explanation] = {}
        for job in problem.arriving:
            opts = options_for(problem, state, job)
            choice = self.choose(opts, problem) if opts.choices else None
            explanations[job.id] = explain(opts, choice, note=self.name)
            if choice is None:
                waiting.append(Waiting(job.id, waiting_reason(opts), opts.best_throughput))
                continue
            state.add(job, choice.gpus, choice.power_limit_w)
            if choice.partner is not None:
                # a join sets the board's limit for the partner too, when it was placed just now
                assignments = [dataclasses.replace(a, power_limit_w=choice.power_limit_w)
                               if a.job_id == choice.partner else a for a in assignments]
            assignments.append(Assignment(
                job_id=job.id, gpu_type=choice.gpu_type, gpus=choice.gpus,
                throughput=choice.throughput, energy_j=choice.energy_j,
                partner=choice.partner, partner_throughput=choice.partner_throughput,
                power_limit_w=choice.power_limit_w,
            ))
        return Placement(
            policy=self.name, assignments=tuple(assignments), waiting=tuple(waiting),
            status="heuristic", gap=math.nan,
            solve_ms=(time.perf_counter() - start) * 1e3, explanations=explanations,
        )


def interleaved_order(gpus: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs with their types interleaved: the first of each type, then the second, ...

    Types take turns in the order they first appear in the fleet; a type that runs
    out drops from the rotation, and GPUs of one type keep their fleet order.
    """
    by_type: dict[str, list[Gpu]] = {}
    for g in gpus:
        by_type.setdefault(g.gpu_type, []).append(g)
    out: list[Gpu] = []
    for i in range(max((len(v) for v in by_type.values()), default=0)):
        out += [v[i] for v in by_type.values() if i < len(v)]
    return out


@dataclass
class FirstFit(SequentialPolicy):
    name: str = "first-fit"
    _order: tuple = field(default=((), {}), init=False, repr=False, compare=False)

    def gpu_order(self, gpus: Sequence[Gpu]) -> Sequence[Gpu]:
        return gpus

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        if self._order[0] is not problem.gpus:  # one ranking per decision, not per job
            self._order = (problem.gpus, {g.id: i for i, g in enumerate(self.gpu_order(problem.gpus))})
        order = self._order[1]
        return min(opts.choices, key=lambda c: order[c.gpus[0]])


@dataclass
class FirstFitInterleaved(FirstFit):
    name: str = "first-fit-interleaved"

    def gpu_order(self, gpus: Sequence[Gpu]) -> Sequence[Gpu]:
        return interleaved_order(gpus)


@dataclass
class RandomPolicy(SequentialPolicy):
    name: str = "random"
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        return self._rng.choice(opts.choices)


@dataclass
class GreedyFastest(SequentialPolicy):
    name: str = "greedy-fastest"
    rebalance_objective: ClassVar[str | None] = "time"

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        return min(opts.choices, key=lambda c: (-c.throughput, c.energy_j))


@dataclass
class CappedGreedyFastest(GreedyFastest):
    """Greedy-fastest's GPU, with every board at one fraction of its type's power-limit range.

    The simple baseline for choosing limits: what an operator does first (one ``nvidia-smi
    -pl`` for the whole fleet), against which a per-placement choice must earn its keep. A job
    measured short of its requirement under the cap is lifted to the lowest of
    ``power_limit_levels`` that meets it, by whoever enacts limits (the simulator's guard, as for every
    policy choosing limits). ``cap_fraction`` 0 is each type's lowest limit.
    """

    name: str = "greedy-fastest+cap"
    cap_fraction: float = 0.0
    power_limit_levels: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.cap_fraction <= 1.0:
            raise ValueError(f"cap_fraction is a share of each GPU type's power-limit range, 0-1; got "
                             f"{self.cap_fraction!r}")

    def place(self, problem: PlacementProblem) -> Placement:
        placement = super().place(problem)

        def cap(gpu_type: str) -> float | None:  # a type whose limit cannot be set runs at full power
            gpu = problem.energy.gpu(gpu_type)
            return level_watts(gpu, self.cap_fraction) if gpu.power_limit_range_w is not None else None

        capped = tuple(dataclasses.replace(a, power_limit_w=cap(a.gpu_type)) for a in placement.assignments)
        return dataclasses.replace(placement, assignments=capped)


@dataclass
class GreedyMinPower(SequentialPolicy):
    name: str = "greedy-min-power"

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        return min(opts.choices, key=lambda c: (c.power_w, c.energy_j))


@dataclass
class GreedyEfficiency(SequentialPolicy):
    name: str = "greedy-efficiency"
    rebalance_objective: ClassVar[str | None] = "energy"

    def choose(self, opts: JobOptions, problem: PlacementProblem) -> Choice | None:
        alone = [c for c in opts.choices if c.partner is None]
        return min(alone, key=lambda c: (c.energy_j, -c.throughput)) if alone else None


__all__ = [
    "FirstFit", "FirstFitInterleaved", "GreedyEfficiency", "GreedyFastest", "GreedyMinPower", "RandomPolicy",
    "SequentialPolicy", "explain", "interleaved_order",
]

"""A mixed stream where every job's model family is one its predictors never saw.

Why: scenario (e) of docs/evaluation.md re-labels a whole trace to one held-out family, which
tests the learned policies on a stream of a single family. A real fleet runs many families at
once, and a user's new models are unseen *each*. Here every family of the stream gets its own
predictors, trained without it (``sim.holdout.train_each_unseen``), and each job is planned with
the predictors of its family: the learned policies run on the scenario's own trace and mix, and
still place no job with a model that was trained on its family.

A co-located pair is two families: each side's rate comes from its own family's view (its own
predictors, its own learning base), the partner being a family that view was trained with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gogh_flows.placement.problem import Job
from gogh_flows.sim.learned import LearnedThroughputs, Predictors


@dataclass(frozen=True)
class UnseenFamilies:
    """One :class:`Predictors` per family, each trained without that family."""

    by_family: Mapping[str, Predictors]
    family_of: Mapping[str, str]  # job type -> family (the truth's, as ``MeasuredSet`` reads it)
    description: str = ""

    def family(self, job_type: str) -> str:
        fam = self.family_of.get(job_type)
        if fam is None or fam not in self.by_family:
            known = ", ".join(sorted(self.by_family))
            raise ValueError(f"job type {job_type!r} has no predictors trained without its family "
                             f"({fam or 'family unknown'}); these cover the families {known}: train them "
                             "on a truth that has the job type (sim.holdout.train_each_unseen)")
        return fam


class UnseenThroughputs:
    """The planner's ``Throughputs`` (and the learning-base ``observe`` hook) routed per family to
    a :class:`LearnedThroughputs` of that family's predictors."""

    def __init__(self, unseen: UnseenFamilies, gpu_types: Sequence[str], *, refine: bool = True,
                 risk_level: float | None = None, gpu_counts: Mapping[str, int] | None = None) -> None:
        self.unseen = unseen
        self.gpus = tuple(dict.fromkeys(gpu_types))
        # every view is built now, so a missing interval (risk level) fails before the run starts
        self.views = {fam: LearnedThroughputs(pred, self.gpus, refine=refine, risk_level=risk_level,
                                              gpu_counts=gpu_counts)
                      for fam, pred in unseen.by_family.items()}

    def view(self, job_type: str) -> LearnedThroughputs:
        return self.views[self.unseen.family(job_type)]

    @property
    def refinements(self) -> int:
        return sum(v.refinements for v in self.views.values())

    def isolated(self, job: Job, gpu_type: str) -> float:
        return self.view(job.job_type).isolated(job, gpu_type)

    def pair(self, job: Job, partner: Job, gpu_type: str) -> tuple[float, float]:
        if gpu_type not in self.gpus:
            return 0.0, 0.0
        own = self.view(job.job_type).pair_side(job, partner, gpu_type)
        other = self.view(partner.job_type).pair_side(partner, job, gpu_type)
        if not (own > 0 and other > 0):
            return 0.0, 0.0  # memory: the pair does not fit
        return own, other

    def activity(self, job: Job, gpu_type: str) -> float:
        return self.view(job.job_type).activity(job, gpu_type)

    def observe(self, job: Job, gpu_type: str, partner: Job | None, rate: float) -> None:
        self.view(job.job_type).observe(job, gpu_type, partner, rate)


def planning_view(predictors: Predictors | UnseenFamilies, gpu_types: Sequence[str], *, refine: bool,
                  risk_level: float | None, gpu_counts: Mapping[str, int] | None = None,
                  ) -> LearnedThroughputs | UnseenThroughputs:
    """The learned policies' planning view for either kind of predictors (``gpu_counts``: the
    fleet's GPUs per type, which gangs the feasibility floor may lift a type for)."""
    if isinstance(predictors, UnseenFamilies):
        return UnseenThroughputs(predictors, gpu_types, refine=refine, risk_level=risk_level, gpu_counts=gpu_counts)
    return LearnedThroughputs(predictors, gpu_types, refine=refine, risk_level=risk_level, gpu_counts=gpu_counts)


__all__ = ["UnseenFamilies", "UnseenThroughputs", "planning_view"]


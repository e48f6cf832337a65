"""What a placed flow body can ask about where it runs, and how it reports progress."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from gogh_flows.flows.placer import RunPlacement

_CURRENT: contextvars.ContextVar[CurrentPlacement | None] = contextvars.ContextVar(
    "gogh_current_placement", default=None)


@dataclass(frozen=True)
class CurrentPlacement:
    """The placement of the running flow body: its GPU, the prediction, and a progress API.

    ``device`` is the torch device string to put tensors on (``"cuda:0"`` on a real GPU,
    ``"cpu"`` on an emulated fleet). Call :meth:`report` after each step (or batch of
    steps) so the measured throughput is exact; a body that reports nothing is timed
    as having done the flow's declared ``work_steps`` in its wall time. On an emulated
    fleet :meth:`advance` "runs" steps at the emulated GPU's speed.
    """

    placement: RunPlacement
    device: str
    mode: str
    _gpu: Any  # gogh_flows.runtime.context.GpuContext

    @property
    def gpu_id(self) -> str:
        return self.placement.gpu_id

    @property
    def gpu_type(self) -> str:
        return self.placement.gpu_type

    @property
    def predicted_throughput(self) -> float:
        """What the predictors expect here (steps/s): at a policy's risk level, the point
        prediction, as the run's measurement records it; :attr:`planned_throughput` is the bound."""
        point = self.placement.point_throughput
        return self.placement.predicted_throughput if point is None else point

    @property
    def planned_throughput(self) -> float:
        """The figure the decision held this run to (steps/s): the lower end of the interval at
        :attr:`risk_level`, else the prediction itself."""
        return self.placement.predicted_throughput

    @property
    def risk_level(self) -> float | None:
        """The policy's risk level the run was planned at (None: point predictions)."""
        return self.placement.risk_level

    @property
    def required_throughput(self) -> float:
        return self.placement.required_throughput

    @property
    def power_limit_w(self) -> float | None:
        """The board power limit the placement chose (None: the board's maximum)."""
        return self.placement.power_limit_w

    @property
    def explanation_md(self) -> str:
        """Why it runs here (the Prefect artifact's markdown)."""
        return self.placement.explanation_md

    def report(self, steps: float = 1.0) -> None:
        self._gpu.report(steps)

    def advance(self, steps: float) -> None:
        self._gpu.advance(steps)


def current_placement() -> CurrentPlacement:
    """The placement of the ``@gogh_placed`` flow body calling this.

    Raises RuntimeError outside a placed body, so a missing decorator is not mistaken for
    "runs on the CPU".
    """
    cur = _CURRENT.get()
    if cur is None:
        raise RuntimeError(
            "current_placement() is only available inside the body of a @gogh_placed flow run")
    return cur


__all__ = ["CurrentPlacement", "current_placement"]

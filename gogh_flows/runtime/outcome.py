"""The result of one pool run: the body's value *and* its measurements.

A failed body still ran on a GPU for a while and drew power; dropping that
measurement would bias the learnt throughputs towards the runs that succeed.
So the pool never lets the body's exception escape the worker: it comes back
inside :class:`RunOutcome`, and :meth:`RunOutcome.unwrap` re-raises it where
the caller wants the usual behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gogh_flows.runtime.telemetry import TelemetryReading

__all__ = ["RunFailed", "RunOutcome"]


class RunFailed(RuntimeError):
    """A body failed and its original exception could not be shipped back."""


@dataclass(frozen=True)
class RunOutcome:
    """``value`` the body returned (``None`` if it raised), its telemetry and partners.

    ``partners`` lists the job types that shared the GPU at any time during the
    run, one entry per partner run, in order of arrival. ``error`` is
    ``"ExcType: message"`` when the body raised, with the traceback text in
    ``traceback``.
    """

    value: Any
    telemetry: TelemetryReading
    partners: tuple[str, ...]
    error: str | None = None
    gpu_id: str = ""
    gpu_type: str = ""
    job_type: str | None = None
    run_id: str | None = None
    worker: str | None = None
    traceback: str | None = field(default=None, repr=False)
    exception: BaseException | None = field(default=None, repr=False, compare=False)
    started_at: float | None = None  # the body's wall-clock start and end on the worker (Unix s)
    ended_at: float | None = None
    #: a partner came or went while the body ran: its rate mixes two companies on the board
    company_changed: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Any:
        """The body's value, or its exception raised again."""
        if self.error is None:
            return self.value
        if self.exception is not None:
            raise self.exception
        raise RunFailed(f"run {self.run_id} on {self.gpu_id} failed: {self.error}\n{self.traceback or ''}")

"""What a body running on a pool GPU can see of where it runs.

The pool's worker-side wrapper sets a :class:`GpuContext` in a context variable
around the body, so user code (a Prefect flow body, a training loop) asks
``current_gpu()`` instead of being handed extra arguments: the same function
runs unchanged outside a pool, where ``current_gpu()`` is ``None``.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.telemetry import Meter

__all__ = ["GpuContext", "RunCancelled", "current_gpu", "use_gpu"]

class RunCancelled(Exception):
    """The run was cancelled while its body ran; raised at the body's next progress report."""


_STOP_LOCK = threading.Lock()
_CURRENT: contextvars.ContextVar[GpuContext | None] = contextvars.ContextVar("gogh_gpu", default=None)


@dataclass
class GpuContext:
    """The GPU a body runs on and the handle it reports progress through.

    ``torch_device`` is ``"cuda:0"`` on a real GPU (a worker's own board comes
    first in its ``CUDA_VISIBLE_DEVICES``) and ``"cpu"`` when emulated. ``mode`` is the pool's mode;
    ``emulated`` says whether this device is emulated (a remote pool may mix).
    """

    device: GpuDevice
    torch_device: str
    mode: str
    job_type: str | None = None
    run_id: str | None = None
    emulated: bool = True
    meter: Meter | None = field(default=None, repr=False, compare=False)
    #: set when the run was asked to stop (cancelled): the next progress report raises
    stop_requested: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    #: why the stop was asked (shown in the RunCancelled the body raises)
    stop_reason: str = field(default="cancelled", repr=False, compare=False)
    #: whether the run's placing process is connected to the pool now (None: not known); set
    #: where the worker holds the run's lease
    placer_connected: Callable[[], bool | None] | None = field(default=None, repr=False, compare=False)

    def request_stop(self, reason: str = "cancelled") -> None:
        """Ask the body to stop at its next progress report (thread-safe); the first reason stands,
        as in the ledger (a lease found gone after its placer was lost keeps "placer lost")."""
        with _STOP_LOCK:
            if not self.stop_requested.is_set():
                self.stop_reason = reason
            self.stop_requested.set()

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise RunCancelled(f"run {self.run_id} on {self.device.id} was asked to stop: {self.stop_reason}")

    def report(self, steps: float = 1.0) -> None:
        """Count ``steps`` of progress (thread-safe); throughput = steps / duration.

        Raises RunCancelled once the run was asked to stop: a Python thread cannot be killed,
        so a cancelled body stops at its next report and only then frees its GPU.
        """
        self._check_stop()
        if self.meter is not None:
            self.meter.report(steps)

    def advance(self, steps: float) -> None:
        """Emulated: run ``steps`` at the true throughput for the current partners (a stop asked
        meanwhile interrupts it, as a report would). Real GPU: report them."""
        self._check_stop()
        if self.meter is not None:
            self.meter.advance(steps, between=self._check_stop)

    @property
    def partners(self) -> tuple[str, ...]:
        """Job types sharing this GPU right now."""
        return self.meter.partners if self.meter is not None else ()


def current_gpu() -> GpuContext | None:
    """The GPU the calling body runs on, or ``None`` outside a pool run."""
    return _CURRENT.get()


@contextmanager
def use_gpu(ctx: GpuContext) -> Iterator[GpuContext]:
    """Make ``ctx`` the current GPU for the duration of the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)

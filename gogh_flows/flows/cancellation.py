"""A flow run's cancellation, read from the Prefect API by the process that placed it.

Prefect delivers a cancellation by its runner or worker signalling the flow run's process
once it hears of it (an event stream, with polling only when that stream is lost). Under
load that can fail: in a 500-run benchmark on a SQLite Prefect server, a runner never
signalled a cancelled run, whose 120 s body ran to its end holding its GPU. The placing
process therefore also reads the run's state every few seconds while the body runs; when
it says Cancelling, the body is asked to stop, and once it has, the run is marked Cancelled
(what the runner would have done) before the flow raises ``RunCancelled``. Prefect's engine
then records that exception as the run's final state, Failed, whose message says the run was
cancelled in Prefect: a Cancelling run refuses the engine's Failed, a Cancelled one takes it,
and a run must not stay Cancelling for ever.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any

log = logging.getLogger("gogh_flows")


class PrefectCancellation:
    """Asks Prefect whether one flow run is being cancelled; ``seen`` once it was.

    Each question is asked on a thread of its own and answered by the next call: a loaded
    Prefect server (whose client retries for minutes) must not delay the caller, which also
    watches the run's lease and outcome.
    """

    def __init__(self, flow_run_id: Any) -> None:
        self.flow_run_id = flow_run_id
        self.seen = False
        self._said = False
        self._asking: threading.Thread | None = None

    @classmethod
    def for_run(cls, flow_run: Any) -> PrefectCancellation | None:
        """None outside a flow run, or on a temporary Prefect server nobody else can cancel on."""
        if flow_run is None:
            return None
        from prefect.settings import get_current_settings

        return cls(flow_run.id) if get_current_settings().api.url else None

    def __call__(self) -> bool:
        """Whether a cancellation was seen so far; asks again unless a question is still open."""
        if not self.seen and (self._asking is None or not self._asking.is_alive()):
            # with this thread's context: Prefect's settings (its API's address) may live there
            self._asking = threading.Thread(target=contextvars.copy_context().run, args=(self._ask,),
                                            name=f"gogh-cancelled-{self.flow_run_id}", daemon=True)
            self._asking.start()
        return self.seen

    def _ask(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.objects import StateType

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
        except Exception as exc:  # noqa: BLE001 - the runner's own signal still works; asked again later
            if not self._said:
                log.warning("gogh: could not read the Prefect state of flow run %s (asked again): %s",
                            self.flow_run_id, exc)
            self._said = True
            return
        if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
            self.seen = True

    def finish(self, message: str) -> None:
        """The body has stopped: move a run still Cancelling on to Cancelled (said, never raised)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.objects import StateType
        from prefect.states import Cancelled

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(self.flow_run_id).state
                if state is not None and state.type == StateType.CANCELLING:
                    client.set_flow_run_state(self.flow_run_id, Cancelled(message=message))
        except Exception as exc:  # noqa: BLE001 - its runner, if any, may still end it
            log.warning("gogh: could not mark flow run %s Cancelled: %s", self.flow_run_id, exc)


__all__ = ["PrefectCancellation"]

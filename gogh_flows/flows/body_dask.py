"""A placed body's own Dask work stays on its worker, on its GPU.

Why: a body runs in a Dask worker's thread of the GPU pool, and Dask sends ``dask.compute``
from such a thread to that worker's client: the body's own work then ran on the pool's other
GPUs, outside their slots and unmeasured, and with one slot per GPU it waited for ever behind
the body that asked for it (a Prefect review). While any body runs, Dask's default scheduler
is therefore its local thread pool. A default ``distributed.Client`` would not keep the work
off the pool: inside a worker's thread Dask resolves it to that worker's client. Work meant
for a cluster of the user's goes there explicitly (``client.compute(x)``, or
``dask.compute(x, scheduler=client)``).

Dask's configuration is the process's, not a thread's, so bodies running together share one
setting: the first to start sets it and the last to end puts back what was there (nested
``dask.config.set`` blocks ended out of order, and the second body lost the setting mid-run
while the process kept it after both: a review). On the emulated fleet, whose workers are
threads of the user's own process, the user's other threads see it too while bodies run:
their ``dask.compute`` runs on local threads then, not on a default client of theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dask

_lock = threading.Lock()
_bodies = 0
_undo: Any = None  # the dask.config.set that the last body to end exits


@contextmanager
def bodys_own_dask() -> Iterator[None]:
    """Run a body with Dask's local threads as the default scheduler (see the module's docstring)."""
    global _bodies, _undo
    with _lock:
        if _bodies == 0:
            _undo = dask.config.set(scheduler="threads")
        _bodies += 1
    try:
        yield
    finally:
        with _lock:
            _bodies -= 1
            if _bodies == 0 and _undo is not None:
                undo, _undo = _undo, None
                undo.__exit__(None, None, None)


__all__ = ["bodys_own_dask"]

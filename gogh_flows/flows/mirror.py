"""The background MLflow mirror of a session's measurements.

A run's measurement is durable before the run returns (parquet table + spool file); the
MLflow write costs ~100-200 ms per run on SQLite, so it is made here, off the run's
critical path, with an outage said once and retried with back-off.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from gogh_flows.tracking.errors import short_error
from gogh_flows.tracking.measurements import MeasurementLog

log = logging.getLogger("gogh_flows")


#: how far before the last pull a periodic pull looks (by a run's end): a run another machine
#: logs later than this after it ended (spooled through an outage there) reaches this table at
#: the next retraining's full pull
PULL_MARGIN_S = 3600.0
#: how often a shared pool's placing process pulls
PULL_EVERY_S = 60.0
#: failed collections in a row before an outage is said
_COLLECT_FAILURES_SAID = 3


class SpoolFlusher:
    """Writes deferred measurements to MLflow in the background.

    A run's measurement is durable before the run returns (parquet table + spool file);
    the MLflow mirror costs ~100-200 ms per run on SQLite, so it is written here instead
    of on the run's critical path. Whatever is left at exit is flushed by ``close``.
    """

    def __init__(self, log: MeasurementLog, interval_s: float = 0.5,
                 collect: Callable[[], object] | None = None, collect_every_s: float = 5.0,
                 pull_every_s: float | None = None) -> None:
        self.log = log
        self.interval_s = interval_s
        # also, every pull_every_s (a shared pool's placing processes): take into the table what
        # the other machines logged to the store, so that placements here learn from their runs;
        # the whole store once, then the runs that ended since the last pull that worked (less
        # PULL_MARGIN_S: a run is logged a little after it ends)
        self._pull_every_s = pull_every_s
        self._pulled_at: float | None = None  # when the last pull that worked began
        self._tried_at = -math.inf
        # also, every collect_every_s: log what the pool's ledger holds for this store
        # (measurements of runs whose placing process was lost)
        self._collect = collect
        self._collect_every_s = collect_every_s
        self._collected_at = -1e18
        self._collect_failures = 0  # in a row
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gogh-mlflow-mirror", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        wait, failing = self.interval_s, False
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            self._collect_lost()
            try:
                self.log.flush_spool(raise_unreachable=True)  # an outage raises: backed off, said once
            except Exception as exc:  # keep spooled; retried with back-off, said once per outage
                if not failing:
                    log.warning("gogh: MLflow is unavailable, measurements stay in the local table and "
                                "spool and are mirrored when it is back: %s", short_error(exc))
                failing, wait = True, min(30.0, max(wait * 2, 1.0))
                continue
            if failing:
                log.warning("gogh: MLflow is back; the spooled measurements were mirrored")
            failing, wait = False, self.interval_s
            self._pull()  # after this process's own writes: a long first pull does not hold them

    def _collect_lost(self) -> None:
        if self._collect is None or time.monotonic() - self._collected_at < self._collect_every_s:
            return
        self._collected_at = time.monotonic()
        try:
            self._collect()
        except Exception as exc:  # noqa: BLE001 - the ledger keeps them; asked again next time
            self._collect_failures += 1
            # said once an outage lasts: one slow answer from a busy scheduler is not one
            # (it warned under every loaded test run), and nothing is lost meanwhile
            if self._collect_failures == _COLLECT_FAILURES_SAID:
                log.warning("gogh: could not collect the measurements the pool's ledger holds for lost "
                            "placing processes for %d tries in a row (asked again every %g s; they wait "
                            "there): %s", self._collect_failures, self._collect_every_s, short_error(exc))
            else:
                log.debug("gogh: collecting lost placing processes' measurements failed: %s", short_error(exc))
        else:
            self._collect_failures = 0

    def _pull(self) -> None:
        if self._pull_every_s is None or time.monotonic() - self._tried_at < self._pull_every_s:
            return
        self._tried_at = time.monotonic()
        began = time.time()
        since = None if self._pulled_at is None else self._pulled_at - PULL_MARGIN_S
        try:
            added = self.log.pull(since=since)
        except Exception as exc:  # noqa: BLE001 - an outage is said by the flush; pulled again later
            log.debug("gogh: pulling other machines' measurements from the tracking store failed: %s",
                      short_error(exc))
            return
        self._pulled_at = began
        if added:
            log.info("gogh: took %d measurement(s) other machines logged to the tracking store into the table",
                     added)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)


__all__ = ["SpoolFlusher"]

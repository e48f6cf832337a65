"""Who holds which GPU slot, shared by every flow run on this host.

Placement decisions are taken by independent flow runs (threads of one
process, or separate processes started by a Prefect worker). Each reads the
occupancy, decides, and must then *claim* its slot; two runs that decided from
the same snapshot must not both get the last slot. The claim is therefore an
atomic check-and-insert in SQLite under ``BEGIN IMMEDIATE`` (one writer at a
time across processes), with WAL so readers never block the writers.

A crashed run never releases its slot; :meth:`PlacementLedger.expire` drops
reservations not refreshed (:meth:`touch`) for a while.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LedgerError", "PlacementLedger", "Reservation"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS reservations (
    run_id TEXT NOT NULL,
    gpu_id TEXT NOT NULL,
    job_type TEXT NOT NULL,
    capacity INTEGER NOT NULL,
    required_throughput REAL NOT NULL,
    work REAL NOT NULL,
    started_at REAL NOT NULL,
    seen_at REAL NOT NULL,
    PRIMARY KEY (run_id, gpu_id)
);
CREATE INDEX IF NOT EXISTS reservations_gpu ON reservations (gpu_id);
"""


class LedgerError(ValueError):
    """A reservation request that contradicts what the ledger holds."""


@dataclass(frozen=True)
class Reservation:
    """One run holding one slot of one GPU (``started_at``/``seen_at``: Unix seconds)."""

    run_id: str
    gpu_id: str
    job_type: str
    required_throughput: float
    work: float
    started_at: float
    seen_at: float


def _check(run_id: str, gpu_ids: Sequence[str], job_type: str, required_throughput: float, work: float) -> None:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    if not gpu_ids or any(not isinstance(g, str) or not g for g in gpu_ids):
        raise ValueError(f"gpu ids must be non-empty strings, got {list(gpu_ids)!r}")
    if len(set(gpu_ids)) != len(gpu_ids):
        raise ValueError(f"run {run_id!r} lists a GPU twice: {list(gpu_ids)}")
    if not isinstance(job_type, str) or not job_type:
        raise ValueError(f"job_type must be a non-empty string, got {job_type!r}")
    for name, value in (("required_throughput", required_throughput), ("work", work)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} of run {run_id!r} must be a finite number >= 0, got {value!r}")


class PlacementLedger:
    """GPU slot reservations in a SQLite file, safe across threads and processes.

    Every call opens its own connection, so a ledger object may be shared by
    threads and survives ``fork``; the file is the shared state.
    """

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")  # take the write lock before reading the counts
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def reserve(self, run_id: str, gpu_id: str, job_type: str, capacity: int, *,
                required_throughput: float, work: float) -> bool:
        """Claim one slot of ``gpu_id`` for ``run_id``; ``False`` if it already has ``capacity`` runs.

        Re-reserving the same (run, GPU) is a no-op that returns ``True`` (a
        retried task); holding a *different* GPU already is an error: release first.
        """
        return self.reserve_gang(run_id, [gpu_id], job_type, capacity,
                                 required_throughput=required_throughput, work=work)

    def reserve_gang(self, run_id: str, gpu_ids: Sequence[str], job_type: str,
                     capacity: int | Mapping[str, int], *, required_throughput: float, work: float) -> bool:
        """Claim one slot on each of ``gpu_ids`` for ``run_id``, all or none."""
        gpu_ids = list(gpu_ids)
        _check(run_id, gpu_ids, job_type, required_throughput, work)
        caps = {g: (capacity[g] if isinstance(capacity, Mapping) else capacity) for g in gpu_ids}
        for g, c in caps.items():
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"capacity of GPU {g!r} must be a whole number >= 1, got {c!r}")
        now = time.time()
        with self._write() as conn:
            held = {r[0] for r in conn.execute("SELECT gpu_id FROM reservations WHERE run_id = ?", (run_id,))}
            if held:
                if held == set(gpu_ids):
                    return True
                raise LedgerError(
                    f"run {run_id!r} already holds {sorted(held)}; release it before reserving {gpu_ids}"
                )
            for g in gpu_ids:
                (count,) = conn.execute("SELECT COUNT(*) FROM reservations WHERE gpu_id = ?", (g,)).fetchone()
                if count >= caps[g]:
                    return False
            conn.executemany(
                "INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(run_id, g, job_type, caps[g], float(required_throughput), float(work), now, now)
                 for g in gpu_ids],
            )
            return True

    def release(self, run_id: str) -> None:
        """Free every slot ``run_id`` holds (nothing if it holds none)."""
        with self._write() as conn:
            conn.execute("DELETE FROM reservations WHERE run_id = ?", (run_id,))

    def touch(self, run_id: str) -> bool:
        """Mark ``run_id`` alive now (long runs call this so :meth:`expire` keeps them)."""
        with self._write() as conn:
            return conn.execute("UPDATE reservations SET seen_at = ? WHERE run_id = ?",
                                (time.time(), run_id)).rowcount > 0

    def occupants(self) -> dict[str, list[Reservation]]:
        """gpu_id -> its reservations, oldest first."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT run_id, gpu_id, job_type, required_throughput, work, started_at, seen_at "
                "FROM reservations ORDER BY gpu_id, started_at, run_id"
            ).fetchall()
        out: dict[str, list[Reservation]] = {}
        for row in rows:
            r = Reservation(*row)
            out.setdefault(r.gpu_id, []).append(r)
        return out

    def expire(self, older_than_s: float) -> int:
        """Drop reservations not seen for more than ``older_than_s`` seconds; how many were dropped."""
        if not older_than_s >= 0:
            raise ValueError(f"older_than_s must be >= 0 seconds, got {older_than_s!r}")
        with self._write() as conn:
            return conn.execute("DELETE FROM reservations WHERE seen_at < ?",
                                (time.time() - older_than_s,)).rowcount

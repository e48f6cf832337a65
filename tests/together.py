"""Start writers together and wait for all of them: what every concurrency test here does."""

from __future__ import annotations

import threading


def run_threads_beside(threads: list[threading.Thread], procs: list, timeout_s: float = 120.0) -> None:
    """Start and join ``threads`` while the already started ``procs`` run; each process must exit 0."""
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(timeout=timeout_s)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"

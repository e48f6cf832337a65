"""Waiting in tests for something another thread or process does: always with a deadline, so a
broken feature fails its test with a message instead of hanging the suite."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], object], what: str, timeout_s: float = 60.0, poll_s: float = 0.02) -> None:
    """Return once ``condition()`` is true; fail saying ``what`` did not happen within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)

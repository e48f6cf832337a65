"""Settings read from the environment: one reading, one kind of error, for each.

Why one module: the runtime's seconds settings (the ledger's lease timeout, the pool's start-up
bound, the wait for a silent scheduler) were each parsed where they are used, with three
messages and two ideas of what is valid (one took ``inf``, one a blank value as unset, one
not). A typo in any of them is now refused the same way, naming the variable, what it bounds
and what it was given, before anything is placed or started.
"""

from __future__ import annotations

import math
import os


def seconds(env: str, default: float, what: str, *, value: object = None, argument: str | None = None) -> float:
    """``value`` if given, else ``$env`` (blank counts as unset), else ``default``: a finite number of
    seconds > 0. ``what`` says what the setting bounds; ``argument``, the parameter ``value`` came from."""
    given = value is not None
    raw = value if given else (os.environ.get(env, "").strip() or default)
    try:
        out = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        out = math.nan
    if not (math.isfinite(out) and out > 0):
        name = argument if given and argument else f"${env}"
        raise ValueError(f"{name} must be a number of seconds > 0 ({what}), got {raw!r}")
    return out


__all__ = ["seconds"]

"""Errors raised by the tracking adapter.

Each one subclasses a builtin so callers that do not know this package can still catch
them sensibly (a refused artifact is bad input, a missing model is a failed lookup, a dead
server is a connection problem), while callers that do know can react precisely.
"""

from __future__ import annotations


class UnsafeArtifactError(ValueError):
    """A model directory holds something that could execute code when loaded, or is malformed.

    Registries are inputs: anyone with write access to one could plant a pickle. We refuse
    rather than warn, because loading is the moment the damage happens.
    """


class ModelNotFoundError(LookupError):
    """The registry has no model, alias or version by that name."""


class TrackingUnavailableError(ConnectionError):
    """The MLflow tracking/registry backend cannot be reached."""


def short_error(exc: BaseException) -> str:
    """``Type: message``, cut to 300 characters: for a log line that must stay one line."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."

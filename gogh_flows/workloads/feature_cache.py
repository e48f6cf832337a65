"""A disk cache of the zoo's reference features, shared by every process of a machine.

Extracting them traces each family on the ``meta`` device: about 7-10 s of CPU for the
whole zoo, paid by every new process that needs them (each Dask worker of an emulated
fleet builds the zoo's truth table on its first run; each placing process, the features
of its flows' models). They depend only on the zoo's and the extractor's source and on
torch, so they are kept as JSON (never code) under a key made of exactly those, and
written atomically: processes starting together may compute them twice, never read half.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from gogh_flows import durable
from gogh_flows.workloads.features import WorkloadFeatures

log = logging.getLogger("gogh_flows")

CACHE_ENV = "GOGH_CACHE_DIR"


def cache_dir() -> Path:
    """``$GOGH_CACHE_DIR``, else ``$XDG_CACHE_HOME/gogh-flows``, else ``~/.cache/gogh-flows``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gogh-flows"


def _source_version() -> str:
    """What the features depend on: the zoo's and the extractor's source, and torch.

    Read once, when the zoo is imported, so that a long-lived process whose files were
    updated under it keeps writing under the key of the code it runs.
    """
    h = hashlib.sha256(torch.__version__.encode())
    here = Path(__file__).parent
    for name in ("zoo.py", "features.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


_VERSION = _source_version()


def _version() -> str:
    return _VERSION


def cached_features(name: str, compute: Callable[[], WorkloadFeatures], *, batch_size: int,
                    kind: str) -> WorkloadFeatures:
    """The features stored under ``name`` for this zoo version, computed and stored if absent."""
    path = cache_dir() / f"zoo-features-{_version()}" / f"{name}.json"
    try:
        feats = WorkloadFeatures.from_dict(json.loads(path.read_text()))
        if (feats.batch_size, feats.kind) == (batch_size, kind):
            return feats
        log.debug("gogh: zoo feature cache %s holds another batch size or kind; extracting again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable: computed again, rewritten
        log.debug("gogh: zoo feature cache %s unreadable (%s); extracting again", path, exc)
    feats = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_text(path, json.dumps(feats.to_dict()))
    except Exception as exc:  # noqa: BLE001 - a read-only or full disk: features are right, only not kept
        log.debug("gogh: could not keep zoo features in %s: %s", path.parent, exc)
    return feats


__all__ = ["CACHE_ENV", "cache_dir", "cached_features"]

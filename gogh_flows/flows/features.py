"""Layer features of every job type placed onto a pool, as the placing processes see them.

A run placed by another process is a co-location partner here too, and predicting next
to it needs its features: they are kept in small JSON files under ``$GOGH_HOME`` (never
pickles), zoo job types are rebuilt from their name when no file has them, and a user
model's, which only the process that decorated it can read, are published through the
pool's ledger (``shared``) for the placing processes on other machines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gogh_flows import durable
from gogh_flows.workloads.features import WorkloadFeatures
from gogh_flows.workloads.zoo import parse_job_kind, zoo_features

log = logging.getLogger("gogh_flows")


class FeatureStore:
    """Layer features by job type, shared across processes through small JSON files and,
    given ``shared`` (a callable returning the pool's :class:`~gogh_flows.runtime.leases.PoolLedger`),
    across machines through the pool's ledger.

    A run placed by another process is a co-location partner here too, and its
    predictions need its features; zoo job types can be rebuilt from their name,
    user models cannot.
    """

    def __init__(self, root: Path, shared: Callable[[], Any] | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, WorkloadFeatures] = {}
        self._shared = shared
        self._lock = threading.Lock()
        self._said_unshared = False

    def _path(self, job_type: str) -> Path:
        return self.root / (hashlib.sha1(job_type.encode()).hexdigest()[:16] + ".json")

    def put(self, job_type: str, features: WorkloadFeatures) -> None:
        if job_type not in self._mem:
            self._mem[job_type] = features
            self._write(job_type, features)
        self._publish(job_type, features)

    def _write(self, job_type: str, features: WorkloadFeatures) -> None:
        path = self._path(job_type)
        if not path.exists():
            durable.write_text(path, json.dumps({"job_type": job_type, "features": features.to_dict()}))

    def _publish(self, job_type: str, features: WorkloadFeatures) -> None:
        """At each placement, before its claim: a placing process elsewhere may find this run beside
        the GPU it considers. The ledger is asked whether it has them (a few bytes) and sent them
        when it has not: a scheduler restarted under a live process forgets them, so "published
        once" is not enough. A zoo job type needs none (every process rebuilds it from its name);
        a failure is said once and placement goes on."""
        if self._shared is None or _is_zoo(job_type):
            return
        try:
            ledger = self._shared()
            if ledger.put_features(job_type):
                return
            if not ledger.put_features(job_type, json.dumps(features.to_dict())):
                raise ValueError("the ledger refused them (larger than it keeps)")
        except Exception as exc:  # noqa: BLE001 - e.g. a scheduler preloaded with an older ledger
            with self._lock:
                said, self._said_unshared = self._said_unshared, True
            if not said:
                log.warning("gogh: could not publish the layer features of %r to the pool's ledger (%s: %s); "
                            "placing processes on other machines cannot predict next to its runs (is the "
                            "scheduler's gogh-flows older than this one?)", job_type, type(exc).__name__, exc)

    def get(self, job_type: str) -> WorkloadFeatures:
        if job_type in self._mem:
            return self._mem[job_type]
        path = self._path(job_type)
        damaged = path.exists()
        feats = self._read(path) if damaged else None
        if feats is None:
            try:
                family, bs, kind = parse_job_kind(job_type)
            except (KeyError, ValueError) as exc:
                feats = self._from_shared(job_type)
                if feats is None:
                    why = (f"its file here was damaged (kept as {path.with_suffix('.json.bad').name}; placing a run "
                           "of it from this machine records them again)" if damaged else
                           "it was not placed from this machine")
                    raise KeyError(
                        f"no layer features recorded for job type {job_type!r}: {why}, and the pool's ledger has none "
                        "published (a placing process older than this gogh-flows, or a ledger restarted since)"
                    ) from exc
                self._write(job_type, feats)
            else:
                feats = zoo_features(family, bs, kind)
        self._mem[job_type] = feats
        return feats

    @staticmethod
    def _read(path: Path) -> WorkloadFeatures | None:
        """The features a file holds; a damaged one is set aside (``.bad``) and read as missing, so
        they are rebuilt or looked up again: it made every retraining fail with its JSON error."""
        try:
            return WorkloadFeatures.from_dict(json.loads(path.read_text())["features"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            bad = path.with_suffix(".json.bad")
            try:
                os.replace(path, bad)
            except OSError:
                bad = path
            log.warning("gogh: the layer features file %s is damaged (%s: %s); kept as %s, and the features are "
                        "rebuilt or looked up again", path, type(exc).__name__, exc, bad)
            return None

    def _from_shared(self, job_type: str) -> WorkloadFeatures | None:
        if self._shared is None:
            return None
        try:
            doc = self._shared().features([job_type]).get(job_type)
            # JSON, never a pickle: a document another process published is data, not code
            return None if doc is None else WorkloadFeatures.from_dict(json.loads(doc))
        except Exception as exc:  # noqa: BLE001 - said in the KeyError the caller raises
            log.warning("gogh: could not read the layer features of %r from the pool's ledger (%s: %s)",
                        job_type, type(exc).__name__, exc)
            return None


def _is_zoo(job_type: str) -> bool:
    try:
        parse_job_kind(job_type)
    except (KeyError, ValueError):
        return False
    return True


__all__ = ["FeatureStore"]

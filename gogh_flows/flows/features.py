"""Layer features of every job type placed onto a pool, as the placing processes see them.

A run placed by another process is a co-location partner here too, and predicting next
to it needs its features: they are kept in small JSON files under ``$GOGH_HOME`` (never
pickles), and zoo job types are rebuilt from their name when no file has them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from gogh_flows.workloads.features import WorkloadFeatures
from gogh_flows.workloads.zoo import parse_job_kind, zoo_features


class FeatureStore:
    """Layer features by job type, shared across processes through small JSON files.

    A run placed by another process is a co-location partner here too, and its
    predictions need its features; zoo job types can be rebuilt from their name,
    user models cannot.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, WorkloadFeatures] = {}

    def _path(self, job_type: str) -> Path:
        return self.root / (hashlib.sha1(job_type.encode()).hexdigest()[:16] + ".json")

    def put(self, job_type: str, features: WorkloadFeatures) -> None:
        if job_type in self._mem:
            return
        self._mem[job_type] = features
        path = self._path(job_type)
        if not path.exists():  # unique temp name per process and thread; the rename is atomic
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"job_type": job_type, "features": features.to_dict()}))
            os.replace(tmp, path)

    def get(self, job_type: str) -> WorkloadFeatures:
        if job_type in self._mem:
            return self._mem[job_type]
        path = self._path(job_type)
        if path.exists():
            doc = json.loads(path.read_text())
            feats = WorkloadFeatures.from_dict(doc["features"])
        else:
            try:
                family, bs, kind = parse_job_kind(job_type)
            except (KeyError, ValueError) as exc:
                raise KeyError(f"no layer features recorded for job type {job_type!r}") from exc
            feats = zoo_features(family, bs, kind)
        self._mem[job_type] = feats
        return feats


__all__ = ["FeatureStore"]

"""The full prediction vector of one job: isolated on every GPU type, then shared with every partner.

Entry ``g`` is the job alone on GPU type ``g``; entry ``G + p * G + g`` is the job's own
throughput when it shares a GPU of type ``g`` with partner ``p``. P2 reads and writes
vectors in this layout, in log space, with NaN for "unknown".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.p1 import Prediction


@dataclass(frozen=True)
class Layout:
    gpus: tuple[str, ...]
    partners: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.gpus) * (1 + len(self.partners))

    @property
    def n_isolated(self) -> int:
        return len(self.gpus)

    def isolated_index(self, gpu: str) -> int:
        return self.gpus.index(gpu)

    def pair_index(self, partner: str, gpu: str) -> int:
        return len(self.gpus) * (1 + self.partners.index(partner)) + self.gpus.index(gpu)

    def is_pair(self) -> np.ndarray:
        out = np.ones(self.size, dtype=bool)
        out[: self.n_isolated] = False
        return out

    def pack(self, isolated: np.ndarray, pair: np.ndarray) -> np.ndarray:
        """``[J, G]`` + ``[J, P, G]`` -> ``[J, size]`` (values as given)."""
        j = isolated.shape[0]
        return np.concatenate([isolated, pair.reshape(j, -1)], axis=1)

    def unpack(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = len(self.gpus)
        return v[..., :g], v[..., g:].reshape(*v.shape[:-1], len(self.partners), g)

    def truth(self, data: MeasuredSet, names: Sequence[str]) -> np.ndarray:
        """``[J, size]`` log of measured throughputs, NaN where not measured."""
        iso = data.isolated_matrix(names)
        pair = data.pair_tensor(names, self.partners)
        with np.errstate(divide="ignore"):
            return np.log(self.pack(iso, pair))

    def from_prediction(self, pred: Prediction) -> np.ndarray:
        """``[J, size]`` log P1 vectors; -inf entries (does not fit) become NaN (never used)."""
        if pred.gpus != self.gpus or pred.partners != self.partners:
            raise ValueError("P1 prediction was made for other GPU types / partners than this layout")
        with np.errstate(divide="ignore"):
            v = np.log(self.pack(pred.isolated, pred.pair))
        v[~np.isfinite(v)] = np.nan
        return v

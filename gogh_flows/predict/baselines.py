"""What P2 must beat, given the same observations of a new job.

* :class:`MatrixCompletion` -- what Gavel does for unseen jobs: the known jobs' log
  throughput vectors form a matrix ``X ~ mu + b_row + U V^T``; a new job's row is fitted
  to its few observed entries (ridge on the row factor, free row bias) and read off
  everywhere else. With no observation the row is the column mean ("an average job").
* :class:`NearestJob` -- take the most similar known job by whole-step features (the
  nearest in a :class:`Domain`, which the product's ensemble also measures reach in) and scale
  its measured profile: by the ratio of observed to neighbour throughput where the new job
  has observations, by the ratio of step FLOPs where it has none.

* :class:`PriorRow` -- the baselines that need no training at all (a per-type mean, the
  ratio of one observation, a partner-mean slowdown, a roofline ratio), and :func:`shifted`,
  which moves any prior (P1's included) to a job's observations.

All work on log vectors in a :class:`~gogh_flows.predict.layout.Layout`, NaN = unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gogh_flows.predict.encoding import SUMMARY_DIM


class MatrixCompletion:
    def __init__(self, rank: int = 2, ridge: float = 1.0, iters: int = 60, seed: int = 0) -> None:
        if rank < 0:
            raise ValueError("rank must be >= 0")
        self.rank, self.ridge, self.iters, self.seed = rank, ridge, iters, seed

    def fit(self, known_log: np.ndarray) -> MatrixCompletion:
        """Alternating least squares on the observed entries of ``[J, D]``."""
        x = np.asarray(known_log, dtype=float)
        m = np.isfinite(x)
        if not m.any():
            raise ValueError("matrix completion needs at least one known entry")
        col_n = m.sum(0)
        self.mu = np.where(col_n > 0, np.nansum(np.where(m, x, 0), 0) / np.maximum(col_n, 1), np.nan)
        fill = np.nanmean(self.mu)
        self.mu = np.where(np.isfinite(self.mu), self.mu, fill)
        rng = np.random.default_rng(self.seed)
        j, d = x.shape
        k = self.rank
        u = rng.normal(0, 0.1, (j, k))
        v = rng.normal(0, 0.1, (d, k))
        b = np.zeros(j)
        resid = np.where(m, x - self.mu, 0.0)
        for _ in range(self.iters):
            for i in range(j):  # row bias + row factor
                o = m[i]
                if not o.any():
                    continue
                a = np.hstack([np.ones((o.sum(), 1)), v[o]])
                reg = self.ridge * np.eye(k + 1)
                reg[0, 0] = 1e-6
                sol = np.linalg.solve(a.T @ a + reg, a.T @ resid[i, o])
                b[i], u[i] = sol[0], sol[1:]
            for c in range(d):
                o = m[:, c]
                if not o.any() or k == 0:
                    continue
                a = u[o]
                v[c] = np.linalg.solve(a.T @ a + self.ridge * np.eye(k), a.T @ (resid[o, c] - b[o]))
        self.v = v
        return self

    def complete(self, observed_log: np.ndarray) -> np.ndarray:
        """Rows ``[B, D]`` with NaN where unobserved -> full log rows (observed entries kept)."""
        obs = np.atleast_2d(np.asarray(observed_log, dtype=float))
        out = np.empty_like(obs)
        k = self.rank
        for i, row in enumerate(obs):
            o = np.isfinite(row)
            pred = self.mu.copy()
            if o.any():
                a = np.hstack([np.ones((o.sum(), 1)), self.v[o]])
                reg = self.ridge * np.eye(k + 1)
                reg[0, 0] = 1e-6
                sol = np.linalg.solve(a.T @ a + reg, a.T @ (row[o] - self.mu[o]))
                pred = self.mu + sol[0] + self.v @ sol[1:]
            out[i] = np.where(o, row, pred)
        return out


@dataclass(frozen=True)
class Domain:
    """Where the training jobs lie in P1's input space (:func:`~gogh_flows.predict.encoding.job_summary`,
    each feature scaled by the training jobs' standard deviation), to tell how far a new job is
    from anything P1 and P2 learned from."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    points: tuple[tuple[float, ...], ...]  # the training jobs, scaled

    @classmethod
    def fit(cls, summaries: np.ndarray) -> Domain:
        x = np.asarray(summaries, dtype=float)
        if x.ndim != 2 or not len(x):
            raise ValueError("the domain needs the summaries of at least one training job, [J, S]")
        mean, std = x.mean(0), x.std(0)
        scale = np.where(std > 1e-6, std, 1.0)
        return cls(tuple(map(float, mean)), tuple(map(float, scale)),
                   tuple(tuple(map(float, row)) for row in (x - mean) / scale))

    def nearest(self, summary: np.ndarray) -> tuple[int, float]:
        """The nearest training job (its row) to a job (its summary), and its distance in scaled units."""
        z = (np.asarray(summary, dtype=float) - np.asarray(self.mean)) / np.asarray(self.scale)
        dist = np.linalg.norm(np.asarray(self.points) - z, axis=1)
        nb = int(np.argmin(dist))
        return nb, float(dist[nb])

    def distance(self, summary: np.ndarray) -> float:
        """Euclidean distance of a job (its summary) to the nearest training job, in scaled units."""
        return self.nearest(summary)[1]

    def to_dict(self) -> dict:
        return {"mean": list(self.mean), "scale": list(self.scale), "points": [list(p) for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Domain:
        dom = cls(tuple(float(v) for v in d["mean"]), tuple(float(v) for v in d["scale"]),
                  tuple(tuple(float(v) for v in p) for p in d["points"]))
        n = len(dom.mean)
        if (n != SUMMARY_DIM or len(dom.scale) != n or not dom.points or any(len(p) != n for p in dom.points)
                or not all(math.isfinite(v) for v in (*dom.mean, *dom.scale, *(x for p in dom.points for x in p)))
                or min(dom.scale) <= 0):
            raise ValueError(f"ensemble domain: mean, scale and every point need {SUMMARY_DIM} finite values (scale > 0), "
                             f"one per feature of P1's job summary; got {n}")
        return dom


class NearestJob:
    def __init__(self, summaries: np.ndarray, known_log: np.ndarray, log_flops: np.ndarray) -> None:
        """``summaries`` ``[J, S]`` whole-step features of the known jobs, ``known_log`` ``[J, D]``."""
        self.domain = Domain.fit(summaries)
        self.known = np.asarray(known_log, dtype=float)
        self.log_flops = np.asarray(log_flops, dtype=float)
        known = np.isfinite(self.known)
        n = known.sum(axis=0)
        col = np.where(n > 0, np.where(known, self.known, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)
        # columns nobody measured (e.g. a held-out partner) fall back to the overall mean
        self.col_mean = np.where(np.isfinite(col), col, np.nanmean(col) if np.isfinite(col).any() else 0.0)

    def complete(self, summary: np.ndarray, log_flops: float, observed_log: np.ndarray) -> np.ndarray:
        """One new job's full log row from its features and observations (NaN = unobserved)."""
        row = np.asarray(observed_log, dtype=float)
        nb = self.domain.nearest(summary)[0]
        prof = self.known[nb]
        o = np.isfinite(row) & np.isfinite(prof)
        shift = float(np.mean(row[o] - prof[o])) if o.any() else float(self.log_flops[nb] - log_flops)
        base = np.where(np.isfinite(prof), prof, self.col_mean)
        return np.where(np.isfinite(row), row, base + shift)


def shifted(prior_log: np.ndarray, observed_log: np.ndarray) -> np.ndarray:
    """``prior_log`` moved by the mean log offset of the observed entries (observed entries kept).

    The no-learning way to use an observation: a job measured at 2x its prior on one GPU
    type is assumed 2x everywhere. With no usable observation the prior is returned as is.
    """
    prior = np.asarray(prior_log, dtype=float)
    row = np.asarray(observed_log, dtype=float)
    o = np.isfinite(row) & np.isfinite(prior)
    offset = float(np.mean(row[o] - prior[o])) if o.any() else 0.0
    return np.where(np.isfinite(row), row, prior + offset)


class PriorRow:
    """A baseline that is one log row per job, shifted to its observations (:func:`shifted`).

    Three are built from the training jobs alone, with nothing trained:

    * :meth:`type_mean`: each entry's geometric mean over the training jobs (an isolated
      entry: the GPU type's; a pair entry: with that partner on that type). Shifted by one
      observation on type ``a`` it predicts type ``b`` as ``observation x geometric mean of
      t_b / t_a`` over the training jobs: the *ratio* baseline.
    * :meth:`partner_mean`: isolated entries as ``type_mean``; a pair entry as the job's
      isolated entry times the training jobs' geometric-mean slowdown next to that partner
      on that type (the mean over every partner where that partner was never measured).
    * :meth:`roofline`: isolated entries from the job's roofline kernel time on each type
      (``max(FLOPs / peak, bytes / bandwidth)`` per layer), scaled by one efficiency factor
      fitted on the training jobs; pair entries by the partner-mean slowdown. Shifted by an
      observation, the efficiency drops out: a parameter-free cross-type ratio.
    """

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = np.asarray(rows, dtype=float)

    def complete(self, i: int, observed_log: np.ndarray) -> np.ndarray:
        return shifted(self.rows[i], observed_log)

    @staticmethod
    def _col_mean(known: np.ndarray) -> np.ndarray:
        n = np.isfinite(known).sum(axis=0)
        total = np.where(np.isfinite(known), known, 0.0).sum(axis=0)
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)

    @staticmethod
    def slowdown_table(known: np.ndarray, n_gpus: int) -> tuple[np.ndarray, np.ndarray]:
        """``[P, G]`` mean log(pair / isolated) of the training jobs per (partner, type), a partner
        never measured on a type taking that type's mean over partners; and those means ``[G]``
        (log 0.5 for a type with no pair measured at all)."""
        iso = known[:, :n_gpus]
        pair = known[:, n_gpus:].reshape(known.shape[0], -1, n_gpus)
        with np.errstate(invalid="ignore"):
            ratio = pair - iso[:, None, :]
        n = np.isfinite(ratio).sum(axis=0)
        mean = np.where(n > 0, np.where(np.isfinite(ratio), ratio, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)
        per_type = np.array([np.nanmean(mean[:, g]) if np.isfinite(mean[:, g]).any() else np.log(0.5)
                             for g in range(n_gpus)])
        return np.where(np.isfinite(mean), mean, per_type[None, :]), per_type

    @classmethod
    def _slowdowns(cls, known: np.ndarray, n_gpus: int) -> np.ndarray:
        """``[P*G]``: :meth:`slowdown_table` flattened as the layout's pair entries."""
        return cls.slowdown_table(known, n_gpus)[0].reshape(-1)

    @classmethod
    def type_mean(cls, known_log: np.ndarray, n_jobs: int, n_gpus: int) -> PriorRow:
        known = np.asarray(known_log, dtype=float)
        mean = cls._col_mean(known)
        # a partner no training job was measured with (a held-out family): the partner-mean row
        fallback = cls.partner_mean(known, 1, n_gpus).rows[0]
        return cls(np.repeat(np.where(np.isfinite(mean), mean, fallback)[None, :], n_jobs, axis=0))

    @classmethod
    def partner_mean(cls, known_log: np.ndarray, n_jobs: int, n_gpus: int) -> PriorRow:
        known = np.asarray(known_log, dtype=float)
        iso = cls._col_mean(known)[:n_gpus]
        slow = cls._slowdowns(known, n_gpus)
        row = np.concatenate([iso, np.tile(iso, len(slow) // n_gpus) + slow])
        return cls(np.repeat(row[None, :], n_jobs, axis=0))

    @classmethod
    def roofline(cls, known_log: np.ndarray, train_roof_log: np.ndarray, test_roof_log: np.ndarray,
                 n_gpus: int) -> PriorRow:
        """``*_roof_log``: ``[J, G]`` log roofline throughput (1 / kernel time) of training and test jobs."""
        known = np.asarray(known_log, dtype=float)
        gap = known[:, :n_gpus] - np.asarray(train_roof_log, dtype=float)
        efficiency = float(np.nanmean(gap)) if np.isfinite(gap).any() else 0.0
        iso = np.asarray(test_roof_log, dtype=float) + efficiency
        slow = cls._slowdowns(known, n_gpus)
        pairs = np.tile(iso, (1, len(slow) // n_gpus)) + slow[None, :]
        return cls(np.concatenate([iso, pairs], axis=1))

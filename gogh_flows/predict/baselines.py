"""What P2 must beat, given the same observations of a new job.

* :class:`MatrixCompletion` -- what Gavel does for unseen jobs: the known jobs' log
  throughput vectors form a matrix ``X ~ mu + b_row + U V^T``; a new job's row is fitted
  to its few observed entries (ridge on the row factor, free row bias) and read off
  everywhere else. With no observation the row is the column mean ("an average job").
* :class:`NearestJob` -- take the most similar known job by whole-step features and scale
  its measured profile: by the ratio of observed to neighbour throughput where the new job
  has observations, by the ratio of step FLOPs where it has none.

Both work on log vectors in a :class:`~gogh_flows.predict.layout.Layout`, NaN = unknown.
"""

from __future__ import annotations

import numpy as np


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


class NearestJob:
    def __init__(self, summaries: np.ndarray, known_log: np.ndarray, log_flops: np.ndarray) -> None:
        """``summaries`` ``[J, S]`` whole-step features of the known jobs, ``known_log`` ``[J, D]``."""
        self.mean = summaries.mean(0)
        self.std = np.where(summaries.std(0) > 1e-6, summaries.std(0), 1.0)
        self.z = (summaries - self.mean) / self.std
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
        dist = np.linalg.norm(self.z - (summary - self.mean) / self.std, axis=1)
        nb = int(np.argmin(dist))
        prof = self.known[nb]
        o = np.isfinite(row) & np.isfinite(prof)
        shift = float(np.mean(row[o] - prof[o])) if o.any() else float(self.log_flops[nb] - log_flops)
        base = np.where(np.isfinite(prof), prof, self.col_mean)
        return np.where(np.isfinite(row), row, base + shift)

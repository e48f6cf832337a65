"""P2, the correlation-guided refiner: one observation of a job corrects its whole vector.

Input: P1's log prediction for every entry of the job's :class:`Layout` (every GPU type,
every partner), the observed log throughputs and their mask. Output: the corrected log
vector; observed entries keep their observed value.

Structure. An observation's *residual* ``r_o = log y_o - log p1_o`` says how wrong P1 was
on that entry, and P1's errors are strongly correlated across GPU types and partners (it
misjudges a model's host overhead everywhere at once). So the correction of entry ``e``
is a learned, positively weighted average of the observed residuals,

    delta_e = sum_o m_o w_oe r_o / sum_o m_o w_oe,        w = softplus(S)

(``S`` starts uniform: before training P2 is "shift everything by the mean residual"),
plus a small network that reads the whole masked picture for what an average cannot
express (e.g. a pair slowdown that differs from the isolated error). With no observation
the average is empty and P2 returns P1 up to that small network's correction.

Training masks known vectors: for every training job, a random subset of its measured
entries is revealed and the loss is measured on the rest. The P1 vectors it learns from
must carry realistic P1 errors, so the caller passes *out-of-family* P1 predictions
(:func:`gogh_flows.predict.evaluate.out_of_family_p1`).

Trust in proportion to the evidence (:attr:`P2Model.trust_scale`). A refiner learns how P1
errs on jobs it gets wrong; applied to a job P1 already predicts well (a family it was
trained on, on the fleet it was trained for) its cross-type and profile corrections only
add error. With a trust scale ``s``, the correction of a job's unobserved entries is applied
in proportion to how wrong P1 was shown to be on the job's observed ones: the fraction
``min(1, mean |r_o| / s)`` of it. A job whose measurements match P1 keeps P1's shape; a job
P1 misjudges by ``s`` or more gets the full correction. ``None`` applies it in full
(the shipped priors); the retraining flow chooses ``s`` on its validation measurements.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from gogh_flows.predict.layout import Layout


MIX_BOUND = 0.7
#: trust scales the retraining flow chooses among (mean |log error| of P1 on a job's observed
#: entries at which the refiner's correction applies in full; None: always in full)
TRUST_SCALES: tuple[float | None, ...] = (None, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


@dataclass(frozen=True)
class P2Config:
    hidden: int = 64
    epochs: int = 600
    lr: float = 3e-3
    weight_decay: float = 1e-4
    max_observed: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden < 4 or self.epochs < 1 or self.lr <= 0 or self.max_observed < 1:
            raise ValueError("P2 hidden must be >= 4, epochs >= 1, lr > 0 and max_observed >= 1")


class P2Net(nn.Module):
    def __init__(self, size: int, hidden: int) -> None:
        super().__init__()
        self.affinity = nn.Parameter(torch.zeros(size, size))
        # per target entry: how much an observation must weigh before it moves the entry (shrinkage
        # toward P1 for entries the observed ones say little about); starts near 0 = full shift
        self.prior = nn.Parameter(torch.full((size,), -4.0))
        # the second opinion: the typical profile of known jobs (set from the training data), shifted
        # to the observations -- what matrix completion does with one observation
        self.profile = nn.Parameter(torch.zeros(size))
        self.pop_affinity = nn.Parameter(torch.zeros(size, size))
        self.gate = nn.Parameter(torch.zeros(size))  # per entry: trust in P1's shape vs the profile's
        self.mix = nn.Sequential(nn.Linear(3 * size, hidden), nn.GELU(), nn.Linear(hidden, size))
        nn.init.zeros_(self.mix[-1].weight)
        nn.init.zeros_(self.mix[-1].bias)

    def forward(self, p1: torch.Tensor, obs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """p1 ``[B, D]`` (finite; 0 where unknown), obs ``[B, D]`` (0 where unobserved), mask ``[B, D]``."""
        r = (obs - p1) * mask
        w = nn.functional.softplus(self.affinity)  # [D_obs, D_target]
        from_p1 = p1 + (r @ w) / (mask @ w + nn.functional.softplus(self.prior))
        v = nn.functional.softplus(self.pop_affinity)
        rp = (obs - self.profile) * mask
        from_profile = self.profile + (rp @ v) / (mask @ v).clamp_min(1e-6)
        g = torch.sigmoid(self.gate)
        centred = p1 - p1.mean(dim=1, keepdim=True)
        # bounded (|.| < MIX_BOUND in log space): a P1 vector unlike any seen in training must not
        # send the free-form part anywhere; the observed residuals carry the large corrections
        free = MIX_BOUND * torch.tanh(self.mix(torch.cat([centred, r, mask], dim=1)) / MIX_BOUND)
        refined = g * from_p1 + (1 - g) * from_profile + free
        # nothing observed -> nothing to refine: P2 returns P1 as it is
        has_obs = mask.sum(dim=1, keepdim=True) > 0
        out = torch.where(has_obs, refined, p1)
        return torch.where(mask > 0, obs, out)


@dataclass
class P2Model:
    net: P2Net
    layout: Layout
    config: P2Config
    trained_on: dict = field(default_factory=dict)
    #: mean |log error| of P1 on a job's observed entries at which the correction applies in
    #: full (below it, in proportion); None: always in full. See the module docstring.
    trust_scale: float | None = None

    def __post_init__(self) -> None:
        x = self.trust_scale
        try:
            ok = x is None or (isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0)
        except OverflowError:  # an integer too large for a float
            ok = False
        if not ok:
            raise ValueError(f"trust_scale must be a positive number of log units or None, got {x!r:.60}")

    @torch.no_grad()
    def refine(self, p1_log: np.ndarray, observed_log: np.ndarray) -> np.ndarray:
        """Corrected log vectors ``[B, D]``; ``observed_log`` is NaN where nothing was observed."""
        self.net.eval()
        p1_log = np.atleast_2d(p1_log)
        observed_log = np.atleast_2d(observed_log)
        if p1_log.shape[1] != self.layout.size or observed_log.shape != p1_log.shape:
            raise ValueError(
                f"P2 expects vectors of length {self.layout.size} (layout of {len(self.layout.gpus)} "
                f"GPU types x {len(self.layout.partners)} partners); got {p1_log.shape} and {observed_log.shape}"
            )
        valid = np.isfinite(p1_log)
        mask = np.isfinite(observed_log)
        use = mask & valid  # a residual needs both: an observation where P1 has no value is kept as is
        p1 = torch.from_numpy(np.where(valid, p1_log, 0.0)).float()
        obs = torch.from_numpy(np.where(use, observed_log, 0.0)).float()
        out = self.net(p1, obs, torch.from_numpy(use).float()).double().numpy()
        if self.trust_scale is not None:
            residual = np.where(use, np.abs(observed_log - np.where(valid, p1_log, 0.0)), 0.0)
            share = np.minimum(1.0, residual.sum(axis=1) / np.maximum(use.sum(axis=1), 1) / self.trust_scale)
            out = np.where(valid, p1_log + share[:, None] * (out - np.where(valid, p1_log, 0.0)), out)
        out = np.where(mask, observed_log, out)
        return np.where(valid | mask, out, np.nan)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.net.state_dict().items()}

    def config_dict(self) -> dict:
        return {"p2": asdict(self.config), "layout": {"gpus": list(self.layout.gpus),
                                                      "partners": list(self.layout.partners)},
                "trained_on": self.trained_on, "trust_scale": self.trust_scale}

    @classmethod
    def from_state(cls, config: Mapping, state: Mapping[str, torch.Tensor]) -> P2Model:
        cfg = P2Config(**config["p2"])
        layout = Layout(tuple(config["layout"]["gpus"]), tuple(config["layout"]["partners"]))
        net = P2Net(layout.size, cfg.hidden)
        net.load_state_dict(dict(state))
        return cls(net=net, layout=layout, config=cfg, trained_on=dict(config.get("trained_on", {})),
                   trust_scale=config.get("trust_scale"))


def _sample_masks(known: np.ndarray, rng: np.random.Generator, max_observed: int,
                  is_pair: np.ndarray) -> np.ndarray:
    """Reveal 0..max_observed known entries per row, drawn like placements would produce them.

    Half the rows reveal only isolated entries, a quarter only pair entries, a quarter a mix,
    so P2 learns each direction of transfer (isolated -> pairs and back).
    """
    b, _ = known.shape
    mode = rng.random(b)[:, None]
    pool = known & np.where(mode < 0.5, ~is_pair[None, :], np.where(mode < 0.75, is_pair[None, :], True))
    n_cand = pool.sum(axis=1)
    hi = np.minimum(max_observed, np.maximum(n_cand - 1, 0))
    k = np.where(n_cand > 1, np.floor(rng.random(b) * (hi + 1)).astype(int), 0)
    # a random order of each row's candidates; the first k of them are revealed
    keys = np.where(pool, rng.random(pool.shape), np.inf)
    rank = np.argsort(np.argsort(keys, axis=1), axis=1)
    return pool & (rank < k[:, None])


def train_p2(layout: Layout, p1_log: np.ndarray, truth_log: np.ndarray, config: P2Config = P2Config(),
             *, log=None) -> P2Model:
    """Fit P2 on rows of (P1 vector, true vector), both ``[J, layout.size]`` log, NaN = unknown."""
    if p1_log.shape != truth_log.shape or p1_log.shape[1] != layout.size:
        raise ValueError(f"P2 training arrays must both be [jobs, {layout.size}]; got {p1_log.shape}, {truth_log.shape}")
    if p1_log.shape[0] < 2:
        raise ValueError("P2 needs at least two jobs with measurements to learn from")
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    net = P2Net(layout.size, config.hidden)
    known = np.isfinite(truth_log) & np.isfinite(p1_log)
    with torch.no_grad():  # start the profile at the known jobs' mean log throughput per entry
        n = known.sum(axis=0)
        col = np.where(n > 0, np.where(known, truth_log, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)
        net.profile.copy_(torch.from_numpy(np.where(np.isfinite(col), col, np.nanmean(col))).float())
    p1 = torch.from_numpy(np.where(np.isfinite(p1_log), p1_log, 0.0)).float()
    truth = torch.from_numpy(np.where(known, truth_log, 0.0)).float()
    is_pair = layout.is_pair()
    # repeat rows so each step sees several masks per job
    reps = max(1, 256 // p1.shape[0])
    opt = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    start = time.perf_counter()
    history = []
    net.train()
    for epoch in range(config.epochs):
        kn = np.repeat(known, reps, axis=0)
        mask = _sample_masks(kn, rng, config.max_observed, is_pair)
        m = torch.from_numpy(mask).float()
        tgt = torch.from_numpy(kn & ~mask).float()
        pp, tt = p1.repeat(reps, 1), truth.repeat(reps, 1)
        out = net(pp, tt * m, m)
        # iso and pair entries weigh equally in total, whatever their counts
        w_iso = tgt[:, ~torch.from_numpy(is_pair)]
        w_pair = tgt[:, torch.from_numpy(is_pair)]
        err = (out - tt) ** 2 * tgt
        loss = (err[:, ~torch.from_numpy(is_pair)].sum() / w_iso.sum().clamp_min(1)
                + err[:, torch.from_numpy(is_pair)].sum() / w_pair.sum().clamp_min(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
        if log is not None and (epoch + 1) % max(1, config.epochs // 5) == 0:
            log(f"P2 epoch {epoch + 1}/{config.epochs} loss {history[-1]:.4f}")
    net.eval()
    return P2Model(net=net, layout=layout, config=config, trained_on={
        "jobs": int(p1_log.shape[0]), "first_loss": history[0], "final_loss": history[-1],
        "seconds": round(time.perf_counter() - start, 2),
    })

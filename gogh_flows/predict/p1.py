"""P1, the initial estimator: throughput of a job nobody has measured, alone and in a pair.

A job is read as its layer-token sequence (recurrent, attention or -- for comparison -- a
feed-forward network over whole-step aggregates); a GPU type as its catalog vector.

The output is shaped like the physics rather than a free regression, so that it
extrapolates sanely to models and GPU types outside the training set:

    step time = roofline kernel time * exp(a) + exp(o)        throughput = 1 / step time

``a`` (how far the kernels fall short of the roofline) and ``o`` (the per-step host
overhead: data loading, Python, launches) are learned from the job and GPU encodings.
A pair head gives each partner's slowdown ``r in (0, 1]`` on a shared GPU, so a shared
throughput never exceeds the isolated one by construction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import nn

from gogh_flows.catalog import get_gpu_type
from gogh_flows.predict.data import MeasuredSet
from gogh_flows.predict.encoding import (
    GPU_DIM, ROOFLINE_DIM, SUMMARY_DIM, TOKEN_DIM, EncodedJobs, fits, gpu_vector, job_summary,
    layer_tokens, roofline,
)
from gogh_flows.truth.synthetic import MEMORY_HEADROOM
from gogh_flows.workloads.features import WorkloadFeatures

ENCODERS = ("gru", "ff", "transformer")
#: P1 as the mean, in log space, of one P1 per encoder of :data:`ENCODERS`, each trained apart on
#: the same data (:class:`P1MeanNet`): no single encoder extrapolates best to every new family,
#: and which one will cannot be told from the training families (docs/predictors.md)
MEAN = "mean"
#: every value ``P1Config.encoder`` takes
KINDS = (*ENCODERS, MEAN)


@dataclass(frozen=True)
class P1Config:
    encoder: str = "transformer"  # chosen by leave-one-family-out validation (docs/predictors.md)
    hidden: int = 32
    epochs: int = 300
    lr: float = 3e-3
    weight_decay: float = 1e-4
    pair_rows_per_epoch: int = 2048
    pair_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.encoder not in KINDS:
            raise ValueError(f"P1 encoder must be one of {KINDS}, got {self.encoder!r}")
        if self.hidden < 4 or self.epochs < 1 or self.lr <= 0:
            raise ValueError("P1 hidden must be >= 4, epochs >= 1 and lr > 0")


def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, o))


class _Encoder(nn.Module):
    """Job tokens + summary -> one embedding per job."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.summary = _mlp(SUMMARY_DIM, hidden, hidden)
        if kind == "gru":
            self.seq = nn.GRU(TOKEN_DIM, hidden, batch_first=True)
        elif kind == "transformer":
            self.proj = nn.Linear(TOKEN_DIM, hidden)
            self.pos = nn.Parameter(torch.zeros(1, 64, hidden))
            layer = nn.TransformerEncoderLayer(hidden, nhead=2, dim_feedforward=2 * hidden,
                                               dropout=0.0, batch_first=True)
            self.seq = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.out = nn.Linear(hidden * (1 if kind == "ff" else 2), hidden)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        parts = [self.summary(summary)]
        if self.kind == "gru":
            packed = nn.utils.rnn.pack_padded_sequence(tokens, lengths.cpu(), batch_first=True,
                                                       enforce_sorted=False)
            _, h = self.seq(packed)
            parts.append(h[-1])
        elif self.kind == "transformer":
            t = tokens.shape[1]
            x = self.proj(tokens) + self.pos[:, :t]
            pad = torch.arange(t)[None, :] >= lengths[:, None]
            y = self.seq(x, src_key_padding_mask=pad)
            keep = (~pad).unsqueeze(-1).float()
            parts.append((y * keep).sum(1) / keep.sum(1))
        return torch.tanh(self.out(torch.cat(parts, dim=-1)))


class P1Net(nn.Module):
    def __init__(self, encoder: str, hidden: int) -> None:
        super().__init__()
        self.encoder = _Encoder(encoder, hidden)
        self.gpu = nn.Sequential(nn.Linear(GPU_DIM, hidden), nn.GELU())
        self.iso_head = _mlp(2 * hidden + ROOFLINE_DIM, hidden, 2)
        self.pair_head = _mlp(3 * hidden + 2 * ROOFLINE_DIM, hidden, 1)

    def log_isolated(self, z: torch.Tensor, g: torch.Tensor, roof: torch.Tensor) -> torch.Tensor:
        """log steps/s for rows of (job embedding, gpu embedding, raw roofline features)."""
        a, o = self.iso_head(torch.cat([z, g, _scale_roof(roof)], dim=-1)).unbind(-1)
        log_kernel = roof[..., 0]
        return -torch.logaddexp(log_kernel + a, o - 6.0)

    def log_isolated_on(self, z: torch.Tensor, g: torch.Tensor, roof: torch.Tensor,
                        roof_new: torch.Tensor) -> torch.Tensor:
        """:meth:`log_isolated` with the shortfall and overhead learned for the board of (``g``,
        ``roof``) and the kernel time of another board (``roof_new``): see :meth:`P1Model.predict`."""
        a, o = self.iso_head(torch.cat([z, g, _scale_roof(roof)], dim=-1)).unbind(-1)
        return -torch.logaddexp(roof_new[..., 0] + a, o - 6.0)

    def log_ratio(self, zj: torch.Tensor, zp: torch.Tensor, g: torch.Tensor,
                  rj: torch.Tensor, rp: torch.Tensor) -> torch.Tensor:
        """log(shared / isolated) of job j next to p, <= 0."""
        x = torch.cat([zj, zp, g, _scale_roof(rj), _scale_roof(rp)], dim=-1)
        return -nn.functional.softplus(self.pair_head(x).squeeze(-1) + 1.0)


class P1MeanNet(nn.Module):
    """One :class:`P1Net` per encoder; predicts their mean log throughput and log slowdown.

    It answers the calls :class:`P1Net` answers (``encoder``, ``gpu``, ``log_isolated``,
    ``log_ratio``), so a :class:`P1Model` predicts and caches with it unchanged: an embedding is
    the members' embeddings side by side, split again for each member's heads. ``encoder`` and
    ``gpu`` are methods, not modules, so each member's weights appear once in the state."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.members = nn.ModuleList(P1Net(e, hidden) for e in ENCODERS)

    def encoder(self, tokens: torch.Tensor, lengths: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.encoder(tokens, lengths, summary) for m in self.members], dim=-1)

    def gpu(self, gpu_x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.gpu(gpu_x) for m in self.members], dim=-1)

    def log_isolated(self, z: torch.Tensor, g: torch.Tensor, roof: torch.Tensor) -> torch.Tensor:
        zs, gs = z.split(self.hidden, dim=-1), g.split(self.hidden, dim=-1)
        return torch.stack([m.log_isolated(zi, gi, roof) for m, zi, gi in zip(self.members, zs, gs)]).mean(0)

    def log_isolated_on(self, z: torch.Tensor, g: torch.Tensor, roof: torch.Tensor,
                        roof_new: torch.Tensor) -> torch.Tensor:
        zs, gs = z.split(self.hidden, dim=-1), g.split(self.hidden, dim=-1)
        return torch.stack([m.log_isolated_on(zi, gi, roof, roof_new)
                            for m, zi, gi in zip(self.members, zs, gs)]).mean(0)

    def log_ratio(self, zj: torch.Tensor, zp: torch.Tensor, g: torch.Tensor,
                  rj: torch.Tensor, rp: torch.Tensor) -> torch.Tensor:
        parts = zip(self.members, zj.split(self.hidden, dim=-1), zp.split(self.hidden, dim=-1),
                    g.split(self.hidden, dim=-1))
        return torch.stack([m.log_ratio(a, b, c, rj, rp) for m, a, b, c in parts]).mean(0)


def make_net(encoder: str, hidden: int) -> P1Net | P1MeanNet:
    """The network of a P1 with ``encoder`` (one of :data:`KINDS`)."""
    return P1MeanNet(hidden) if encoder == MEAN else P1Net(encoder, hidden)


def _scale_roof(roof: torch.Tensor) -> torch.Tensor:
    # log seconds are around -9..0; bring them near unit scale for the MLPs
    return torch.cat([(roof[..., :2] + 6.0) / 3.0, roof[..., 2:4], roof[..., 4:] / 3.0], dim=-1)


def _known_type(name: str) -> bool:
    try:
        get_gpu_type(name)
    except (KeyError, ValueError):
        return False
    return True


@dataclass
class _Prepared:
    """Tensors for one set of jobs and GPU types (encoder inputs, per-pair roofline)."""

    names: tuple[str, ...]
    gpus: tuple[str, ...]
    tokens: torch.Tensor
    lengths: torch.Tensor
    summary: torch.Tensor
    gpu_x: torch.Tensor  # [G, GPU_DIM]
    roof: torch.Tensor  # [J, G, ROOFLINE_DIM]
    fits: np.ndarray  # [J, G]
    memory: np.ndarray  # [J] estimated footprint, bytes
    gpu_memory: np.ndarray  # [G] bytes


@dataclass
class P1Model:
    """A trained P1 with the normalisation it was trained with; predicts for any jobs."""

    net: P1Net | P1MeanNet
    config: P1Config
    summary_mean: np.ndarray
    summary_std: np.ndarray
    gpu_mean: np.ndarray
    gpu_std: np.ndarray
    trained_on: dict = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def prepare(self, jobs: Mapping[str, WorkloadFeatures], gpus: Sequence[str]) -> _Prepared:
        names = tuple(jobs)
        gtypes = [get_gpu_type(g) for g in gpus]
        parts = [self._job_parts(n, jobs[n], tuple(gpus), gtypes) for n in names]
        t = max(len(p[0]) for p in parts)
        tokens = np.zeros((len(names), t, TOKEN_DIM), dtype=np.float32)
        for i, p in enumerate(parts):
            tokens[i, : len(p[0])] = p[0]
        summary = np.stack([p[1] for p in parts])
        gx = np.stack([gpu_vector(g) for g in gtypes])
        return _Prepared(
            names=names, gpus=tuple(gpus), tokens=torch.from_numpy(tokens),
            lengths=torch.tensor([len(p[0]) for p in parts], dtype=torch.long),
            summary=torch.from_numpy((summary - self.summary_mean) / self.summary_std).float(),
            gpu_x=torch.from_numpy((gx - self.gpu_mean) / self.gpu_std).float(),
            roof=torch.from_numpy(np.stack([p[2] for p in parts])).float(),
            fits=np.stack([p[3] for p in parts]),
            memory=np.asarray([p[4] for p in parts], dtype=float),
            gpu_memory=np.asarray([g.memory_bytes for g in gtypes], dtype=float),
        )

    def _job_parts(self, name: str, w: WorkloadFeatures, gpus: tuple[str, ...], gtypes: list) -> tuple:
        """Tokens, summary, roofline and memory of one job; cached because walking a model's
        layers (hundreds of them) is what makes a prediction slow, and the same jobs come back
        at every placement. Keyed by identity: an equal but new features object is recomputed."""
        key = (name, id(w), gpus)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        parts = (
            layer_tokens(w), job_summary(w),
            np.stack([roofline(w, g) for g in gtypes]),
            np.asarray([fits(w, g) for g in gtypes]),
            float(w.memory_bytes_estimate),
        )
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = (w, parts)
        return parts

    def _embed_cached(self, prep: _Prepared, jobs: Mapping[str, WorkloadFeatures]) -> tuple[torch.Tensor, torch.Tensor]:
        """Job embeddings, reusing those of jobs seen before (a trained model never changes;
        :func:`train_p1` always returns a new model)."""
        keys = [("z", n, id(jobs[n])) for n in prep.names]
        todo = [i for i, k in enumerate(keys) if (hit := self._cache.get(k)) is None or hit[0] is not jobs[prep.names[i]]]
        if todo:
            t = torch.tensor(todo, dtype=torch.long)
            lengths = prep.lengths[t]
            z_new = self.net.encoder(prep.tokens[t][:, : int(lengths.max())], lengths, prep.summary[t])
            for r, i in enumerate(todo):
                self._cache[keys[i]] = (jobs[prep.names[i]], z_new[r])
        z = torch.stack([self._cache[k][1] for k in keys])
        return z, self.net.gpu(prep.gpu_x)

    def _embed(self, prep: _Prepared) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net.encoder(prep.tokens, prep.lengths, prep.summary), self.net.gpu(prep.gpu_x)

    @torch.no_grad()
    def predict(self, jobs: Mapping[str, WorkloadFeatures], gpus: Sequence[str],
                partners: Mapping[str, WorkloadFeatures] | None = None) -> Prediction:
        """Isolated ``[J, G]`` and shared ``[J, P, G]`` throughputs (0 where memory does not fit)."""
        self.net.eval()
        allj = dict(jobs)
        partners = dict(partners) if partners is not None else {}
        for n, w in partners.items():
            allj.setdefault(n, w)
        prep = self.prepare(allj, gpus)
        z, g = self._embed_cached(prep, allj)
        jn = tuple(jobs)
        pn = tuple(partners)
        idx = {n: i for i, n in enumerate(prep.names)}
        ji = torch.tensor([idx[n] for n in jn], dtype=torch.long)
        J, G = len(jn), len(gpus)
        zj = z[ji][:, None, :].expand(J, G, -1)
        gg = g[None, :, :].expand(J, G, -1)
        log_iso = self.net.log_isolated(zj, gg, prep.roof[ji])  # [J, G]
        near = self.nearest_trained(gpus)
        if near:  # types P1 never saw: their kernel time, the nearest trained board's shortfall and overhead
            kn = tuple(dict.fromkeys(near.values()))
            kprep = self.prepare(allj, kn)
            gk = self.net.gpu(kprep.gpu_x)
            for c, t in near.items():
                k = kn.index(t)
                log_iso[:, c] = self.net.log_isolated_on(z[ji], gk[k][None, :].expand(J, -1), kprep.roof[ji][:, k],
                                                         prep.roof[ji][:, c])
        iso = np.exp(log_iso.numpy()) * prep.fits[ji.numpy()]
        pair = np.zeros((J, len(pn), G))
        if pn:
            pi = torch.tensor([idx[n] for n in pn], dtype=torch.long)
            P = len(pn)
            zj4 = z[ji][:, None, None, :].expand(J, P, G, -1)
            zp4 = z[pi][None, :, None, :].expand(J, P, G, -1)
            g4 = g[None, None, :, :].expand(J, P, G, -1)
            rj = prep.roof[ji][:, None, :, :].expand(J, P, G, -1)
            rp = prep.roof[pi][None, :, :, :].expand(J, P, G, -1)
            lr = self.net.log_ratio(zj4, zp4, g4, rj, rp).numpy()
            for c, t in near.items():  # and how sharing slows it as on that board
                k = kn.index(t)
                lr[:, :, c] = self.net.log_ratio(zj4[:, :, c], zp4[:, :, c], gk[k][None, None, :].expand(J, P, -1),
                                                 kprep.roof[ji][:, None, k].expand(J, P, -1),
                                                 kprep.roof[pi][None, :, k].expand(J, P, -1)).numpy()
            pair = iso[:, None, :] * np.exp(lr)
            need = prep.memory[ji.numpy()][:, None, None] + prep.memory[pi.numpy()][None, :, None]
            pair[need > MEMORY_HEADROOM * prep.gpu_memory[None, None, :]] = 0.0
        return Prediction(jobs=jn, partners=pn, gpus=tuple(gpus), isolated=iso, pair=pair)

    def nearest_trained(self, gpus: Sequence[str]) -> dict[int, str]:
        """Column -> the trained GPU type nearest to it, for each requested type P1 was not
        trained on (none when what it was trained on is not recorded).

        Why: the head's shortfall and overhead are functions of the GPU's catalog vector, learned
        only over the trained types' range. Off it they extrapolate without bound: the shipped
        Gavel prior (K80, P100, V100) put a ResNet-50 on an H100 at 1/3,000 of its V100 rate,
        where the real board runs it about 3x faster. On an untrained type the job keeps the
        shortfall, overhead and sharing slowdown it has on the nearest trained board (catalog
        vectors, in P1's own normalisation) and takes the new board's roofline kernel time."""
        trained = [g for g in (self.trained_on or {}).get("gpus") or () if _known_type(g)]
        if not trained:
            return {}
        new = {c: g for c, g in enumerate(gpus) if g not in trained}
        if not new:
            return {}
        x = (np.stack([gpu_vector(get_gpu_type(g)) for g in trained]) - self.gpu_mean) / self.gpu_std
        out = {}
        for c, g in new.items():
            v = (gpu_vector(get_gpu_type(g)) - self.gpu_mean) / self.gpu_std
            out[c] = trained[int(np.argmin(((x - v) ** 2).sum(axis=1)))]
        return out

    def state(self) -> dict[str, torch.Tensor]:
        st = {f"net.{k}": v.detach().clone().contiguous() for k, v in self.net.state_dict().items()}
        st["norm.summary_mean"] = torch.from_numpy(self.summary_mean.astype(np.float32))
        st["norm.summary_std"] = torch.from_numpy(self.summary_std.astype(np.float32))
        st["norm.gpu_mean"] = torch.from_numpy(self.gpu_mean.astype(np.float32))
        st["norm.gpu_std"] = torch.from_numpy(self.gpu_std.astype(np.float32))
        return st

    def config_dict(self) -> dict:
        return {"p1": asdict(self.config), "trained_on": self.trained_on}

    @classmethod
    def from_state(cls, config: Mapping, state: Mapping[str, torch.Tensor]) -> P1Model:
        cfg = P1Config(**config["p1"])
        net = make_net(cfg.encoder, cfg.hidden)
        net.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("net.")})
        return cls(
            net=net, config=cfg,
            summary_mean=state["norm.summary_mean"].numpy().astype(np.float64),
            summary_std=state["norm.summary_std"].numpy().astype(np.float64),
            gpu_mean=state["norm.gpu_mean"].numpy().astype(np.float64),
            gpu_std=state["norm.gpu_std"].numpy().astype(np.float64),
            trained_on=dict(config.get("trained_on", {})),
        )


@dataclass(frozen=True)
class Prediction:
    jobs: tuple[str, ...]
    partners: tuple[str, ...]
    gpus: tuple[str, ...]
    isolated: np.ndarray  # [J, G]
    pair: np.ndarray  # [J, P, G]: job j's own throughput next to partner p


def _norm_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    return mean, np.where(std > 1e-6, std, 1.0)


def train_p1(data: MeasuredSet, config: P1Config = P1Config(), *, init: P1Model | None = None,
             log=None) -> P1Model:
    """Fit P1 on every isolated and pair measurement of ``data`` (log-space squared error).

    ``init`` continues from an existing model (fine-tuning) and keeps its normalisation.
    """
    if not data.jobs or data.iso.height == 0:
        raise ValueError("P1 needs at least one job with an isolated measurement to train on")
    if init is not None and (config.encoder, config.hidden) != (init.config.encoder, init.config.hidden):
        raise ValueError(
            f"fine-tuning keeps the architecture: init is {init.config.encoder}/{init.config.hidden}, "
            f"config asks for {config.encoder}/{config.hidden}"
        )
    if config.encoder == MEAN:
        return _train_mean(data, config, init, log)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    if init is None:
        enc = EncodedJobs.build(dict(data.jobs))
        gx = np.stack([gpu_vector(get_gpu_type(g)) for g in data.gpus])
        sm, ss = _norm_stats(enc.summary)
        gm, gs = _norm_stats(gx)
        model = P1Model(P1Net(config.encoder, config.hidden), config, sm, ss, gm, gs)
    else:
        net = P1Net(init.config.encoder, init.config.hidden)
        net.load_state_dict(init.net.state_dict())  # a copy: fine-tuning leaves ``init`` as it was
        model = P1Model(net, config, init.summary_mean, init.summary_std, init.gpu_mean, init.gpu_std,
                        dict(init.trained_on))
    prep = model.prepare(data.jobs, data.gpus)
    idx = {n: i for i, n in enumerate(prep.names)}
    gidx = {g: i for i, g in enumerate(prep.gpus)}
    iso_j = torch.tensor([idx[j] for j in data.iso["job"]], dtype=torch.long)
    iso_g = torch.tensor([gidx[g] for g in data.iso["gpu"]], dtype=torch.long)
    iso_y = torch.tensor(np.log(data.iso["throughput"].to_numpy()), dtype=torch.float32)
    pr = data.pairs
    has_pairs = pr.height > 0
    if has_pairs:
        pj = np.asarray([idx[j] for j in pr["job"]])
        pp = np.asarray([idx[p] for p in pr["partner"]])
        pg = np.asarray([gidx[g] for g in pr["gpu"]])
        py = np.log(pr["throughput"].to_numpy())
    opt = torch.optim.AdamW(model.net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.epochs)
    model.net.train()
    start = time.perf_counter()
    history: list[float] = []
    for epoch in range(config.epochs):
        z, g = model._embed(prep)
        pred = model.net.log_isolated(z[iso_j], g[iso_g], prep.roof[iso_j, iso_g])
        loss = nn.functional.mse_loss(pred, iso_y)
        if has_pairs:
            take = rng.choice(len(py), size=min(config.pair_rows_per_epoch, len(py)), replace=False)
            tj, tp, tg = (torch.from_numpy(a[take]) for a in (pj, pp, pg))
            iso_pred = model.net.log_isolated(z[tj], g[tg], prep.roof[tj, tg])
            lr = model.net.log_ratio(z[tj], z[tp], g[tg], prep.roof[tj, tg], prep.roof[tp, tg])
            ploss = nn.functional.mse_loss(iso_pred + lr, torch.from_numpy(py[take]).float())
            loss = loss + config.pair_weight * ploss
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.net.parameters(), 5.0)
        opt.step()
        sched.step()
        history.append(float(loss.detach()))
        if log is not None and (epoch + 1) % max(1, config.epochs // 5) == 0:
            log(f"P1[{config.encoder}] epoch {epoch + 1}/{config.epochs} loss {history[-1]:.4f}")
    model.net.eval()
    model.trained_on = {
        "jobs": len(data.jobs), "families": list(data.families), "gpus": list(data.gpus),
        "isolated_rows": data.iso.height, "pair_rows": data.pairs.height,
        "final_loss": history[-1], "first_loss": history[0],
        "seconds": round(time.perf_counter() - start, 2),
        **({"init": init.trained_on} if init is not None else {}),
    }
    return model


def _train_mean(data: MeasuredSet, config: P1Config, init: P1Model | None, log) -> P1Model:
    """A :data:`MEAN` P1: one P1 per encoder, each trained exactly as a P1 of that encoder alone
    (same data, seed and settings; from ``init``'s member of that encoder when fine-tuning), then
    put side by side. So its prediction is the mean of what those P1s would predict."""
    start = time.perf_counter()
    members = []
    for k, enc in enumerate(ENCODERS):
        sub = None
        if init is not None:
            sub = P1Model(init.net.members[k], replace(init.config, encoder=enc), init.summary_mean,
                          init.summary_std, init.gpu_mean, init.gpu_std, dict(init.trained_on))
        members.append(train_p1(data, replace(config, encoder=enc), init=sub, log=log))
    net = P1MeanNet(config.hidden)
    for slot, trained in zip(net.members, members):
        slot.load_state_dict(trained.net.state_dict())
    net.eval()
    first = members[0]
    model = P1Model(net, config, first.summary_mean, first.summary_std, first.gpu_mean, first.gpu_std)
    model.trained_on = {
        **{k: v for k, v in first.trained_on.items() if k not in ("final_loss", "first_loss", "seconds", "init")},
        "final_loss": float(np.mean([m.trained_on["final_loss"] for m in members])),
        "first_loss": float(np.mean([m.trained_on["first_loss"] for m in members])),
        "members": {enc: {"final_loss": m.trained_on["final_loss"], "first_loss": m.trained_on["first_loss"]}
                    for enc, m in zip(ENCODERS, members)},
        "seconds": round(time.perf_counter() - start, 2),
        **({"init": init.trained_on} if init is not None else {}),
    }
    return model


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    """Mean absolute percentage error as a fraction, over entries where the truth is known and > 0."""
    m = np.isfinite(true) & (true > 0) & np.isfinite(pred)
    if not m.any():
        return math.nan
    return float(np.mean(np.abs(pred[m] - true[m]) / true[m]))

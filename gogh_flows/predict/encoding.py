"""Numbers the predictors read: a job as a short sequence of layer tokens, a GPU type as a vector.

Why a *short* sequence: CycleGAN's training step is 564 layer calls and ResNet-50's 171.
Most of them (norms, activations, dropout) carry no FLOPs and only move bytes, so they are
folded into the layer they follow, and then neighbours are merged until at most
``MAX_TOKENS`` remain. The recurrent and attention encoders then cost milliseconds per
epoch on two cores, and no information a roofline would use is lost (FLOPs, parameters
and bytes are summed, the op-kind mix is kept as fractions).

Why an analytic prior per (job, GPU type): the throughput of a model nobody has measured
is mostly ``1 / step time``, and a roofline gives a first estimate of the kernel time from
the catalog's FLOP/s and bandwidth. The networks learn what the roofline gets wrong (host
overheads, input pipelines, poor kernels) instead of relearning division.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gogh_flows.catalog import GpuType
from gogh_flows.truth.synthetic import LAUNCH_S, MEMORY_HEADROOM, step_profile
from gogh_flows.workloads.features import OP_KINDS, WorkloadFeatures

MAX_TOKENS = 48
_CARRIES_WORK = frozenset({"conv", "conv_transpose", "linear", "matmul", "embedding", "rnn", "attention"})

#: per token: op-kind fractions, then log1p of flops, params, activation bytes, input bytes,
#: then log of how many layer calls the token stands for.
TOKEN_DIM = len(OP_KINDS) + 5
SUMMARY_NAMES = (
    "log_step_flops", "log_step_bytes", "log_params", "log_memory", "log_batch", "log_layers",
    "log_activation_bytes", *(f"flop_share_{k}" for k in OP_KINDS),
)
SUMMARY_DIM = len(SUMMARY_NAMES)
GPU_NAMES = ("log_fp32_tflops", "log_fp16_tflops", "log_memory_gb", "log_bandwidth", "log_tdp")
GPU_DIM = len(GPU_NAMES)
ROOFLINE_NAMES = ("log_kernel_s", "log_launch_s", "compute_share", "busy", "log_memory_frac")
ROOFLINE_DIM = len(ROOFLINE_NAMES)


def layer_tokens(w: WorkloadFeatures, max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """``[T, TOKEN_DIM]`` tokens, ``1 <= T <= max_tokens``, in execution order."""
    k = len(OP_KINDS)
    groups: list[np.ndarray] = []  # raw sums: kind counts, flops, params, act, inp, calls
    for layer in w.layers:
        row = np.zeros(k + 5)
        row[OP_KINDS.index(layer.op)] = 1.0
        row[k:] = (layer.flops, layer.params, layer.activation_bytes, layer.input_bytes, 1.0)
        if groups and (layer.op not in _CARRIES_WORK or layer.flops == 0):
            groups[-1] += row
        else:
            groups.append(row)
    if not groups:
        groups = [np.zeros(k + 5)]
        groups[0][k + 4] = 1.0
    raw = np.stack(groups)
    while len(raw) > max_tokens:  # merge neighbours pairwise until short enough
        if len(raw) % 2:
            raw = np.vstack([raw, np.zeros((1, raw.shape[1]))])
        raw = raw[0::2] + raw[1::2]
        raw = raw[raw[:, k + 4] > 0]
    out = np.empty((len(raw), TOKEN_DIM), dtype=np.float32)
    calls = raw[:, k + 4:k + 5]
    out[:, :k] = raw[:, :k] / np.maximum(calls, 1.0)
    out[:, k:k + 4] = np.log1p(raw[:, k:k + 4]) / 20.0
    out[:, k + 4] = np.log(np.maximum(calls[:, 0], 1.0))
    return out


def job_summary(w: WorkloadFeatures) -> np.ndarray:
    """Whole-step aggregates (the feed-forward encoder's input; a skip path for the others)."""
    flops_by_kind = np.zeros(len(OP_KINDS))
    for layer in w.layers:
        flops_by_kind[OP_KINDS.index(layer.op)] += layer.flops
    total = flops_by_kind.sum()
    shares = flops_by_kind / total if total > 0 else flops_by_kind
    head = [
        math.log1p(w.step_flops), math.log1p(w.step_bytes_moved), math.log1p(w.params),
        math.log1p(w.memory_bytes_estimate), math.log(w.batch_size), math.log(max(len(w.layers), 1)),
        math.log1p(w.activation_bytes),
    ]
    return np.asarray([*head, *shares], dtype=np.float32)


def gpu_vector(g: GpuType) -> np.ndarray:
    return np.log(np.asarray(
        [g.fp32_tflops, max(g.fp16_tflops, g.fp32_tflops), g.memory_gb, g.memory_bandwidth_gbs, g.tdp_w],
        dtype=np.float32,
    ))


def roofline(w: WorkloadFeatures, g: GpuType) -> np.ndarray:
    """Analytic features of one job on one GPU type (no host overhead, no noise)."""
    p = step_profile(w, g)
    kernel_s = max(p.busy * p.step_s, 1e-9)
    launch_s = w.passes * LAUNCH_S * max(len(w.layers), 1)
    return np.asarray([
        math.log(kernel_s), math.log(launch_s), p.compute_share, p.busy,
        math.log(max(p.memory_bytes, 1.0) / g.memory_bytes),
    ], dtype=np.float32)


def fits(w: WorkloadFeatures, g: GpuType, partner: WorkloadFeatures | None = None) -> bool:
    """Same memory rule as the synthetic fleet: the footprint(s) within 90% of the board."""
    need = w.memory_bytes_estimate + (partner.memory_bytes_estimate if partner is not None else 0.0)
    return need <= MEMORY_HEADROOM * g.memory_bytes


@dataclass(frozen=True)
class EncodedJobs:
    """Every job of a set, padded for batched encoders."""

    names: tuple[str, ...]
    tokens: np.ndarray  # [J, T, TOKEN_DIM], zero-padded
    lengths: np.ndarray  # [J]
    summary: np.ndarray  # [J, SUMMARY_DIM]

    @classmethod
    def build(cls, jobs: dict[str, WorkloadFeatures]) -> EncodedJobs:
        names = tuple(jobs)
        toks = [layer_tokens(jobs[n]) for n in names]
        t = max(len(x) for x in toks)
        pad = np.zeros((len(names), t, TOKEN_DIM), dtype=np.float32)
        for i, x in enumerate(toks):
            pad[i, : len(x)] = x
        return cls(
            names=names, tokens=pad, lengths=np.asarray([len(x) for x in toks], dtype=np.int64),
            summary=np.stack([job_summary(jobs[n]) for n in names]),
        )

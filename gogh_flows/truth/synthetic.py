"""The built-in synthetic fleet: throughput truth for any GPU type and any model.

Measured data cover three old GPU types and 26 job types. To place a ResNet-50
at batch 48 on an L4, or a user's own model on an H100, we need a source that
covers everything, costs nothing, and behaves like real hardware in the ways
that matter for placement: newer GPUs are faster but not uniformly so, small
jobs leave a GPU idle (so sharing pays), big ones saturate it (so sharing
hurts), and models that do not fit in memory do not run. It is the embedded
default of ``make demo`` and of most tests.

Model (documented in docs/synthetic-fleet.md):

* **Roofline per layer.** Each layer's step time on a GPU type is
  ``max(FLOPs / (peak * eff(op)), bytes / (bandwidth * 0.75))``; training
  counts forward + backward as 3x forward. ``eff(op)`` is the fraction of peak
  that kernel class typically reaches (convolutions and GEMMs high, recurrent
  cells lower, element-wise ops bandwidth-bound). Kepler and Pascal kernels get
  a lower efficiency than Volta and newer (older cuDNN/cuBLAS support).
* **Host overhead.** Each step pays a fixed host-side cost plus a kernel-launch
  cost per layer; the GPU is busy for the kernel time only. The busy fraction
  ``b`` is what a partner can fill.
* **Contention.** Two jobs sharing a GPU slow each other by
  ``r_j = 1 / (1 + b_k * i_jk)``, where ``i_jk`` in [0.5, 1] grows with how
  much they stress the same resource (compute or memory). Combined normalised
  throughput ``r_j + r_k`` therefore lies in [1, 2], the range Gavel measured
  for most pairs.
* **Memory.** A job (or pair) whose estimated footprint exceeds 90% of the
  GPU's memory gets throughput 0.
* **Multi-GPU.** Data-parallel gangs add a ring all-reduce of the gradients over
  the GPU type's interconnect, half hidden behind the backward pass; the table
  holds the gang's aggregate steps/s, as Gavel's does.
* **Activity (power).** Fitted to measured boards where one was measured
  (``gogh_flows.power_model``: the H100 today), spec-based elsewhere.
* **Noise.** Seeded multiplicative log-normal noise per (job, GPU type) entry,
  keyed by a stable hash so adding a job or a GPU type never changes others.
* **Board variants.** A site's boards need not be the ones the catalog entry describes:
  PCIe V100s and 40 GB A100s map to the same type names as the SXM boards. ``boards``
  runs a type at a variant's datasheet figures (:data:`BOARD_VARIANTS`) while everything
  that places and predicts still sees the catalog's: a fleet the predictors were not
  trained on, as every real site is to a shipped prior.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from gogh_flows import catalog
from gogh_flows.catalog import GpuType, get_gpu_type
from gogh_flows.power_model import activity_inputs, fitted_activity, spec_activity
from gogh_flows.truth.table import ThroughputTable
from gogh_flows.workloads import (
    DEFAULT_BATCH_SIZES,
    FAMILIES,
    WorkloadFeatures,
    job_type_name,
    zoo_features,
)

# Fraction of peak FLOP/s a kernel class typically reaches on a recent GPU.
OP_EFFICIENCY = {
    "conv": 0.55, "conv_transpose": 0.45, "linear": 0.6, "matmul": 0.5, "attention": 0.45,
    "rnn": 0.3, "embedding": 0.05, "norm": 0.1, "activation": 0.1, "pool": 0.1,
    "dropout": 0.1, "other": 0.2,
}
MATMUL_OPS = frozenset({"conv", "conv_transpose", "linear", "matmul", "attention", "rnn"})
# Older architectures get less of their peak from the same frameworks (assumption).
ARCH_EFFICIENCY = {"Kepler": 0.7, "Pascal": 0.9}
BANDWIDTH_EFFICIENCY = 0.75
HOST_OVERHEAD_S = 1.5e-3  # per step: data loading hand-off, Python, optimiser launch
LAUNCH_S = 6e-6  # per kernel
MEMORY_HEADROOM = 0.9  # CUDA context, allocator fragmentation

# GPU-to-GPU bandwidth one way, GB/s, for data-parallel gangs:
#   k80:  PCIe 3.0 x16 via the board's PLX switch, ~12 GB/s achievable
#   p100: NVLink 1, 160 GB/s bidirectional per GPU (Tesla P100 SXM2 datasheet) -> 80
#   v100: NVLink 2, 300 GB/s bidirectional (Tesla V100 datasheet) -> 150
#   t4, l4: PCIe (T4: Gen3 x16 32 GB/s; L4: Gen4 x16 64 GB/s bidirectional) -> 16, 32
#   a10:  PCIe Gen4 x16, 64 GB/s bidirectional (A10 datasheet) -> 32
#   a100: NVLink 3, 600 GB/s bidirectional (A100 datasheet) -> 300
#   h100: NVLink 4, 900 GB/s bidirectional (H100 SXM datasheet) -> 450
INTERCONNECT_GBS = {
    "k80": 12.0, "p100": 80.0, "v100": 150.0, "t4": 16.0, "a10": 32.0, "l4": 32.0,
    "a100": 300.0, "h100": 450.0,
}
DEFAULT_INTERCONNECT_GBS = 16.0  # PCIe Gen3 x16 for types not listed

#: Boards that the catalog maps to one type name but that run at other figures (the catalog's
#: own comments name them): variant -> (catalog type, the figures that differ). Power keeps the
#: catalog type's TDP and idle figures (the emulator draws by type name); the activity (the share
#: of that range a job draws) follows the variant's step.
#:   v100-pcie:      Tesla V100 PCIe 16GB, 14 TFLOPS FP32, 112 TFLOPS tensor, 900 GB/s (Tesla V100 datasheet)
#:   a100-pcie-40gb: A100 PCIe 40GB, 19.5 TFLOPS FP32, 312 TFLOPS tensor, 40 GB HBM2, 1,555 GB/s
#:                   (A100 datasheet)
BOARD_VARIANTS: dict[str, tuple[str, dict[str, float]]] = {
    "v100-pcie": ("v100", {"fp32_tflops": 14.0, "fp16_tflops": 112.0, "memory_bandwidth_gbs": 900.0}),
    "a100-pcie-40gb": ("a100", {"fp32_tflops": 19.5, "fp16_tflops": 312.0, "memory_gb": 40.0,
                                "memory_bandwidth_gbs": 1555.0}),
}


def board(gpu_type: str, variant: str | None = None) -> GpuType:
    """The figures a ``gpu_type`` board runs at: the catalog's, or ``variant``'s (same name)."""
    gpu = get_gpu_type(gpu_type)
    if variant is None:
        return gpu
    if variant not in BOARD_VARIANTS:
        raise ValueError(f"unknown board variant {variant!r}; known: "
                         + ", ".join(f"{v} (type {t!r})" for v, (t, _) in sorted(BOARD_VARIANTS.items())))
    of, figures = BOARD_VARIANTS[variant]
    if of != gpu.name:
        raise ValueError(f"board variant {variant!r} is a board of type {of!r}, not {gpu.name!r}: map it "
                         f"under {of!r}")
    return dataclasses.replace(gpu, display_name=f"{gpu.display_name} ({variant})", **figures)


def check_boards(gpu_types: Iterable[str], boards: Mapping[str, str]) -> None:
    """Refuse a ``boards`` map that names a type the fleet lacks, an unknown variant, or a
    variant of another type, saying which."""
    gpu_types = list(gpu_types)
    for t, variant in boards.items():
        if t not in gpu_types:
            raise ValueError(f"boards names {t!r}, which this fleet lacks ({', '.join(gpu_types)}); "
                             "name a type of the fleet")
        board(t, variant)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """How one job uses one GPU type, alone."""

    step_s: float  # seconds per training/inference step
    busy: float  # fraction of the step the GPU executes kernels
    compute_share: float  # fraction of kernel time that is compute-bound
    activity: float  # fraction of the dynamic power range drawn
    memory_bytes: float
    fits: bool
    gradient_bytes: float
    backward_s: float

    @property
    def throughput(self) -> float:
        return 1.0 / self.step_s if self.fits else 0.0


def step_profile(features: WorkloadFeatures, gpu: GpuType, precision: str = "fp32") -> StepProfile:
    """Roofline estimate of one step of ``features`` on ``gpu`` (no noise)."""
    passes = 3.0 if features.kind == "training" else 1.0
    arch = ARCH_EFFICIENCY.get(gpu.architecture, 1.0)
    bw = gpu.memory_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
    byte_scale = 0.5 if precision == "mixed" else 1.0
    compute_s = memory_s = 0.0
    for layer in features.layers:
        peak = gpu.fp32_tflops
        if precision == "mixed" and layer.op in MATMUL_OPS:
            peak = max(gpu.fp16_tflops, gpu.fp32_tflops)
        flops_t = passes * layer.flops / (peak * 1e12 * OP_EFFICIENCY.get(layer.op, 0.2) * arch)
        moved = passes * byte_scale * (layer.input_bytes + layer.activation_bytes + 4 * layer.params)
        mem_t = moved / bw
        if flops_t >= mem_t:
            compute_s += flops_t
        else:
            memory_s += mem_t
    if features.kind == "training":  # optimiser update: read w, g, m, v; write w, m, v
        memory_s += 7 * 4 * features.params / bw
    kernel_s = compute_s + memory_s
    launch_s = passes * LAUNCH_S * len(features.layers)
    step_s = max(kernel_s, launch_s) + HOST_OVERHEAD_S
    busy = kernel_s / step_s
    compute_share = compute_s / kernel_s if kernel_s > 0 else 0.0
    activity = fitted_activity(gpu.name, precision, activity_inputs(features, kernel_s, step_s))
    if activity is None:  # a GPU type (or precision) no board was measured on
        activity = spec_activity(busy, compute_share)
    mem = features.memory_bytes_estimate
    return StepProfile(
        step_s=step_s, busy=busy, compute_share=compute_share, activity=activity,
        memory_bytes=mem, fits=mem <= MEMORY_HEADROOM * gpu.memory_bytes,
        gradient_bytes=4.0 * features.params,
        backward_s=kernel_s * (2.0 / 3.0 if features.kind == "training" else 0.0),
    )


def gang_step_s(profile: StepProfile, gpu: GpuType, n: int) -> float:
    """Seconds per lockstep step of an ``n``-GPU data-parallel gang (ring all-reduce)."""
    if n == 1:
        return profile.step_s
    link = INTERCONNECT_GBS.get(gpu.name, DEFAULT_INTERCONNECT_GBS) * 1e9 * 0.7
    comm = 2 * (n - 1) / n * profile.gradient_bytes / link
    return profile.step_s + max(0.0, comm - 0.5 * profile.backward_s)


def pair_slowdowns(a: StepProfile, b: StepProfile) -> tuple[float, float]:
    """(r_a, r_b): each job's shared/isolated throughput ratio; r_a + r_b in [1, 2]."""
    overlap = a.compute_share * b.compute_share + (1 - a.compute_share) * (1 - b.compute_share)
    interference = 0.5 + 0.5 * overlap
    return 1.0 / (1.0 + b.busy * interference), 1.0 / (1.0 + a.busy * interference)


def _noise(seed: int, sigma: float, *key: object) -> float:
    if sigma <= 0:
        return 1.0
    h = zlib.crc32("|".join(map(str, key)).encode())
    return float(math.exp(np.random.default_rng([seed, h]).normal(0.0, sigma)))


def default_jobs() -> dict[str, WorkloadFeatures]:
    """Every zoo family at each of Gavel's batch sizes, keyed by Gavel's job-type name."""
    return {
        job_type_name(f, bs): zoo_features(f, bs) for f in FAMILIES for bs in DEFAULT_BATCH_SIZES[f]
    }


@dataclass(frozen=True)
class SyntheticFleet:
    """A seeded synthetic ground truth over GPU types and workloads.

    ``jobs`` maps a job-type name to its features: zoo models at any batch size
    (:func:`zoo_features`) or a user's model (:func:`extract_features`). ``boards`` maps a GPU
    type to the board variant it runs as (:data:`BOARD_VARIANTS`); types not named run at the
    catalog's figures.
    """

    gpu_types: tuple[str, ...] = field(default_factory=lambda: tuple(g.name for g in catalog.gpu_types()))
    jobs: Mapping[str, WorkloadFeatures] = field(default_factory=default_jobs)
    scale_factors: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    noise: float = 0.05
    precision: str = "fp32"
    boards: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.gpu_types:
            raise ValueError("gpu_types must name at least one GPU type")
        for t in self.gpu_types:
            get_gpu_type(t)  # unknown -> UnknownGpuTypeError naming it
        if not self.jobs:
            raise ValueError("jobs must hold at least one workload")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be a log-normal sigma in [0, 1), got {self.noise!r}")
        if self.precision not in ("fp32", "mixed"):
            raise ValueError(f"precision must be 'fp32' or 'mixed', got {self.precision!r}")
        bad = [s for s in self.scale_factors if s not in (1, 2, 4, 8)]
        if bad or 1 not in self.scale_factors:
            raise ValueError(f"scale_factors must include 1 and be among 1, 2, 4, 8; got {self.scale_factors}")
        check_boards(self.gpu_types, self.boards)

    def gpu(self, gpu_type: str) -> GpuType:
        """The figures this fleet's ``gpu_type`` boards run at."""
        return board(gpu_type, self.boards.get(gpu_type))

    @property
    def source(self) -> str:
        site = "".join(f", {t}={v}" for t, v in sorted(self.boards.items()))
        return f"synthetic(seed={self.seed}{site})"

    def profile(self, job_type: str, gpu_type: str) -> StepProfile:
        return step_profile(self.jobs[job_type], self.gpu(gpu_type), self.precision)

    def table(self) -> ThroughputTable:
        rows: list[dict] = []
        names = sorted(self.jobs)
        for t in self.gpu_types:
            gpu = self.gpu(t)
            profiles = {j: step_profile(self.jobs[j], gpu, self.precision) for j in names}
            iso1: dict[str, float] = {}
            for j in names:
                p = profiles[j]
                for n in self.scale_factors:
                    tput = 0.0
                    if p.fits:
                        tput = n / gang_step_s(p, gpu, n) * _noise(self.seed, self.noise, j, t, n)
                    if n == 1:
                        iso1[j] = tput
                    rows.append({"job_type": j, "gpu_type": t, "scale_factor": n,
                                 "throughput": tput, "activity": p.activity})
            for i, a in enumerate(names):
                for b in names[i:]:
                    ta, tb = self._pair(profiles[a], profiles[b], iso1[a], iso1[b], gpu, a, b)
                    rows.append({"job_type": a, "gpu_type": t, "scale_factor": 1, "partner": b,
                                 "throughput": ta, "partner_throughput": tb})
        return ThroughputTable.from_rows(rows, source=self.source, fleet={
            "seed": self.seed, "noise": self.noise, "precision": self.precision, "boards": dict(self.boards)})

    def rows_for(self, job_type: str) -> list[dict]:
        """The table rows that involve ``job_type``: alone at every scale factor, and next to
        every job of the fleet (itself included), on every GPU type; what :meth:`table` gives
        for it, without computing the pairs of the other jobs."""
        if job_type not in self.jobs:
            raise KeyError(f"{job_type!r} is not among this fleet's jobs")
        rows: list[dict] = []
        for t in self.gpu_types:
            gpu = self.gpu(t)
            profiles = {j: step_profile(self.jobs[j], gpu, self.precision) for j in self.jobs}
            iso1 = {j: (1 / gang_step_s(p, gpu, 1) * _noise(self.seed, self.noise, j, t, 1) if p.fits else 0.0)
                    for j, p in profiles.items()}
            p = profiles[job_type]
            for n in self.scale_factors:
                tput = n / gang_step_s(p, gpu, n) * _noise(self.seed, self.noise, job_type, t, n) if p.fits else 0.0
                rows.append({"job_type": job_type, "gpu_type": t, "scale_factor": n, "throughput": tput,
                             "activity": p.activity})
            for other in sorted(self.jobs):
                a, b = sorted((job_type, other))
                ta, tb = self._pair(profiles[a], profiles[b], iso1[a], iso1[b], gpu, a, b)
                rows.append({"job_type": a, "gpu_type": t, "scale_factor": 1, "partner": b,
                             "throughput": ta, "partner_throughput": tb})
        return rows

    def _pair(self, pa: StepProfile, pb: StepProfile, ia: float, ib: float, gpu: GpuType,
              a: str, b: str) -> tuple[float, float]:
        if ia <= 0 or ib <= 0 or pa.memory_bytes + pb.memory_bytes > MEMORY_HEADROOM * gpu.memory_bytes:
            return 0.0, 0.0
        ra, rb = pair_slowdowns(pa, pb)
        sigma = self.noise / 2
        ra = min(1.0, ra * _noise(self.seed, sigma, a, b, gpu.name, "a"))
        rb = min(1.0, rb * _noise(self.seed, sigma, a, b, gpu.name, "b"))
        if a == b:  # two copies of one job are interchangeable
            ra = rb = min(ra, rb)
        if ra + rb < 1.0:  # keep the combined normalised throughput within [1, 2]
            s = 1.0 / (ra + rb)
            ra, rb = min(1.0, ra * s), min(1.0, rb * s)
        return ra * ia, rb * ib


@lru_cache(maxsize=8)
def _cached_table(gpus: tuple[str, ...], seed: int, noise: float,
                  boards: tuple[tuple[str, str], ...] = ()) -> ThroughputTable:
    return SyntheticFleet(gpu_types=gpus, seed=seed, noise=noise, boards=dict(boards)).table()


def synthetic_table(
    gpu_types: Iterable[str] | None = None, *, seed: int = 0, noise: float = 0.05,
    boards: Mapping[str, str] | None = None,
) -> ThroughputTable:
    """The synthetic truth for the zoo at Gavel's batch sizes (cached per arguments)."""
    gpus = tuple(gpu_types) if gpu_types is not None else tuple(g.name for g in catalog.gpu_types())
    return _cached_table(gpus, seed, noise, tuple(sorted((boards or {}).items())))


__all__ = [
    "BOARD_VARIANTS", "INTERCONNECT_GBS", "OP_EFFICIENCY", "StepProfile", "SyntheticFleet", "board", "check_boards",
    "default_jobs", "gang_step_s", "pair_slowdowns", "step_profile", "synthetic_table",
]

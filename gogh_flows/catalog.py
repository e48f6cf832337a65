"""Catalog of GPU types, with figures taken from NVIDIA's public datasheets.

The synthetic fleet's roofline model (compute and memory-bandwidth bound
throughputs, memory fit) and the energy model (idle power and TDP) both read
their hardware figures from here. Keeping those figures in one place, each
next to the datasheet it comes from, means the models are compared on the same
hardware numbers and anyone can check them.

Real devices are mapped to entries by their NVML device name
(:func:`from_nvml_name`), so a fleet discovered with ``nvidia-ml-py`` lands on
the same entries as a synthetic one. GPU types the catalog does not know can be
added at run time with :func:`register_gpu_type`; the builtin entries stay
read-only in :data:`CATALOG`.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CATALOG",
    "GpuType",
    "UnknownGpuTypeError",
    "from_nvml_name",
    "get_gpu_type",
    "gpu_types",
    "register_gpu_type",
]

_NUMERIC_FIELDS = (
    "fp32_tflops",
    "fp16_tflops",
    "memory_gb",
    "memory_bandwidth_gbs",
    "tdp_w",
    "idle_w",
)


def _normalise(device_name: str) -> str:
    """Lower-case, '-' and '_' as spaces, single spaces: 'Tesla V100-SXM2' -> 'tesla v100 sxm2'."""
    return " ".join(re.sub(r"[-_]", " ", device_name.lower()).split())


@dataclass(frozen=True, slots=True)
class GpuType:
    """One GPU type's peak figures, as the models need them.

    Units: TFLOP/s for compute, GB (1 GB = 1e9 bytes, as marketed; slightly
    below the real GiB capacity of most boards, so memory fits err on the safe
    side) for memory, GB/s for bandwidth, watts for power.

    ``fp16_tflops`` is the dense (no sparsity) FP16 rate on tensor cores where
    the GPU has them, plain FP16 otherwise. ``idle_w`` is an estimate:
    datasheets do not publish idle power. ``has_energy_counter`` says whether
    NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, Volta
    and newer) can be used instead of integrating sampled power.
    ``nvml_patterns`` are lower-case substrings of NVML device names that
    identify this type (see :func:`from_nvml_name` for how they are matched).
    ``power_limit_range_w`` is the (min, max) power limit in watts NVML accepts
    for the board (``nvmlDeviceGetPowerManagementLimitConstraints``, what
    ``nvidia-smi -q -d POWER`` prints as Min/Max Power Limit); ``None`` where
    unknown (types registered without it). See :mod:`gogh_flows.power_limits`.
    """

    name: str
    display_name: str
    architecture: str
    fp32_tflops: float
    fp16_tflops: float
    memory_gb: float
    memory_bandwidth_gbs: float
    tdp_w: float
    idle_w: float
    has_energy_counter: bool
    nvml_patterns: tuple[str, ...] = ()
    power_limit_range_w: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        # Bad figures would silently skew every throughput and energy estimate,
        # so they are refused here, naming the field and the value.
        if not isinstance(self.name, str) or not self.name or self.name != self.name.lower() or any(
            c.isspace() for c in self.name
        ):
            raise ValueError(f"GpuType.name must be a non-empty lower-case key without spaces, got {self.name!r}")
        for field_name in _NUMERIC_FIELDS:
            value = getattr(self, field_name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"GpuType {self.name!r}: {field_name} must be a finite number > 0, got {value!r}")
        if self.idle_w >= self.tdp_w:
            raise ValueError(
                f"GpuType {self.name!r}: idle_w must be below tdp_w, got idle_w={self.idle_w!r} "
                f"with tdp_w={self.tdp_w!r}"
            )
        patterns = (self.nvml_patterns,) if isinstance(self.nvml_patterns, str) else tuple(self.nvml_patterns)
        for pattern in patterns:
            if not isinstance(pattern, str) or not _normalise(pattern):
                raise ValueError(f"GpuType {self.name!r}: nvml_patterns must be non-empty strings, got {pattern!r}")
        object.__setattr__(self, "nvml_patterns", patterns)
        if self.power_limit_range_w is not None:
            lo_hi = tuple(self.power_limit_range_w)
            if len(lo_hi) != 2 or any(
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0
                for v in lo_hi
            ) or not lo_hi[0] < lo_hi[1]:
                raise ValueError(
                    f"GpuType {self.name!r}: power_limit_range_w must be (min, max) watts with "
                    f"0 < min < max, got {self.power_limit_range_w!r}"
                )
            object.__setattr__(self, "power_limit_range_w", (float(lo_hi[0]), float(lo_hi[1])))

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (``memory_gb`` * 1e9)."""
        return int(round(self.memory_gb * 1e9))

    @property
    def dynamic_range_w(self) -> float:
        """Power between idle and TDP, the part a job's activity scales."""
        return self.tdp_w - self.idle_w


class UnknownGpuTypeError(KeyError, ValueError):
    """A GPU type name or NVML device name the catalog does not know.

    A ``KeyError`` because it is a failed lookup, a ``ValueError`` because the
    name usually comes from user input or configuration; callers may catch
    either.
    """

    def __str__(self) -> str:
        # KeyError's __str__ repr-quotes its message; print it as written.
        return str(self.args[0]) if self.args else ""


# Idle power: no NVIDIA datasheet publishes an idle figure. The idle_w values
# below are estimates from commonly reported nvidia-smi readings of idle,
# powered-on boards (persistence mode on, no processes).
#
# Power-limit ranges (power_limit_range_w): datasheets give the TDP, not the
# range a limit can be set in. The figures below are the Min/Max Power Limit
# that NVML reports (nvidia-smi -q -d POWER) for the board each entry
# describes: read on a real board for the H100 SXM (200-700 W, see
# ../shared/data/h100/README.md) and the A40 (100-300 W, the range of Zeus's
# A40 trace, ../shared/data/zeus); for the others, the ranges commonly seen in
# published nvidia-smi -q outputs, not re-checked here against a board or a
# primary source: V100 SXM2 (150-300), T4 (60-70), A10 (100-150), L4 (40-72),
# A100 SXM4 (100-400), K80 (100-175 per die), P100 SXM2 (150-300). PCIe variants mapped to the same entry have other
# ranges (V100 and P100 PCIe: 100-250 and 125-250 W, as in Zeus's traces).
_BUILTIN: tuple[GpuType, ...] = (
    # Tesla K80 datasheet (board with two GK210 dies): 8.73 TFLOPS FP32 with GPU
    # Boost, 24 GB GDDR5, 480 GB/s, 300 W. This entry is ONE GK210 die, i.e.
    # HALF a board, as Gavel and AWS p2.xlarge count a "K80": every figure is
    # the board figure halved (4.365 TFLOPS, 12 GB, 240 GB/s, 150 W). Kepler
    # has no fast FP16, so fp16 == fp32. Idle: ~50 W per idle board reported
    # by nvidia-smi, so ~25 W per die (estimate).
    GpuType(
        name="k80",
        display_name="NVIDIA Tesla K80 (one GK210 die)",
        architecture="Kepler",
        fp32_tflops=4.365,
        fp16_tflops=4.365,
        memory_gb=12,
        memory_bandwidth_gbs=240,
        tdp_w=150,
        idle_w=25,
        has_energy_counter=False,
        nvml_patterns=("k80",),
        power_limit_range_w=(100, 175),
    ),
    # Tesla P100 datasheet, SXM2 16GB: 10.6 TFLOPS FP32, 21.2 TFLOPS FP16,
    # 16 GB CoWoS HBM2, 732 GB/s, 300 W. PCIe boards (9.3 / 18.7 TFLOPS, 250 W)
    # also map here. Idle ~30 W (estimate).
    GpuType(
        name="p100",
        display_name="NVIDIA Tesla P100 SXM2 16GB",
        architecture="Pascal",
        fp32_tflops=10.6,
        fp16_tflops=21.2,
        memory_gb=16,
        memory_bandwidth_gbs=732,
        tdp_w=300,
        idle_w=30,
        has_energy_counter=False,
        nvml_patterns=("p100",),
        power_limit_range_w=(150, 300),
    ),
    # Tesla V100 datasheet, SXM2: 15.7 TFLOPS FP32, 125 TFLOPS tensor (FP16),
    # 16 or 32 GB HBM2, 900 GB/s, 300 W. 16 GB as in Gavel's testbed; PCIe and
    # V100S boards also map here. Idle ~40 W (estimate).
    GpuType(
        name="v100",
        display_name="NVIDIA Tesla V100 SXM2 16GB",
        architecture="Volta",
        fp32_tflops=15.7,
        fp16_tflops=125,
        memory_gb=16,
        memory_bandwidth_gbs=900,
        tdp_w=300,
        idle_w=40,
        has_energy_counter=True,
        nvml_patterns=("v100",),
        power_limit_range_w=(150, 300),
    ),
    # NVIDIA T4 Tensor Core GPU datasheet: 8.1 TFLOPS FP32, 65 TFLOPS mixed
    # precision (FP16/FP32) tensor, 16 GB GDDR6, 320+ GB/s, 70 W.
    # Idle ~10 W (estimate).
    GpuType(
        name="t4",
        display_name="NVIDIA T4 16GB",
        architecture="Turing",
        fp32_tflops=8.1,
        fp16_tflops=65,
        memory_gb=16,
        memory_bandwidth_gbs=320,
        tdp_w=70,
        idle_w=10,
        has_energy_counter=True,
        nvml_patterns=("t4",),
        power_limit_range_w=(60, 70),
    ),
    # NVIDIA A10 Tensor Core GPU datasheet: 31.2 TFLOPS FP32, 125 TFLOPS
    # FP16 tensor dense (250 with sparsity), 24 GB GDDR6, 600 GB/s, 150 W.
    # AWS's A10G also maps here. Idle ~20 W (estimate).
    GpuType(
        name="a10",
        display_name="NVIDIA A10 24GB",
        architecture="Ampere",
        fp32_tflops=31.2,
        fp16_tflops=125,
        memory_gb=24,
        memory_bandwidth_gbs=600,
        tdp_w=150,
        idle_w=20,
        has_energy_counter=True,
        nvml_patterns=("a10",),
        power_limit_range_w=(100, 150),
    ),
    # NVIDIA L4 Tensor Core GPU datasheet: 30.3 TFLOPS FP32, 242 TFLOPS FP16
    # tensor with sparsity, so 121 dense; 24 GB GDDR6, 300 GB/s, 72 W.
    # Idle ~16 W (estimate).
    GpuType(
        name="l4",
        display_name="NVIDIA L4 24GB",
        architecture="Ada Lovelace",
        fp32_tflops=30.3,
        fp16_tflops=121,
        memory_gb=24,
        memory_bandwidth_gbs=300,
        tdp_w=72,
        idle_w=16,
        has_energy_counter=True,
        nvml_patterns=("l4",),
        power_limit_range_w=(40, 72),
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB: 19.5 TFLOPS FP32,
    # 312 TFLOPS FP16 tensor dense, 80 GB HBM2e, 2,039 GB/s, 400 W. The 40GB
    # and PCIe boards (same compute, 40 GB / 1,555 GB/s; PCIe 250-300 W) also
    # map to this entry. Idle ~55 W (estimate).
    GpuType(
        name="a100",
        display_name="NVIDIA A100 SXM4 80GB",
        architecture="Ampere",
        fp32_tflops=19.5,
        fp16_tflops=312,
        memory_gb=80,
        memory_bandwidth_gbs=2039,
        tdp_w=400,
        idle_w=55,
        has_energy_counter=True,
        nvml_patterns=("a100",),
        power_limit_range_w=(100, 400),
    ),
    # NVIDIA A40 datasheet: Ampere, 37.4 TFLOPS FP32, 149.7 TFLOPS FP16 tensor
    # dense (299.4 with sparsity), 48 GB GDDR6 with ECC, 696 GB/s, 300 W.
    # Idle ~30 W (estimate, like the others). Power limit 100-300 W (NVML).
    GpuType(
        name="a40",
        display_name="NVIDIA A40 48GB",
        architecture="Ampere",
        fp32_tflops=37.4,
        fp16_tflops=149.7,
        memory_gb=48,
        memory_bandwidth_gbs=696,
        tdp_w=300,
        idle_w=30,
        has_energy_counter=True,
        nvml_patterns=("a40",),
        power_limit_range_w=(100, 300),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 80GB: 67 TFLOPS FP32,
    # 1,979 TFLOPS FP16 tensor with sparsity, so 989 dense; 80 GB HBM3,
    # 3.35 TB/s, up to 700 W. PCIe and NVL boards also map here.
    # Idle ~70 W (estimate).
    GpuType(
        name="h100",
        display_name="NVIDIA H100 SXM5 80GB",
        architecture="Hopper",
        fp32_tflops=67,
        fp16_tflops=989,
        memory_gb=80,
        memory_bandwidth_gbs=3350,
        tdp_w=700,
        idle_w=70,
        has_energy_counter=True,
        nvml_patterns=("h100",),
        power_limit_range_w=(200, 700),
    ),
)

#: The builtin GPU types by canonical name (read-only; see register_gpu_type).
CATALOG: Mapping[str, GpuType] = types.MappingProxyType({g.name: g for g in _BUILTIN})

# Types added at run time; they shadow builtins registered with replace=True.
_registered: dict[str, GpuType] = {}


def _all_types() -> dict[str, GpuType]:
    return {**CATALOG, **_registered}


def _known_names() -> str:
    return ", ".join(sorted(_all_types()))


def gpu_types() -> tuple[GpuType, ...]:
    """Every known GPU type (builtin and registered), sorted by name."""
    return tuple(g for _, g in sorted(_all_types().items()))


def get_gpu_type(name: str) -> GpuType:
    """The GPU type with this canonical name (case-insensitive, whitespace-stripped)."""
    key = name.strip().lower() if isinstance(name, str) else name
    gpu = _all_types().get(key) if isinstance(key, str) else None
    if gpu is None:
        raise UnknownGpuTypeError(
            f"unknown GPU type {name!r}; known types: {_known_names()}. Add it with "
            "gogh_flows.catalog.register_gpu_type(GpuType(...)) or use a known name."
        )
    return gpu


def register_gpu_type(gpu: GpuType, *, replace: bool = False) -> None:
    """Make ``gpu`` known to the lookups; ``replace=True`` overrides an existing name.

    Registering a name that is already known without ``replace`` is refused, so
    a typo cannot silently change the figures of a builtin type.
    """
    if not isinstance(gpu, GpuType):
        raise TypeError(f"register_gpu_type expects a GpuType, got {type(gpu).__name__}")
    if gpu.name in _all_types() and not replace:
        raise ValueError(
            f"GPU type {gpu.name!r} is already known; pass replace=True to override it"
        )
    _registered[gpu.name] = gpu


def _pattern_matches(pattern: str, normalised_name: str) -> bool:
    # A pattern must start a token and end one, allowing one trailing letter
    # for variants (A10G, V100S): so "a10" does not match "a100" and "l4" does
    # not match "l40s".
    return re.search(rf"(?:^|\s){re.escape(_normalise(pattern))}[a-z]?(?=\s|$)", normalised_name) is not None


def from_nvml_name(device_name: str | bytes) -> GpuType:
    """The GPU type of a device, from its NVML name (``nvmlDeviceGetName``).

    Accepts ``bytes`` as older pynvml versions return. Patterns are tried
    longest first, so a more specific registered pattern wins over a shorter
    one it contains.
    """
    if isinstance(device_name, bytes):
        device_name = device_name.decode("utf-8", errors="replace")
    device_name = device_name.rstrip("\x00")
    normalised = _normalise(device_name)
    candidates = sorted(
        ((pattern, gpu) for gpu in _all_types().values() for pattern in gpu.nvml_patterns),
        key=lambda pg: (-len(_normalise(pg[0])), pg[1].name),
    )
    for pattern, gpu in candidates:
        if _pattern_matches(pattern, normalised):
            return gpu
    raise UnknownGpuTypeError(
        f"unknown NVML device name {device_name!r}: no GPU type's nvml_patterns match it "
        f"(known types: {_known_names()}). Add it with gogh_flows.catalog.register_gpu_type("
        'GpuType(name=..., ..., nvml_patterns=("<substring>",))).'
    )

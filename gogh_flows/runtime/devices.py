"""The GPUs a pool can place runs on, and how a fleet is written down.

A device id (``"v100-0"``) is the one name every layer uses for a GPU: the
optimiser's ``Gpu.id``, the Dask worker the runs are pinned to, the ledger's
``gpu_id`` and the MLflow tags. Keeping it stable and derived from the GPU type
means a fleet declared as ``"v100=2,t4=1"`` always yields the same ids.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gogh_flows.catalog import get_gpu_type

__all__ = ["GpuDevice", "device_id", "fleet_devices", "parse_fleet", "split_device_id"]

MAX_CAPACITY = 2  # throughput data are pairwise (see placement.problem.MAX_CAPACITY)
_ID = re.compile(r"^(?P<type>[a-z0-9_.]+)-(?P<n>\d+)$")


@dataclass(frozen=True)
class GpuDevice:
    """One GPU of a pool, pinned to exactly one Dask worker.

    ``capacity`` is how many runs may share it at once (1 = exclusive, 2 = a
    co-located pair); the pool advertises it as the worker's ``slot`` resource so
    Dask itself never starts more bodies on it than that. ``cuda_index`` is the
    NVML (physical) index and ``uuid`` the NVML UUID, both ``None`` for emulated
    devices; telemetry uses them to find the board to sample.
    """

    id: str
    gpu_type: str
    worker: str
    capacity: int = 2
    cuda_index: int | None = None
    uuid: str | None = None
    host: str | None = None

    @property
    def where(self) -> str:
        """``"a100-0@a100-0"``: the GPU and the worker serving it, as measurements record it."""
        return f"{self.id}@{self.worker}"

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise ValueError(f"GpuDevice.id must be a non-empty string, got {self.id!r}")
        # Validates the type and normalises "V100" to the catalog's "v100";
        # an unknown type raises UnknownGpuTypeError listing the known ones.
        object.__setattr__(self, "gpu_type", get_gpu_type(self.gpu_type).name)
        if not isinstance(self.worker, str) or not self.worker:
            raise ValueError(f"GpuDevice {self.id!r}: worker must be a non-empty string, got {self.worker!r}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or not (
            1 <= self.capacity <= MAX_CAPACITY
        ):
            raise ValueError(
                f"GpuDevice {self.id!r}: capacity must be 1 (exclusive) or 2 (a pair may share), "
                f"got {self.capacity!r}"
            )


def device_id(gpu_type: str, n: int) -> str:
    """The id of the ``n``-th GPU of a type: ``device_id("v100", 0) == "v100-0"``."""
    return f"{get_gpu_type(gpu_type).name}-{n}"


def split_device_id(name: str) -> tuple[str, int] | None:
    """``"v100-3"`` -> ``("v100", 3)``; ``None`` when the name does not follow the convention."""
    m = _ID.match(name.strip().lower()) if isinstance(name, str) else None
    return (m["type"], int(m["n"])) if m else None


def parse_fleet(spec: str | Mapping[str, int]) -> dict[str, int]:
    """GPU counts per catalog type, from ``"v100=2,t4=1"`` or ``{"v100": 2, "t4": 1}``.

    Types are validated against the catalog (case-insensitive). A type named twice is refused,
    as ``gogh simulate --cluster`` refuses it: ``"v100=1,v100=2"`` is more likely a typo than
    three V100s.
    """
    if isinstance(spec, str):
        items: list[tuple[str, object]] = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, sep, count = part.partition("=")
            if not sep or not name.strip() or not count.strip():
                raise ValueError(
                    f"bad fleet entry {part!r} in {spec!r}: write TYPE=COUNT entries separated by "
                    "commas, e.g. 'v100=2,t4=1'"
                )
            try:
                n: object = int(count.strip())
            except ValueError:
                raise ValueError(
                    f"bad GPU count {count.strip()!r} for {name.strip()!r} in fleet {spec!r}: "
                    "counts must be whole numbers, e.g. 'v100=2'"
                ) from None
            items.append((name.strip(), n))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        raise TypeError(f"a fleet is a 'v100=2,t4=1' string or a mapping, got {type(spec).__name__}")
    fleet: dict[str, int] = {}
    named: set[str] = set()
    for name, n in items:
        gpu = get_gpu_type(str(name))  # unknown -> UnknownGpuTypeError listing known types
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"GPU count for {name!r} must be a whole number >= 0, got {n!r}")
        if gpu.name in named:
            total = sum(c for m, c in items if isinstance(c, int) and get_gpu_type(str(m)).name == gpu.name)
            raise ValueError(f"GPU type {gpu.name!r} appears twice in the fleet {spec!r}; name each type once, "
                             f"with its total count (e.g. '{gpu.name}={total}')")
        named.add(gpu.name)
        if n:
            fleet[gpu.name] = n
    if not fleet:
        raise ValueError(f"the fleet {spec!r} declares no GPUs; give at least one, e.g. 'v100=1'")
    return fleet


def fleet_devices(fleet: str | Mapping[str, int], *, capacity: int = 2) -> tuple[GpuDevice, ...]:
    """One emulated device per declared GPU, named ``<type>-<n>`` and pinned to a worker of that name."""
    counts = parse_fleet(fleet)
    return tuple(
        GpuDevice(id=device_id(t, i), gpu_type=t, worker=device_id(t, i), capacity=capacity)
        for t, n in counts.items()
        for i in range(n)
    )

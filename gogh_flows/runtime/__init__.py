"""Runtime adapter: a GPU pool on Dask, run telemetry, and the pool's slot ledger (in its scheduler).

This is an adapter layer (it imports ``distributed``); the pure core never
imports it. ``dask_cuda`` and ``pynvml`` are imported only when a real GPU is
used.
"""

from gogh_flows.runtime.context import GpuContext, current_gpu
from gogh_flows.runtime.devices import GpuDevice, fleet_devices, parse_fleet
from gogh_flows.runtime.emulation import EmulationError
from gogh_flows.runtime.leases import Claim, Lease, LedgerState, PoolLedger
from gogh_flows.runtime.ledger import LedgerPlugin
from gogh_flows.runtime.outcome import RunFailed, RunOutcome
from gogh_flows.runtime.pool import (
    MODES,
    GpuPool,
    UnknownDeviceError,
    emulated_pool,
    local_cuda_pool,
    open_pool,
    remote_pool,
)
from gogh_flows.runtime.telemetry import TelemetryReading, telemetry_for

__all__ = [
    "MODES",
    "EmulationError",
    "Claim",
    "Lease",
    "LedgerPlugin",
    "LedgerState",
    "RunFailed",
    "UnknownDeviceError",
    "GpuContext",
    "GpuDevice",
    "GpuPool",
    "PoolLedger",
    "RunOutcome",
    "TelemetryReading",
    "current_gpu",
    "emulated_pool",
    "fleet_devices",
    "local_cuda_pool",
    "open_pool",
    "parse_fleet",
    "remote_pool",
    "telemetry_for",
]

"""A decorated flow served by a Prefect runner, as a team deploys one: each flow run is a process
of its own, started by the runner, placing onto a shared pool (``$GOGH_POOL_ADDRESS``).

Run by tests/test_multihost.py as ``python tests/hostproc/served_flow.py``: it serves the
deployment ``held/held`` until terminated. Cancelling a run from Prefect, or killing its
process, are then what a user would do.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle

from gogh_flows import GpuCluster, PlacementPolicy, current_placement, gogh_placed

# the runner loads this file by path: ship the body to the Dask workers by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@gogh_placed(model="ResNet-50", batch_size=64, min_throughput=5.0, work_steps=100,
             cluster=GpuCluster(mode="remote", address=os.environ.get("GOGH_POOL_ADDRESS", "tcp://unset:0")),
             policy=PlacementPolicy(poll_s=0.2, wait_timeout_s=float(os.environ.get("GOGH_SERVED_WAIT_S", "60"))))
def held(hold_s: float = 60.0) -> str:
    where = current_placement()
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:  # reports as it goes: a cancelled run stops here
        where.report(1)
        time.sleep(0.05)
    return where.gpu_id


if __name__ == "__main__":
    held.serve(name="held", limit=4)

"""Placed bodies' own Dask work and the library's log lines: process-wide settings, shared safely."""

from __future__ import annotations

import logging

import dask

from gogh_flows.flows.body_dask import bodys_own_dask
from gogh_flows.flows.run_logs import RunLogBridge, has_other_handlers


def test_bodies_ending_out_of_order_keep_the_local_scheduler_to_the_end_and_leave_nothing_behind():
    """Two bodies of one process: the first to end put back the setting it had found, so the second
    ran its last Dask work on the pool, and the process kept "threads" after both (a review)."""
    before = dask.config.get("scheduler", None)
    a, b = bodys_own_dask(), bodys_own_dask()
    a.__enter__()
    b.__enter__()
    assert dask.config.get("scheduler") == "threads"
    a.__exit__(None, None, None)  # A ends first
    assert dask.config.get("scheduler") == "threads"  # B still runs
    b.__exit__(None, None, None)
    assert dask.config.get("scheduler", None) == before


def test_the_bridge_to_run_logs_does_not_silence_pythons_last_resort(capsys):
    """With the bridge as the library logger's only handler, Python no longer printed a warning no
    other handler took (its lastResort): outside a run it went nowhere (a review)."""
    lib = logging.getLogger("gogh_flows.test_last_resort")
    root_handlers = logging.root.handlers[:]
    logging.root.handlers.clear()
    bridge = RunLogBridge()
    lib.addHandler(bridge)
    lib.propagate = False
    try:
        assert not has_other_handlers(lib)
        lib.warning("gogh: said outside any run")
    finally:
        lib.removeHandler(bridge)
        lib.propagate = True
        logging.root.handlers[:] = root_handlers
    assert "gogh: said outside any run" in capsys.readouterr().err

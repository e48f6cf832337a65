"""Per-run power limits on real boards: the limit a run's placement chose, set while it runs.

A placement with ``PlacementPolicy(power_limit_levels=...)`` chooses a board limit with the
GPU and the partner. The emulated fleet enacts it in its meters; a real board's limit is
machine state, shared by every run on the board and every user of the machine, and outlives
a process that dies. So, like the pool-wide caps (:mod:`gogh_flows.runtime.power_cap`), this
is off unless the pool asks (``GpuCluster(mode="local-cuda", run_power_limits=True)``):

* **asked before any run.** The pool's :class:`RunLimitsPlugin` has every worker set its
  board's limit to the limit already in force (which changes nothing) when it starts, so a
  missing permission stops the pool with NVML's answer, not each run later;
* **one limit per board**, the last claim's (the ledger's), set by the worker's occupancy
  under its lock as runs join, so the order of the changes is the order of the joins;
* **put back** to the limit in force before gogh first changed the board when the board has
  no run left, when the worker stops (plugin teardown) and at the worker process's exit;
* **clamped into the board's range**, and said: the catalog's range describes one variant of
  a type (a PCIe V100 accepts 100-250 W, the SXM2 part 150-300 W).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from distributed import WorkerPlugin

from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.power_cap import (
    _PERMISSION_HINT,
    PowerCapError,
    PowerLimits,
    _describe,
    _handle,
    _load_pynvml,
    _mw,
    _shutdown,
    read_limits,
)

__all__ = ["PLUGIN_NAME", "BoardLimiter", "RunLimitsPlugin", "active_limiter", "board_of"]

log = logging.getLogger("gogh_flows.runtime")

#: the name the pool registers its :class:`RunLimitsPlugin` under on its workers
PLUGIN_NAME = "gogh-run-limits"

_HINT = _PERMISSION_HINT.replace("or leave power_cap_w / power_cap_fraction unset",
                                 "or leave run_power_limits off (chosen limits are then logged, not applied)")


def board_of(device: GpuDevice) -> str:
    """How NVML finds ``device``'s board: its UUID, else its physical index."""
    if device.uuid:
        return device.uuid
    if device.cuda_index is None:
        raise PowerCapError(f"GPU {device.id} has neither an NVML UUID nor an index: its power limit cannot be set")
    return str(device.cuda_index)


class _Board:
    def __init__(self, handle: Any, label: str, index: str, limits: PowerLimits) -> None:
        self.handle, self.label, self.index, self.limits = handle, label, index, limits
        self.restore_w = limits.current_w  # in force before gogh changed it
        self.changed = False


class BoardLimiter:
    """The per-run limits of one worker process's board(s), and their way back."""

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml
        self._lock = threading.RLock()
        self._boards: dict[str, _Board] = {}
        self._open = False

    def _board(self, board: str) -> _Board:
        """The board's record, read from NVML the first time (NVML opened until :meth:`restore_all`)."""
        if board in self._boards:
            return self._boards[board]
        nvml = self._nvml = self._nvml or _load_pynvml()
        if not self._open:
            try:
                nvml.nvmlInit()
            except Exception as exc:
                raise PowerCapError(f"per-run power limits need NVML (nvmlInit failed: {type(exc).__name__}: "
                                    f"{exc}); it needs an NVIDIA driver") from exc
            self._open = True
            atexit.register(self._at_exit)
        handle = _handle(nvml, board)
        _, index, name = _describe(nvml, handle, board)
        shown = str(index if index is not None else board)
        rec = _Board(handle, f"GPU {shown} ({name})", shown, read_limits(nvml, handle))
        self._boards[board] = rec
        return rec

    def _set(self, rec: _Board, watts: float) -> float:
        try:
            self._nvml.nvmlDeviceSetPowerManagementLimit(rec.handle, _mw(watts))  # type: ignore[union-attr]
        except Exception as exc:
            hint = ("this board does not let its power limit be changed" if "NotSupported" in type(exc).__name__
                    else _HINT.format(index=rec.index, watts=f"{watts:g}"))
            raise PowerCapError(f"NVML refused to set the power limit of {rec.label} to {watts:g} W: "
                                f"{type(exc).__name__}: {exc}. {hint}.") from exc
        try:
            return self._nvml.nvmlDeviceGetPowerManagementLimit(rec.handle) / 1000  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - it was accepted; say what was asked
            return watts

    def check(self, board: str) -> PowerLimits:
        """Set ``board``'s limit to the one in force: proof, before any run, that this process may."""
        with self._lock:
            rec = self._board(board)
            self._set(rec, rec.limits.current_w)
            return rec.limits

    def enact(self, device: GpuDevice, limit_w: float | None) -> float:
        """Put ``device``'s board at ``limit_w`` (None: back to the limit before gogh changed it);
        returns the limit NVML reads back, in watts."""
        with self._lock:
            rec = self._board(board_of(device))
            if limit_w is None:
                if not rec.changed:
                    return rec.restore_w
                in_force = self._set(rec, rec.restore_w)
                rec.changed = False
                return in_force
            lo, hi = rec.limits.min_w, rec.limits.max_w
            target = min(max(float(limit_w), lo), hi)
            if target != limit_w:
                log.warning("gogh: power limit %g W chosen for %s is outside the %g-%g W it accepts; set to %g W",
                            limit_w, rec.label, lo, hi, target)
            rec.changed = True
            return self._set(rec, target)

    def restore_all(self) -> None:
        """Every board this process changed back to its limit before; NVML closed."""
        with self._lock:
            for rec in self._boards.values():
                if rec.changed:
                    try:
                        self._set(rec, rec.restore_w)
                        rec.changed = False
                        log.info("gogh: power limit of %s restored to %g W", rec.label, rec.restore_w)
                    except PowerCapError as exc:
                        log.error("gogh: %s; it stays changed for every user of this machine until reset: "
                                  "`sudo nvidia-smi -i %s -pl %g`", exc, rec.index, rec.restore_w)
            self._boards.clear()
            if self._open:
                self._open = False
                atexit.unregister(self._at_exit)
                _shutdown(self._nvml)  # type: ignore[arg-type]

    def _at_exit(self) -> None:
        self.restore_all()


_active: BoardLimiter | None = None
_active_lock = threading.Lock()


def active_limiter() -> BoardLimiter | None:
    """This worker process's limiter when its pool enacts per-run limits, else ``None``."""
    return _active


class RunLimitsPlugin(WorkerPlugin):
    """Lets each worker enact its runs' power limits on its own board; puts the board back when it stops.

    ``boards`` maps a worker name to its board (NVML UUID or physical index). Setup proves the
    permission (:meth:`BoardLimiter.check`), so a pool that cannot change its boards fails when it
    starts.
    """

    idempotent = False

    def __init__(self, boards: Mapping[str, str]) -> None:
        self.boards = dict(boards)

    def setup(self, worker: Any) -> None:
        global _active
        board = self.boards.get(str(getattr(worker, "name", "")))
        if board is None:
            return
        limiter = BoardLimiter()
        try:
            limits = limiter.check(board)
        except BaseException:
            limiter.restore_all()
            raise
        with _active_lock:
            _active = limiter
        log.info("gogh: runs on board %s may set its power limit (%g-%g W, %g W now); it is put back when "
                 "the board is empty and when this worker stops", board, limits.min_w, limits.max_w,
                 limits.current_w)

    def teardown(self, worker: Any) -> None:
        global _active
        with _active_lock:
            limiter, _active = _active, None
        if limiter is not None:
            limiter.restore_all()

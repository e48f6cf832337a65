"""Per-run power limits on real boards: the limit a run's placement chose, set while it runs.

A placement with ``PlacementPolicy(power_limit_levels=...)`` chooses a board limit with the
GPU and the partner. The emulated fleet enacts it in its meters; a real board's limit is
machine state, shared by every run on the board and every user of the machine, and outlives
a process that dies. So, like the pool-wide caps (:mod:`gogh_flows.runtime.power_cap`), this
is off unless the pool asks (``GpuCluster(mode="local-cuda", run_power_limits=True)``):

* **the limit to go back to is read once, by the process that opens the pool**, before any
  worker changes anything, and shipped to the workers: a worker that the nanny restarts after a
  crash would otherwise take the lowered limit it finds for the one to put back;
* **asked before any run.** Each worker sets its board to that limit when it starts (which
  changes nothing, or puts back a board a killed predecessor left lowered), so a missing
  permission stops the pool with NVML's answer, not each run later;
* **one limit per board**, the last claim's (the ledger's), set by the worker's occupancy
  under its lock as runs join, so the order of the changes is the order of the joins;
* **put back** when the board has no run left, when the worker stops (plugin teardown), at the
  worker process's normal exit, and at the exit of the process that opened the pool for a
  board a killed worker left changed;
* **never above the limit from before** (an administrator's cap stays a cap) **nor outside the
  board's range**, and said: the catalog's range describes one variant of a type (a PCIe V100
  accepts 100-250 W, the SXM2 part 150-300 W).
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
    PowerCapError,
    PowerLimits,
    _describe,
    _handle,
    _load_pynvml,
    _mw,
    _shutdown,
    nvml_at_exit,
    nvml_refusal,
    read_limits,
)

__all__ = ["PLUGIN_NAME", "BoardLimiter", "RunLimitsPlugin", "active_limiter", "board_of", "plan_run_limits",
           "restore_if_still_changed"]

log = logging.getLogger("gogh_flows.runtime")

#: the name the pool registers its :class:`RunLimitsPlugin` under on its workers
PLUGIN_NAME = "gogh-run-limits"

_OFF = "or leave run_power_limits off (chosen limits are then logged, not applied)"


def board_of(device: GpuDevice) -> str:
    """How NVML finds ``device``'s board: its UUID, else its physical index."""
    if device.uuid:
        return device.uuid
    if device.cuda_index is None:
        raise PowerCapError(f"GPU {device.id} has neither an NVML UUID nor an index: its power limit cannot be set")
    return str(device.cuda_index)


def _refusal(label: str, watts: float, exc: Exception, doing: str) -> PowerCapError:
    return nvml_refusal(
        label, watts, exc, doing,
        permission=("Changing a board's power limit needs root, as `nvidia-smi -pl` does: run the pool's dask-cuda "
                    f"workers as a user allowed to, {_OFF}"),
        unsupported="This board does not let its power limit be changed: leave run_power_limits off",
        other=f"If it persists, {_OFF}")


class _Board:
    def __init__(self, handle: Any, label: str, index: str, limits: PowerLimits, restore_w: float) -> None:
        self.handle, self.label, self.index, self.limits = handle, label, index, limits
        self.restore_w = restore_w  # in force before gogh changed it (read by the pool's opener)
        self.changed = False
        self.said: set[float] = set()  # clamped limits already warned about


def _open_nvml(nvml: ModuleType | None) -> ModuleType:
    """NVML, initialised (the caller shuts it down), or a :class:`PowerCapError` saying why not."""
    nvml = nvml or _load_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise PowerCapError(f"run_power_limits needs NVML (nvmlInit failed: {type(exc).__name__}: {exc}); "
                            "it needs an NVIDIA driver") from exc
    return nvml


def plan_run_limits(boards: list[str], nvml: ModuleType | None = None) -> dict[str, float]:
    """Each board's limit in force now, in watts: what the pool's workers put back. Changes nothing."""
    nvml = _open_nvml(nvml)
    try:
        return {board: read_limits(nvml, _handle(nvml, board)).current_w for board in boards}
    finally:
        _shutdown(nvml)


def restore_if_still_changed(restore: dict[str, float], nvml: ModuleType | None = None) -> None:
    """When the pool closes (or the opener exits without closing it): a board below its limit
    from before was left by a worker killed outright (its own exit hooks never ran); put it back
    and say so. A board *above* it was not left by gogh, which never raises a limit past the one
    it found, and is left alone."""
    with nvml_at_exit(nvml) as nvml:
        if nvml is None:
            return
        for board, watts in restore.items():
            try:
                handle = _handle(nvml, board)
                if nvml.nvmlDeviceGetPowerManagementLimit(handle) < _mw(watts):
                    nvml.nvmlDeviceSetPowerManagementLimit(handle, _mw(watts))
                    log.warning("gogh: power limit of GPU %s put back to %g W at exit (a worker left it changed)",
                                board, watts)
            except Exception as exc:  # noqa: BLE001 - say it, do not hide the program's own outcome
                log.error("gogh: could not put the power limit of GPU %s back to %g W at exit: %s: %s; "
                          "`sudo nvidia-smi -i <index> -pl %g` does", board, watts, type(exc).__name__, exc, watts)


class BoardLimiter:
    """The per-run limits of one worker process's board(s), and their way back.

    ``restore`` maps a board to the limit to put back (the pool's opener read it before any
    change); a board not in it is put back to the limit it had when this limiter first read it.
    """

    def __init__(self, nvml: ModuleType | None = None, restore: dict[str, float] | None = None) -> None:
        self._nvml = nvml
        self._restore = dict(restore or {})
        self._lock = threading.RLock()
        self._boards: dict[str, _Board] = {}
        self._open = False

    def _board(self, board: str) -> _Board:
        """The board's record, read from NVML the first time (NVML opened until :meth:`restore_all`)."""
        if board in self._boards:
            return self._boards[board]
        if not self._open:
            self._nvml = _open_nvml(self._nvml)
            self._open = True
            atexit.register(self.restore_all)
        nvml = self._nvml
        handle = _handle(nvml, board)
        _, index, name = _describe(nvml, handle, board)
        shown = str(index if index is not None else board)
        limits = read_limits(nvml, handle)
        rec = _Board(handle, f"GPU {shown} ({name})", shown, limits, self._restore.get(board, limits.current_w))
        self._boards[board] = rec
        return rec

    def _set(self, rec: _Board, watts: float, doing: str = "set") -> float:
        try:
            self._nvml.nvmlDeviceSetPowerManagementLimit(rec.handle, _mw(watts))  # type: ignore[union-attr]
        except Exception as exc:
            raise _refusal(rec.label, watts, exc, doing) from exc
        try:
            return self._nvml.nvmlDeviceGetPowerManagementLimit(rec.handle) / 1000  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - it was accepted; say what was asked
            return watts

    def check(self, board: str) -> PowerLimits:
        """Set ``board`` to its limit from before: proof, before any run, that this process may
        (and a board a killed predecessor left lowered is put back)."""
        with self._lock:
            rec = self._board(board)
            if rec.limits.current_w != rec.restore_w:
                log.warning("gogh: %s was at %g W, not its %g W from before the pool started (a worker stopped "
                            "without putting it back?); it is put back", rec.label, rec.limits.current_w,
                            rec.restore_w)
            self._set(rec, rec.restore_w, doing="check that this worker may change (at pool start)")
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
            lo, hi = rec.limits.min_w, min(rec.limits.max_w, rec.restore_w)
            target = min(max(float(limit_w), lo), hi)
            if target != limit_w and limit_w not in rec.said:
                rec.said.add(limit_w)
                log.warning("gogh: power limit %g W chosen for %s is outside the %g-%g W it may take (its range, "
                            "and never above its limit from before); set to %g W", limit_w, rec.label, lo, hi, target)
            rec.changed = True
            return self._set(rec, target)

    def lower(self, device: GpuDevice, limit_w: float | None) -> float | None:
        """:meth:`enact`, answering what the runs on the board are under: the limit in force, or
        None when the board is not below its limit from before (``None`` asked, or a limit an
        administrator's cap or the board's range clamped up to it), so nothing judges a run by
        a limit that is not there."""
        in_force = self.enact(device, limit_w)
        with self._lock:
            before = self._board(board_of(device)).restore_w
        return None if limit_w is None or in_force >= before - 1e-6 else in_force

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
                atexit.unregister(self.restore_all)
                _shutdown(self._nvml)  # type: ignore[arg-type]


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

    def __init__(self, boards: Mapping[str, str], restore: Mapping[str, float] | None = None) -> None:
        self.boards = dict(boards)
        self.restore = dict(restore or {})  # board -> W to put back, read by the pool's opener

    def setup(self, worker: Any) -> None:
        global _active
        board = self.boards.get(str(getattr(worker, "name", "")))
        if board is None:
            return
        limiter = BoardLimiter(restore=self.restore)
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

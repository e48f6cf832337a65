"""Optional GPU power caps: set only when asked, checked before, restored after.

A board's power limit is machine state, not process state: changing it changes it for
every user of the machine, and a process that dies without putting it back leaves it
changed until someone does (or the driver reloads). So a cap is off unless a cluster asks
for one (``GpuCluster(power_cap_w=...)`` or ``power_cap_fraction=...`` of the board's
default limit), every requested cap is checked against the board's allowed range *before*
any board is changed, and the limit that was in force before is put back when the worker
stops (:class:`PowerCapPlugin` teardown), at interpreter exit (``atexit``, in the worker and
in the process that started the pool), and at the end of a :func:`power_capped` block.

NVML calls used: ``nvmlDeviceGetPowerManagementLimitConstraints`` (allowed min, max),
``nvmlDeviceGetPowerManagementDefaultLimit``, ``nvmlDeviceGetPowerManagementLimit`` (in
force) and ``nvmlDeviceSetPowerManagementLimit``, all in milliwatts. Setting needs root
(what ``nvidia-smi -pl`` needs); a refusal is reported with NVML's answer and what to do.

:func:`power_cap_in_force` says which cap a board runs under, so measurements can record it.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from distributed import WorkerPlugin

from gogh_flows.runtime.devices import GpuDevice

__all__ = [
    "PLUGIN_NAME",
    "BoardCap",
    "PowerCapError",
    "PowerCapPlugin",
    "PowerLimits",
    "check_cap_request",
    "plan_power_caps",
    "power_cap_in_force",
    "power_capped",
    "read_limits",
    "resolve_cap",
]

log = logging.getLogger("gogh_flows.runtime")

#: the name the pool registers its :class:`PowerCapPlugin` under on its workers
PLUGIN_NAME = "gogh-power-cap"

_PERMISSION_HINT = (
    "Changing a board's power limit needs root, as `nvidia-smi -pl` does: run the pool as a user "
    "allowed to, ask the machine's administrator to set the cap (`sudo nvidia-smi -i {index} -pl {watts}`), "
    "or leave power_cap_w / power_cap_fraction unset"
)


class PowerCapError(RuntimeError):
    """A power cap that cannot be applied (outside the board's range, refused by NVML)."""


@dataclass(frozen=True)
class PowerLimits:
    """A board's power management limits in watts, as NVML reports them."""

    min_w: float
    max_w: float
    default_w: float
    current_w: float


@dataclass(frozen=True)
class BoardCap:
    """The cap to put on one board, and the limit to put back afterwards."""

    board: str        # NVML UUID ("GPU-...") or physical index, as CUDA_VISIBLE_DEVICES names it
    index: int | None  # physical index (for messages and nvidia-smi -i)
    name: str         # board name (for messages)
    cap_w: float
    restore_w: float  # the limit in force before gogh changed it
    limits: PowerLimits

    @property
    def label(self) -> str:
        return f"GPU {self.index if self.index is not None else self.board} ({self.name})"


# -- checking what was asked ------------------------------------------------------------
def check_cap_request(power_cap_w: float | None, power_cap_fraction: float | None, *,
                      run_power_limits: bool = False) -> None:
    """Raise ``ValueError`` unless the request is none, or exactly one well-formed value.

    ``power_cap_w`` is watts per board (> 0); ``power_cap_fraction`` a fraction of each
    board's default limit, in (0, 1]. A cap and per-run limits (``run_power_limits``) are
    refused together: a run's limit would lift the cap, and putting the board back would undo it.
    """
    for name, value in (("power_cap_w", power_cap_w), ("power_cap_fraction", power_cap_fraction)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if power_cap_w is not None and power_cap_fraction is not None:
        raise ValueError(f"give power_cap_w ({power_cap_w!r} W) or power_cap_fraction ({power_cap_fraction!r} "
                         "of the default limit), not both")
    if run_power_limits and (power_cap_w is not None or power_cap_fraction is not None):
        raise ValueError("give a pool-wide power cap (power_cap_w / power_cap_fraction) or per-run limits "
                         "(run_power_limits=True), not both: a run's limit would lift the cap, and putting the "
                         "board back would undo it")
    if power_cap_w is not None and not power_cap_w > 0:
        raise ValueError(f"power_cap_w must be > 0 watts, got {power_cap_w!r}")
    if power_cap_fraction is not None and not 0 < power_cap_fraction <= 1:
        raise ValueError(f"power_cap_fraction must be in (0, 1] (a fraction of the board's default power "
                         f"limit), got {power_cap_fraction!r}")


def _mw(watts: float) -> int:
    return round(watts * 1000)


def read_limits(nvml: ModuleType, handle: Any) -> PowerLimits:
    """The board's allowed range, default and current power limit (NVML milliwatts -> watts)."""
    low, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    return PowerLimits(min_w=low / 1000, max_w=high / 1000,
                       default_w=nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000,
                       current_w=nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000)


def resolve_cap(limits: PowerLimits, *, power_cap_w: float | None = None,
                power_cap_fraction: float | None = None, label: str = "this GPU") -> float | None:
    """The cap in watts for a board with ``limits``, or ``None`` when none was asked.

    Refuses (:class:`PowerCapError`, naming the allowed range) a cap outside what the board
    accepts, so nothing is changed on any board when one of them could not take it.
    """
    check_cap_request(power_cap_w, power_cap_fraction)
    if power_cap_w is None and power_cap_fraction is None:
        return None
    cap = power_cap_w if power_cap_w is not None else limits.default_w * float(power_cap_fraction or 0)
    if not _mw(limits.min_w) <= _mw(cap) <= _mw(limits.max_w):
        asked = (f"{cap:g} W" if power_cap_fraction is None
                 else f"{cap:g} W ({power_cap_fraction:g} of its default {limits.default_w:g} W)")
        raise PowerCapError(
            f"cannot cap {label} at {asked}: it accepts power limits from {limits.min_w:g} W to "
            f"{limits.max_w:g} W (default {limits.default_w:g} W). Choose a cap in that range; no board "
            "was changed.")
    return cap


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _handle(nvml: ModuleType, board: str | int) -> Any:
    text = str(board).strip()
    if text.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(text)
    return nvml.nvmlDeviceGetHandleByIndex(int(text))


def _describe(nvml: ModuleType, handle: Any, board: str | int) -> tuple[str, int | None, str]:
    """(uuid or the given id, physical index, name) of a board, as far as NVML says."""
    def ask(call: str) -> Any:
        try:
            return getattr(nvml, call)(handle)
        except Exception:  # noqa: BLE001 - descriptive only
            return None

    uuid, index, name = ask("nvmlDeviceGetUUID"), ask("nvmlDeviceGetIndex"), ask("nvmlDeviceGetName")
    if index is None and str(board).strip().isdigit():
        index = int(str(board).strip())
    return (_text(uuid) if uuid is not None else str(board)), index, (_text(name) if name else "unknown board")


def plan_power_caps(boards: Sequence[str | int], *, power_cap_w: float | None = None,
                    power_cap_fraction: float | None = None, nvml: ModuleType | None = None) -> list[BoardCap]:
    """The cap for every board, checked against each board's range; changes nothing.

    ``[]`` when no cap was asked (and then NVML is not even opened). Any board that cannot
    take the cap fails the whole plan with :class:`PowerCapError`, before a single limit
    was touched.
    """
    check_cap_request(power_cap_w, power_cap_fraction)
    if power_cap_w is None and power_cap_fraction is None:
        return []
    nvml = nvml or _load_pynvml()
    _init(nvml)
    try:
        plan = []
        for board in boards:
            try:
                handle = _handle(nvml, board)
                uuid, index, name = _describe(nvml, handle, board)
                limits = read_limits(nvml, handle)
            except Exception as exc:
                raise PowerCapError(
                    f"cannot read the power limits of GPU {board}: {type(exc).__name__}: {exc}. A board that "
                    "does not report its power management range cannot be capped; leave power_cap_w / "
                    "power_cap_fraction unset") from exc
            label = f"GPU {index if index is not None else board} ({name})"
            cap = resolve_cap(limits, power_cap_w=power_cap_w, power_cap_fraction=power_cap_fraction, label=label)
            if cap is not None and _mw(cap) > _mw(limits.current_w):
                # a cap is a ceiling: a board someone already limited lower stays where it is
                log.warning("gogh: %s is already limited to %g W, below the cap of %g W asked; it is left at %g W "
                            "(a cap never raises a board's limit)", label, limits.current_w, cap, limits.current_w)
                cap = limits.current_w
            plan.append(BoardCap(board=uuid, index=index, name=name, cap_w=float(cap or 0), restore_w=limits.current_w,
                                 limits=limits))
        return plan
    finally:
        _shutdown(nvml)


# -- changing and putting back ----------------------------------------------------------------
#: caps this process set and has not restored (or its pool's workers reported):
#: board UUID (or the id it was named by) -> (physical index, watts in force)
_IN_FORCE: dict[str, tuple[int | None, float]] = {}
_IN_FORCE_LOCK = threading.Lock()


def _remember(cap: BoardCap, watts: float | None) -> None:
    with _IN_FORCE_LOCK:
        if watts is None:
            _IN_FORCE.pop(cap.board, None)
        else:
            _IN_FORCE[cap.board] = (cap.index, watts)


def power_cap_in_force(device: GpuDevice | str | int | None = None) -> float | None:
    """The power cap (W, as NVML reads it back) gogh put on ``device``'s board, or ``None`` if none.

    ``device`` is a :class:`GpuDevice`, a board UUID or a physical index; ``None`` means the
    one board this process capped (a dask-cuda worker has one). On a pool's worker it is what
    the worker set; in the process that opened a ``local-cuda`` pool, what its workers reported
    when the pool started. ``None`` means the board runs at whatever limit it had: gogh did not
    change it.
    """
    with _IN_FORCE_LOCK:
        if device is None:
            return next(iter(_IN_FORCE.values()))[1] if len(_IN_FORCE) == 1 else None
        if isinstance(device, GpuDevice):
            uuid, index = device.uuid, device.cuda_index
        else:
            text = str(device).strip()
            uuid, index = (None, int(text)) if text.isdigit() else (text, None)
        if uuid and uuid in _IN_FORCE:
            return _IN_FORCE[uuid][1]
        if index is not None:
            for board, (board_index, watts) in _IN_FORCE.items():
                if board_index == index or (board_index is None and board == str(index)):
                    return watts
    return None


def nvml_refusal(label: str, watts: float, exc: Exception, doing: str, *, permission: str,
                 unsupported: str, other: str | None = None) -> PowerCapError:
    """What NVML's refusal to change a board's limit means and what to do, by the error's kind
    (the hints differ between a pool's cap and per-run limits; the diagnosis is the same)."""
    kind = type(exc).__name__
    if "NotSupported" in kind:
        hint = unsupported
    elif "NoPermission" in kind or other is None:
        hint = permission
    else:
        hint = other
    return PowerCapError(f"NVML refused to {doing} the power limit of {label} to {watts:g} W: {kind}: {exc}. "
                         f"{hint}.")


def _refused(cap: BoardCap, watts: float, exc: Exception, doing: str) -> PowerCapError:
    return nvml_refusal(
        cap.label, watts, exc, doing,
        permission=_PERMISSION_HINT.format(index=cap.index if cap.index is not None else cap.board, watts=f"{watts:g}"),
        unsupported="this board does not let its power limit be changed; leave power_cap_w / power_cap_fraction unset")


def apply_cap(nvml: ModuleType, cap: BoardCap) -> float:
    """Set ``cap`` on its board (range checked again first); the limit NVML reads back, in watts."""
    handle = _handle(nvml, cap.board)
    limits = read_limits(nvml, handle)
    resolve_cap(limits, power_cap_w=cap.cap_w, label=cap.label)
    try:
        nvml.nvmlDeviceSetPowerManagementLimit(handle, _mw(cap.cap_w))
    except Exception as exc:
        raise _refused(cap, cap.cap_w, exc, "set") from exc
    try:
        in_force = nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000
    except Exception:  # noqa: BLE001 - it was accepted; say what was asked
        in_force = cap.cap_w
    _remember(cap, in_force)
    return in_force


def restore(nvml: ModuleType, cap: BoardCap) -> None:
    """Put back the limit that was in force before ``cap`` (``restore_w``)."""
    handle = _handle(nvml, cap.board)
    try:
        nvml.nvmlDeviceSetPowerManagementLimit(handle, _mw(cap.restore_w))
    except Exception as exc:
        raise PowerCapError(
            f"could not restore the power limit of {cap.label} to {cap.restore_w:g} W ({type(exc).__name__}: "
            f"{exc}); it stays at {cap.cap_w:g} W for every user of this machine until reset: "
            f"`sudo nvidia-smi -i {cap.index if cap.index is not None else cap.board} -pl {cap.restore_w:g}`"
        ) from exc
    _remember(cap, None)


def _load_pynvml() -> ModuleType:
    from gogh_flows.runtime.nvml import load_pynvml

    return load_pynvml()


def _init(nvml: ModuleType) -> None:
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise PowerCapError(f"a power cap was asked but NVML cannot be used here (nvmlInit failed: "
                            f"{type(exc).__name__}: {exc}); it needs an NVIDIA driver") from exc


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001, S110 - best effort
        pass


class _Held:
    """One applied cap and its one-time restore (teardown, ``atexit`` or ``finally``, whichever is first)."""

    def __init__(self, nvml: ModuleType, cap: BoardCap) -> None:
        self.nvml, self.cap = nvml, cap
        self._lock = threading.Lock()
        self._done = False

    def restore(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            restore(self.nvml, self.cap)
            log.info("gogh: power limit of %s restored to %g W", self.cap.label, self.cap.restore_w)
        finally:
            atexit.unregister(self._at_exit)
            _shutdown(self.nvml)

    def _at_exit(self) -> None:
        try:
            self.restore()
        except PowerCapError as exc:
            log.error("gogh: %s", exc)


def _hold(nvml: ModuleType, cap: BoardCap) -> tuple[_Held, float]:
    _init(nvml)
    held = _Held(nvml, cap)
    try:
        in_force = apply_cap(nvml, cap)
    except BaseException:
        _shutdown(nvml)
        raise
    atexit.register(held._at_exit)
    return held, in_force


@contextmanager
def power_capped(board: str | int, *, power_cap_w: float | None = None, power_cap_fraction: float | None = None,
                 nvml: ModuleType | None = None) -> Iterator[float | None]:
    """Run a block with ``board`` capped; the previous limit is back when it ends, however it ends.

    Yields the cap in force (W), or ``None`` when no cap was asked (nothing is changed then).
    """
    plan = plan_power_caps([board], power_cap_w=power_cap_w, power_cap_fraction=power_cap_fraction, nvml=nvml)
    if not plan:
        yield None
        return
    held, in_force = _hold(nvml or _load_pynvml(), plan[0])
    try:
        yield in_force
    finally:
        held.restore()


class PowerCapPlugin(WorkerPlugin):
    """Caps each worker's board while the worker lives; puts the previous limit back when it stops.

    ``caps`` maps a worker name (``str``) to its board's :class:`BoardCap`, planned and range
    checked by the process that opened the pool. A worker whose name is not in it is left
    alone. The previous limit is restored at teardown (the worker closing) or, failing that,
    at the worker process's exit; a worker killed outright cannot, so the process that opened
    the pool also restores at its exit any board still at the cap.
    """

    idempotent = False

    def __init__(self, caps: Mapping[str, BoardCap]) -> None:
        self.caps = dict(caps)
        self._held: _Held | None = None

    def setup(self, worker: Any) -> None:
        cap = self.caps.get(str(getattr(worker, "name", "")))
        if cap is None:
            return
        self._held, in_force = _hold(_load_pynvml(), cap)
        board = cap.index if cap.index is not None else cap.board
        log.warning("gogh: power limit of %s set to %g W (was %g W, default %g W, allowed %g-%g W) for every "
                    "user of this machine until this worker stops; if it is killed, restore it with "
                    "`sudo nvidia-smi -i %s -pl %g`", cap.label, in_force, cap.restore_w, cap.limits.default_w,
                    cap.limits.min_w, cap.limits.max_w, board, cap.restore_w)

    def teardown(self, worker: Any) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.restore()

    def __getstate__(self) -> dict[str, Any]:
        return {"caps": self.caps, "_held": None}  # what a worker holds stays on that worker


def caps_here() -> dict[str, tuple[int | None, float]]:
    """The caps this process holds (board -> (index, W)): what a worker reports to the pool's opener."""
    with _IN_FORCE_LOCK:
        return dict(_IN_FORCE)


def record_reported(reports: Mapping[str, Mapping[str, tuple[int | None, float]]],
                    boards: Sequence[BoardCap]) -> None:
    """In the pool's opener: remember the caps its workers hold (``client.run(caps_here)``).

    Only ``boards`` (the pool's plan) are taken from the reports, and any of them no worker
    holds is forgotten, so this process says what the pool it opened runs under.
    """
    planned = {cap.board for cap in boards}
    with _IN_FORCE_LOCK:
        for board in planned:
            _IN_FORCE.pop(board, None)
        for held in reports.values():
            _IN_FORCE.update({board: value for board, value in held.items() if board in planned})


@contextmanager
def nvml_at_exit(nvml: ModuleType | None = None) -> Iterator[ModuleType | None]:
    """NVML opened for an exit hook's block, closed after; ``None`` when it cannot be opened
    (no NVML left at exit: the hook has nothing to do)."""
    try:
        nvml = nvml or _load_pynvml()
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - see above
        yield None
        return
    try:
        yield nvml
    finally:
        _shutdown(nvml)


def restore_if_still_capped(boards: Sequence[BoardCap], nvml: ModuleType | None = None) -> None:
    """At the opener's exit: put back any board still at its cap (its worker died without restoring)."""
    with nvml_at_exit(nvml) as nvml:
        if nvml is None:
            return
        for cap in boards:
            try:
                handle = _handle(nvml, cap.board)
                now_mw = nvml.nvmlDeviceGetPowerManagementLimit(handle)
                # within a watt: a driver may round a fractional cap to whole watts
                if abs(now_mw - _mw(cap.cap_w)) <= 1000 and now_mw != _mw(cap.restore_w):
                    restore(nvml, cap)
                    log.info("gogh: power limit of %s restored to %g W at exit", cap.label, cap.restore_w)
                else:
                    _remember(cap, None)
            except Exception as exc:  # noqa: BLE001 - say it, do not hide the program's own outcome
                log.error("gogh: %s", exc)

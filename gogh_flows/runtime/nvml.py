"""NVML access: finding the boards, and sampling one while a run executes.

``pynvml`` (package ``nvidia-ml-py``) is imported only when a function here is
called, so the package imports on machines without a driver. Every NVML
failure is turned into :class:`NvmlUnavailable` with the reason, because the
callers' answer is always the same: fall back, and say why.

NVML enumerates *all* boards whatever ``CUDA_VISIBLE_DEVICES`` says, in an order of its
own, so a board is found by its UUID. An integer a user or a worker gives (a CUDA ordinal,
numbered in ``CUDA_DEVICE_ORDER``) is read in PCI bus order, which is CUDA's with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and said to be a guess on a machine of mixed boards
without it (:func:`_board_for_entry`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gogh_flows.runtime.board import BoardShare, EnergyAt, SharedBoard, join_board, leave_board
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS, StepCounter, TelemetryReading

if TYPE_CHECKING:
    from gogh_flows.energy import EnergyModel

__all__ = ["NvmlBoard", "NvmlSampler", "NvmlUnavailable", "cuda_order", "discover", "list_boards", "load_pynvml",
           "probe", "resolve_cuda_entry"]

log = logging.getLogger("gogh_flows.runtime")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (module, driver or device missing)."""


def load_pynvml() -> ModuleType:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"the pynvml module is not installed ({exc}); install nvidia-ml-py") from exc


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class NvmlBoard:
    """A board as NVML reports it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str = ""  # "00000000:3B:00.0"; "" where NVML does not say


def _pci_bus_id(nvml: ModuleType, handle: Any) -> str:
    try:
        return _text(nvml.nvmlDeviceGetPciInfo(handle).busId).upper()
    except Exception:  # noqa: BLE001 - older drivers and fakes: NVML's index order stands in for it
        return ""


def cuda_order(boards: list[NvmlBoard]) -> list[NvmlBoard]:
    """The boards in the order CUDA numbers them with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    NVML's own enumeration order carries no guarantee; CUDA's default order (FASTEST_FIRST)
    puts the fastest board first and leaves the rest unspecified. On a board of one model
    the two agree in practice; on a mixed one only the PCI order is defined, hence the
    warning where an index is read without it (:func:`resolve_cuda_entry`).
    """
    return sorted(boards, key=lambda b: (b.pci_bus_id or "~", b.index))


def discover(nvml: ModuleType | None = None) -> list[NvmlBoard]:
    """Every board NVML sees (in NVML's order), restricted to ``CUDA_VISIBLE_DEVICES`` when that is set."""
    boards = list_boards(nvml)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return boards
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    mig = [v for v in wanted if v.startswith("MIG-")]
    if mig:
        raise NvmlUnavailable(
            f"CUDA_VISIBLE_DEVICES names MIG instance(s) {', '.join(mig)}: gogh measures and limits whole boards, "
            f"and {_MIG_WHY}, so runs sharing a board through MIG cannot be measured apart. Name whole GPUs "
            "(`nvidia-smi -L`)")
    chosen = []
    for entry in wanted:
        board, guess = _board_for_entry(entry, boards)
        if guess:
            log.warning("gogh: %s", guess)
        if board is not None and board not in chosen:
            chosen.append(board)
    return sorted(chosen, key=lambda b: b.index)


def list_boards(nvml: ModuleType | None = None) -> list[NvmlBoard]:
    """Every board of the machine, as NVML enumerates them (``CUDA_VISIBLE_DEVICES`` plays no part)."""
    nvml = nvml or load_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses; the fake and real modules differ in detail
        raise NvmlUnavailable(f"nvmlInit failed: {type(exc).__name__}: {exc}") from exc
    try:
        boards = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            boards.append(NvmlBoard(i, _text(nvml.nvmlDeviceGetName(h)), _text(nvml.nvmlDeviceGetUUID(h)),
                                    _pci_bus_id(nvml, h)))
    except Exception as exc:
        raise NvmlUnavailable(f"listing devices failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _shutdown(nvml)
    return boards


#: why a MIG instance is refused, wherever one is named
_MIG_WHY = "NVML reports power, energy and limits per board, not per MIG instance"


def _board_for_entry(entry: str, boards: list[NvmlBoard]) -> tuple[NvmlBoard | None, str | None]:
    """The board a ``CUDA_VISIBLE_DEVICES`` entry names, and a warning when that is a guess.

    A UUID names one board (CUDA also takes any unique prefix, ``GPU-8932f937``). An integer
    is a CUDA ordinal, numbered in ``CUDA_DEVICE_ORDER``: read in PCI bus order, which is
    CUDA's order with ``PCI_BUS_ID`` and, on a machine of one GPU model, its default order
    too; on a mixed machine without ``PCI_BUS_ID`` it is a guess, and said to be.
    """
    if entry.startswith("GPU-") and len(entry) > 4:
        hits = [b for b in boards if b.uuid.startswith(entry)]
        return (hits[0], None) if len(hits) == 1 else (None, None)
    if not entry.isdigit():
        return None, None
    ordered = cuda_order(boards)
    i = int(entry)
    if i >= len(ordered):
        return None, None
    guess = None
    if (len({b.name for b in boards}) > 1
            and os.environ.get("CUDA_DEVICE_ORDER", "").strip().upper() != "PCI_BUS_ID"):
        guess = (f"CUDA index {i} is read as the board in PCI bus order ({ordered[i].name}, {ordered[i].uuid}), "
                 "but CUDA's default device order (FASTEST_FIRST) can number a mixed machine's boards "
                 "otherwise, and then NVML would measure and limit another board than the one the runs use. "
                 "Set CUDA_DEVICE_ORDER=PCI_BUS_ID, or name boards by UUID (CUDA_VISIBLE_DEVICES=GPU-...; "
                 "`nvidia-smi -L` lists them)")
    return ordered[i], guess


def resolve_cuda_entry(entry: str, nvml: ModuleType | None = None) -> tuple[str | None, str | None]:
    """The NVML UUID of the board a ``CUDA_VISIBLE_DEVICES`` entry names, and a warning.

    Run on a GPU worker, where NVML lists every board of the machine whatever
    ``CUDA_VISIBLE_DEVICES`` says. ``(None, reason)`` when the entry names no board NVML can
    measure; ``(None, None)`` without NVML (the run's meter says that, once per process).
    """
    entry = entry.strip()
    if entry.startswith("MIG-"):
        return None, (f"the worker is pinned to MIG instance {entry}: {_MIG_WHY}, so its runs cannot be measured "
                      "apart; pin workers to whole GPUs")
    if not entry:
        return None, None
    try:
        boards = list_boards(nvml)
    except NvmlUnavailable:
        return None, None  # no NVML here: the run's meter says so, once per process
    board, guess = _board_for_entry(entry, boards)
    if board is None:
        return None, f"CUDA_VISIBLE_DEVICES entry {entry!r} names none of the {len(boards)} board(s) NVML lists"
    return board.uuid, guess


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - shutting down is best effort
        pass


def _handle(nvml: ModuleType, device: GpuDevice | None) -> Any:
    """The NVML handle of ``device``'s board: by UUID where known, else by the CUDA index it is
    pinned to (read in PCI bus order, :func:`_board_for_entry`), never by NVML's own index."""
    if device is not None and device.uuid:
        return nvml.nvmlDeviceGetHandleByUUID(device.uuid)
    if device is not None and device.cuda_index is not None:
        entry, where = str(device.cuda_index), f"{device.id}'s CUDA index"
    else:  # a worker pinned with CUDA_VISIBLE_DEVICES sees its board first in that list
        entry = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
        where = "this worker's CUDA_VISIBLE_DEVICES entry"
    if entry.startswith("MIG-"):
        raise NvmlUnavailable(resolve_cuda_entry(entry, nvml)[1])
    board, _ = _board_for_entry(entry, list_boards(nvml))
    if board is None:
        raise NvmlUnavailable(f"{where} {entry!r} names no board NVML lists")
    return nvml.nvmlDeviceGetHandleByUUID(board.uuid)


def probe(device: GpuDevice | None, nvml: ModuleType | None = None) -> None:
    """Raise :class:`NvmlUnavailable` unless ``device`` can be sampled through NVML."""
    nvml = nvml or load_pynvml()
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise NvmlUnavailable(f"nvmlInit failed: {type(exc).__name__}: {exc}") from exc
    try:
        _handle(nvml, device)
    except Exception as exc:
        raise NvmlUnavailable(f"no NVML handle for {device.id if device else 'the visible GPU'}: "
                              f"{type(exc).__name__}: {exc}") from exc
    finally:
        _shutdown(nvml)


class NvmlSampler(StepCounter):
    """One run's measurement of its board through NVML, from :meth:`start` to :meth:`stop`.

    The board is sampled by the process's :class:`~gogh_flows.runtime.board.SharedBoard`
    (power every ``interval_s``, plus at every run's start and stop), which splits the
    board's energy between the runs on it. Energy comes from
    ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded; Volta and newer)
    when the board has it and it advanced, otherwise from the trapezoid integral of the
    power samples. Throughput and energy cover the steady-state window (see
    :class:`~gogh_flows.runtime.telemetry.StepWindow`). Metrics the board does not support
    are left ``None``.

    The board's power limit is read when the run starts and again whenever the worker's
    occupancy changes it (:meth:`set_power_limit`); a run alone under one limit gogh set records
    how much the energy model says that limit slowed it against the board's default limit
    (``limit_slowdown``, from the run's predicted power ``power_w``), so the refiner learns its
    rate at full power.
    """

    source = "nvml"

    def __init__(self, device: GpuDevice | None = None, *, interval_s: float = 0.1,
                 nvml: ModuleType | None = None, clock: Callable[[], float] = time.monotonic,
                 warmup_steps: float = DEFAULT_WARMUP_STEPS,
                 power_w: float | None = None, energy: EnergyModel | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        super().__init__(clock=clock, warmup_steps=warmup_steps)
        self.device = device
        self.interval_s = interval_s
        self._nvml = nvml
        self._share = BoardShare(power_w)
        self._board: SharedBoard | None = None
        self._key: Any = None
        self._limit_w: float | None = None
        self._full_w: float | None = None  # the board's default limit: where predictions are of
        self._chosen: list[float | None] = []  # the limits gogh's occupancy set on the board during the run
        self._seen_partners = False
        self._handle: Any = None
        self._energy = energy

    @property
    def board(self) -> SharedBoard | None:
        """The process's sampler of this run's board while the run is on it."""
        return self._board

    def _on_report(self, now: float, opened: bool) -> None:
        if opened:
            self._share.mark("window_start", now)
        self._share.mark("last_report", now)

    def start(self) -> None:
        nvml = self._nvml = self._nvml or load_pynvml()
        nvml.nvmlInit()
        try:
            handle = _handle(nvml, self.device)
        except BaseException:
            _shutdown(nvml)  # NVML counts its inits: a start that fails must not leave one behind
            raise
        # one sampler per board and NVML module (tests give each their own fake): by the board's
        # UUID, since pynvml hands out a new handle object on every lookup
        try:
            board_id: Any = _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception:  # noqa: BLE001 - no UUID: the device we were given names the board
            board_id = (self.device.uuid or self.device.cuda_index or self.device.id) if self.device else "visible"
        self._key = (id(nvml), board_id)
        self._handle = handle
        self._read_limit()
        try:
            self._full_w = nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0
        except Exception:  # noqa: BLE001 - not every board (or fake) reports it
            self._full_w = None
        self._board = join_board(self._key, nvml, handle, self._share, interval_s=self.interval_s,
                                 clock=self._clock)

    def _read_limit(self) -> None:
        """The limit the board runs under (a cap, by gogh or an administrator, changes every figure)."""
        try:
            self._limit_w = self._nvml.nvmlDeviceGetPowerManagementLimit(self._handle) / 1000.0  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - not every board (or fake) reports it
            self._limit_w = None

    def set_power_limit(self, limit_w: float | None) -> None:
        """The worker's occupancy set the board's limit: record the one NVML says is in force."""
        self._chosen.append(limit_w)
        if self._handle is not None:
            before = self._limit_w
            self._read_limit()
            if self._limit_w != before:
                self._limit_changed()

    def _limit_slowdown(self, mean_power_w: float | None) -> float | None:
        """How much the limit gogh set slowed the run, by the energy model, when that can be told:
        the run alone on its board under one limit from start to end, and its board power at the
        default limit predicted. Otherwise ``None`` (a limit gogh did not set, a partner's draw or a
        limit changed mid-run): the refiner then learns the rate as measured, the slow side."""
        chosen = set(self._chosen)
        if (len(chosen) != 1 or None in chosen or self._seen_partners or self._limit_w is None
                or self._full_w is None or self._share.power_w is None or self.device is None):
            return None
        from gogh_flows.energy import EnergyModel

        return (self._energy or EnergyModel()).limit_slowdown(
            self.device.gpu_type, self._share.power_w, self._limit_w, self._full_w, mean_power_w)

    def set_partners(self, partners: tuple[str, ...]) -> None:
        super().set_partners(partners)
        if partners:
            self._seen_partners = True

    def stop(self) -> TelemetryReading:
        if self._board is None:
            raise RuntimeError("NvmlSampler.stop() called before start()")
        leave_board(self._key, self._board, self._share)
        _shutdown(self._nvml)
        share = self._share
        use_counter = share.use_counter

        def run_j(p: EnergyAt) -> float:
            return p.run_counter if use_counter else p.run_integrated

        def board_j(p: EnergyAt) -> float:
            return p.board_counter if use_counter else p.board_integrated

        total = share.total.minus(share.joined)  # type: ignore[arg-type]
        wall = total.t
        powered = share.power_samples > 0 or use_counter  # energy is known from one or the other
        # NVML stopped answering (a lost GPU, a driver fault): stretches no reading covers would
        # count 0 J and the run would look frugal. A counter that came back covers the gap (its
        # next reading spans it); the power integral does not, nor a counter that never returned
        lost_s = share.uncovered_blind_s if use_counter else share.blind_s
        if powered and lost_s > 0:
            log.warning("gogh: NVML gave no power or energy reading on %s for %.1f s of this run's %.1f s (%s); "
                        "its energy and mean power are recorded as unknown rather than under-counted",
                        self.device.id if self.device else "the board", lost_s, wall,
                        share.last_error or "no error text")
            powered = False
        # the mean power is the power samples' integral: with gaps in it, it is not the run's
        whole = powered and share.power_samples > 0 and share.blind_s == 0
        if not powered:
            method = None
        elif use_counter:  # stretches the counter could not give were filled from the power samples
            method = "counter" if not share.filled_stretches else "counter+integrated"
        else:
            method = "integrated" if share.power_samples > 0 else None
        win, timing = self._timing(share.joined.t, share.total.t)  # type: ignore[union-attr]
        common = dict(
            source="nvml", steps=self._steps, max_memory_bytes=share.max_memory,
            mean_utilisation=share.util_sum / share.util_n if share.util_n else None, wall_s=wall,
            energy_method=method, samples=share.power_samples,
            run_energy_j=run_j(total) if powered else None, board_run_energy_j=board_j(total) if powered else None,
            energy_split="+".join(sorted(share.splits)) or "alone", power_limit_w=self._limit_w, **timing,
        )
        # mean power always comes from the power samples: a counter's resolution is too coarse
        # over a short window
        if win is not None:  # the window's ends were marked as the reports came
            start, last = share.at("window_start"), share.at("last_report")
            stretch, before = last.minus(start), start.minus(share.joined)  # type: ignore[union-attr,arg-type]
            mean = stretch.board_integrated / stretch.t if whole and stretch.t > 0 else None
            return TelemetryReading(
                mean_power_w=mean, energy_j=board_j(stretch) if powered else None,
                attributed_energy_j=run_j(stretch) if powered else None,
                startup_energy_j=run_j(before) if powered else None, limit_slowdown=self._limit_slowdown(mean),
                **common)
        mean = total.board_integrated / wall if whole and wall > 0 else None
        return TelemetryReading(
            mean_power_w=mean, energy_j=board_j(total) if powered else None,
            attributed_energy_j=run_j(total) if powered else None, limit_slowdown=self._limit_slowdown(mean),
            **common)

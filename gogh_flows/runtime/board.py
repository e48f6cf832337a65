"""One NVIDIA board's energy, sampled once and split between the runs sharing it.

When two runs shared a board, each sampled it alone and logged the board's whole energy:
the measurement table summed to twice what the board drew. Here a process samples each
board once, whoever runs on it, and divides every stretch's energy (the difference of
NVML's energy counter, or the trapezoid of the sampled power on boards without one)
between the runs present during that stretch. The runs' shares add up to the board's
energy by construction, and the board's figure is kept beside each share.

A run joining or leaving takes a sample at that instant, so the occupants of a stretch
never change inside it. Shares follow each run's power alone: measured, once the run has
been alone on the board for :data:`MIN_ALONE_S`; otherwise the power model's prediction
for it, scaled by how far the model was from this board for the runs measured here (a
board that draws 20% less than predicted for one job likely does for its partner); an
equal split when neither is known.

Each run also marks instants (the opening of its steady-state window, its latest
report); their cumulative energies are interpolated between the samples around them, so
a window's energy is not rounded to the sampling interval.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gogh_flows.runtime")

__all__ = ["BoardShare", "EnergyAt", "MIN_ALONE_S", "SharedBoard", "join_board", "leave_board"]

#: Seconds alone on a board after which a run's measured power alone is its share's weight.
MIN_ALONE_S = 1.0
#: Samples each run keeps to place its marks between (a report can be recorded a little
#: after the sample that followed it was processed).
_HISTORY = 32


@dataclass(frozen=True)
class EnergyAt:
    """Cumulative energies (J) of one run since it joined, at one instant.

    Two accounts are kept side by side: from the energy counter and from integrating the
    sampled power. The counter is used unless the board has none or it never advanced.
    """

    t: float
    run_counter: float = 0.0
    board_counter: float = 0.0
    run_integrated: float = 0.0
    board_integrated: float = 0.0

    def minus(self, other: EnergyAt) -> EnergyAt:
        return EnergyAt(self.t - other.t, self.run_counter - other.run_counter,
                        self.board_counter - other.board_counter, self.run_integrated - other.run_integrated,
                        self.board_integrated - other.board_integrated)

    def between(self, later: EnergyAt, t: float) -> EnergyAt:
        """Linear interpolation at ``t`` between this point and ``later``."""
        span = later.t - self.t
        f = 0.0 if span <= 0 else min(1.0, max(0.0, (t - self.t) / span))

        def lerp(a: float, b: float) -> float:
            return a + f * (b - a)

        return EnergyAt(t, lerp(self.run_counter, later.run_counter), lerp(self.board_counter, later.board_counter),
                        lerp(self.run_integrated, later.run_integrated),
                        lerp(self.board_integrated, later.board_integrated))


class BoardShare:
    """One run's account on a board: its share of every stretch since it joined.

    Written by the board's sampling (under the board's lock); ``mark`` is called from the
    run's own thread and only stores a time.
    """

    def __init__(self, power_w: float | None = None) -> None:
        if power_w is not None and not power_w > 0:
            raise ValueError(f"power_w (predicted power alone) must be > 0 W or None, got {power_w!r}")
        self.power_w = power_w
        self.joined: EnergyAt | None = None
        self.left: EnergyAt | None = None
        self._now = EnergyAt(0.0)
        self._history: deque[EnergyAt] = deque(maxlen=_HISTORY)
        self._marks: dict[str, float] = {}
        self._resolved: dict[str, EnergyAt] = {}
        self.alone_s = 0.0
        self._alone_j = 0.0
        self.counted_stretches = 0  # stretches whose energy the counter gave
        self.filled_stretches = 0  # ... and those it could not (no counter, a failed read)
        #: seconds of the run's stretches with no reading at all (neither the counter nor a power
        #: sample at either end: NVML stopped answering), whose energy is therefore unknown ...
        self.blind_s = 0.0
        #: ... unless the counter came back after them: its next reading spans the gap (the failed
        #: reads moved its base by nothing), so only the blind seconds since its last reading are lost
        self.uncovered_blind_s = 0.0
        self.last_error: str | None = None  # the last NVML error on the board while the run was on it
        self.use_counter = False  # set at leave: whether the board's counter advanced while it was on
        self.power_samples = 0
        self.util_sum = 0.0
        self.util_n = 0
        self.max_memory: int | None = None
        self.splits: set[str] = set()

    # -- what the run asks ------------------------------------------------------------------
    def mark(self, name: str, t: float) -> None:
        """Remember instant ``t`` (the run's clock) under ``name``; resolved at the next samples."""
        self._marks[name] = t

    def at(self, name: str) -> EnergyAt | None:
        """Cumulative energies at mark ``name`` (``None`` if never marked)."""
        t = self._marks.get(name)
        if t is None:
            return None
        hit = self._resolved.get(name)
        if hit is not None and hit.t == t:
            return hit
        return self._interpolate(t)

    @property
    def total(self) -> EnergyAt:
        """Cumulative energies at the run's last sample (its leave, once it left)."""
        return self._now

    @property
    def measured_alone_w(self) -> float | None:
        """The run's mean board power while alone on it in its steady window (start-up draws
        little and would under-weight it), once it was alone there long enough."""
        if self.alone_s < MIN_ALONE_S or not self._alone_j > 0:
            return None
        return self._alone_j / self.alone_s

    # -- what the board does ----------------------------------------------------------------
    def _begin(self, t: float) -> None:
        self._now = self.joined = EnergyAt(t)
        self._history.append(self._now)

    def _add(self, t: float, frac: float, counter_j: float, integrated_j: float, alone: bool, dt: float,
             counted: bool, blind: bool = False) -> None:
        """One stretch ending at ``t``: ``counter_j`` is the counter's difference, or the integrated
        figure where the counter could not be read (``counted`` False), so the account has no gap."""
        prev = self._now
        self._now = EnergyAt(t, prev.run_counter + frac * counter_j, prev.board_counter + counter_j,
                             prev.run_integrated + frac * integrated_j, prev.board_integrated + integrated_j)
        self._history.append(self._now)
        if counted:
            self.counted_stretches += 1
            self.uncovered_blind_s = 0.0
        else:
            self.filled_stretches += 1
        if blind:
            self.blind_s += dt
            self.uncovered_blind_s += dt
        opened = self._marks.get("window_start")
        if alone and opened is not None and opened <= t - dt:
            self.alone_s += dt
            self._alone_j += integrated_j
        for name, mt in list(self._marks.items()):
            hit = self._resolved.get(name)
            if (hit is None or hit.t != mt) and mt <= t:
                self._resolved[name] = self._interpolate(mt)

    def _interpolate(self, t: float) -> EnergyAt:
        points = list(self._history)
        if not points or t <= points[0].t:
            return EnergyAt(t, *_values(points[0] if points else self._now))
        for a, b in zip(points, points[1:]):
            if a.t <= t <= b.t:
                return a.between(b, t)
        return EnergyAt(t, *_values(points[-1]))  # not sampled yet: the latest figures

    def _observe(self, util: float | None, memory: int | None, powered: bool) -> None:
        if powered:
            self.power_samples += 1
        if util is not None:
            self.util_sum += util
            self.util_n += 1
        if memory is not None:
            self.max_memory = memory if self.max_memory is None else max(self.max_memory, memory)


def _values(p: EnergyAt) -> tuple[float, float, float, float]:
    return p.run_counter, p.board_counter, p.run_integrated, p.board_integrated


def _weights(runs: list[BoardShare]) -> tuple[list[float], str]:
    """Each present run's weight in a stretch's energy, and how they were chosen."""
    if len(runs) == 1:
        return [1.0], "alone"
    measured = [r.measured_alone_w for r in runs]
    if all(m is not None for m in measured):
        return [float(m) for m in measured], "measured"  # type: ignore[arg-type]
    ratios = [m / r.power_w for m, r in zip(measured, runs) if m is not None and r.power_w]
    scale = statistics.median(ratios) if ratios else 1.0
    if not scale > 0:
        scale = 1.0
    weights = [m if m is not None else (r.power_w * scale if r.power_w else None) for m, r in zip(measured, runs)]
    known = [w for w in weights if w is not None]
    if len(known) == len(weights):
        return [float(w) for w in known], "model"  # type: ignore[misc]
    return [1.0] * len(runs), "equal"


class SharedBoard:
    """One board of this process: sampled in one thread while any run is on it."""

    def __init__(self, nvml: Any, handle: Any, *, interval_s: float, clock: Callable[[], float]) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self._nvml, self._h, self.interval_s, self._clock = nvml, handle, interval_s, clock
        self._lock = threading.Lock()
        self._runs: list[BoardShare] = []
        self._prev: tuple[float, float | None] | None = None  # (t, W) of the last sample
        self._last_counter: float | None = None  # mJ: the last good counter read, kept over failed reads
        self.counter_advanced = False  # the counter moved since the board was first joined
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: dict[str, str] = {}  # NVML call -> its last error (for what a run says)

    @property
    def runs(self) -> int:
        return len(self._runs)

    def join(self, share: BoardShare) -> None:
        with self._lock:
            t = self._sample_locked()
            share._begin(t)
            self._runs.append(share)
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="gogh-nvml-board",
                                                daemon=True)
                self._thread.start()

    def leave(self, share: BoardShare) -> threading.Thread | None:
        """Close the run's account. When the board is left empty its thread is asked to stop and
        returned (join it outside any lock); ``None`` otherwise."""
        with self._lock:
            try:
                self._sample_locked()
            finally:  # a failed last sample must not leave a ghost occupant taking shares
                self._runs.remove(share)
                share.left = share.total
                share.use_counter = self.counter_advanced
                empty = not self._runs
                thread, self._thread = (self._thread, None) if empty else (None, self._thread)
                if empty:
                    self._stop.set()
                    self._prev = None
                    self._last_counter = None
                    self.counter_advanced = False
        return thread if empty else None

    def sample(self) -> None:
        """Take one sample now (the thread does this every ``interval_s``)."""
        with self._lock:
            if self._runs:
                self._sample_locked()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad sample is skipped; the next one covers its stretch
                log.exception("gogh: sampling a GPU board failed; the next sample covers the stretch")

    def _read(self, call: str) -> Any:
        try:
            return getattr(self._nvml, call)(self._h)
        except Exception as exc:  # NotSupported on some boards; a transient NVML error loses one sample
            self._errors[call] = f"{type(exc).__name__}: {exc}"
            return None

    def _counter_stretch(self, energy_mj: float | None, integrated_j: float) -> tuple[float, bool]:
        """A stretch's energy by the counter (and whether the counter gave it).

        A failed read is filled from the power samples and moves the counter's base by as much,
        so the next good read adds only what the estimate missed: nothing is lost or counted
        twice. A board with no counter at all is measured by its power samples.
        """
        last = self._last_counter
        if energy_mj is None:
            if last is not None:
                self._last_counter = last + integrated_j * 1000.0
            return integrated_j, False
        self._last_counter = energy_mj
        if last is None:
            return integrated_j, False
        diff = (energy_mj - last) / 1000.0
        if diff > 0:
            self.counter_advanced = True
        # below the base: a driver reload restarted the counter, or a filled gap was overestimated
        return max(diff, 0.0), True

    def _sample_locked(self) -> float:
        t = self._clock()
        raw_energy, raw_power = self._read("nvmlDeviceGetTotalEnergyConsumption"), self._read("nvmlDeviceGetPowerUsage")
        energy = None if raw_energy is None else float(raw_energy)
        power = None if raw_power is None else raw_power / 1000.0
        util = self._read("nvmlDeviceGetUtilizationRates")
        mem = self._read("nvmlDeviceGetMemoryInfo")
        util_f = None if util is None else util.gpu / 100.0
        mem_b = None if mem is None else int(mem.used)
        if self._prev is not None and self._runs:
            t0, p0 = self._prev
            dt = max(t - t0, 0.0)
            if p0 is not None and power is not None:
                integrated = (p0 + power) / 2 * dt
            else:
                integrated = (power if power is not None else (p0 or 0.0)) * dt
            stretch, counted = self._counter_stretch(energy, integrated)
            # nothing read at either end of the stretch, and no counter: its energy is unknown, not 0
            blind = p0 is None and power is None and not counted and dt > 0
            weights, how = _weights(self._runs)
            total = sum(weights)
            if not total > 0:
                weights, how, total = [1.0] * len(self._runs), "equal", float(len(self._runs))
            for share, w in zip(self._runs, weights):
                share._add(t, w / total, stretch, integrated, len(self._runs) == 1, dt, counted, blind)
                share.splits.add(how)
                if blind:
                    share.last_error = "; ".join(f"{c}: {e}" for c, e in self._errors.items()) or None
        elif energy is not None:
            self._last_counter = energy  # the base the first stretch is measured from
        for share in self._runs:
            share._observe(util_f, mem_b, power is not None)
        self._prev = (t, power)
        return t


_registry_lock = threading.Lock()
_boards: dict[Hashable, SharedBoard] = {}


def join_board(key: Hashable, nvml: Any, handle: Any, share: BoardShare, *, interval_s: float,
               clock: Callable[[], float]) -> SharedBoard:
    """The process's sampler of board ``key`` (created on first use), with ``share`` on it.

    Finding and joining happen under one lock with :func:`leave_board`, so a run never joins
    a board that its last run is just dropping.
    """
    with _registry_lock:
        board = _boards.get(key)
        if board is None:
            board = _boards[key] = SharedBoard(nvml, handle, interval_s=interval_s, clock=clock)
        board.join(share)
        return board


def leave_board(key: Hashable, board: SharedBoard, share: BoardShare) -> None:
    with _registry_lock:
        try:
            thread = board.leave(share)
        finally:
            if board.runs == 0 and _boards.get(key) is board:
                del _boards[key]
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=max(5.0, 10 * board.interval_s))  # outside the lock: a hung NVML call
        # must not hold up every other run's start and stop

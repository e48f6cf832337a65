"""Emulated GPUs: what a run would have achieved and drawn on a given GPU type.

The emulator lets the whole loop (placement, execution, telemetry, retraining)
run on a laptop or in CI with the same code paths as a real fleet. Its answers
come from the same two sources the optimiser is judged by, so an emulated
measurement is exactly what the truth says:

* throughput: the truth table's isolated figure, or the paired figure for the
  partner sharing the GPU *at that moment*;
* power: :class:`~gogh_flows.energy.EnergyModel` with the job's activity
  (``power_alone``), or both occupants' loads when shared (``power_shared``);
* a board power limit (:meth:`EmulatedMeter.set_power_limit`, set by the placement) slows
  the board's jobs and caps its draw as the energy model's ``at_limit`` predicts.

Time: ``advance(n)`` "runs" ``n`` steps and counts ``n / throughput`` emulated
seconds, sleeping ``time_scale`` times that in wall time (0 = no sleep, so tests
are instant). A body that only calls ``report()`` is measured over wall time,
with the power integrated piecewise as partners come and go.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from gogh_flows.energy import DEFAULT_ACTIVITY, EnergyModel
from gogh_flows.runtime.devices import GpuDevice
from gogh_flows.runtime.telemetry import DEFAULT_WARMUP_STEPS, StepCounter, TelemetryReading
from gogh_flows.truth.table import ThroughputTable

log = logging.getLogger("gogh_flows.runtime")

__all__ = ["EmulatedMeter", "EmulationError", "device_power"]

#: Shared/isolated ratio assumed when the truth has no pair entry for power
#: purposes (each job gets half the GPU); throughput never uses it.
UNKNOWN_PAIR_RATIO = 0.5


class EmulationError(RuntimeError):
    """The emulator cannot run this job here (no truth for it, or it does not fit)."""


def _activity(truth: ThroughputTable | None, job_type: str | None, gpu_type: str) -> float:
    value = truth.activity(job_type, gpu_type) if truth is not None and job_type else None
    return DEFAULT_ACTIVITY if value is None else value


def _ratios(truth: ThroughputTable | None, job: str | None, partner: str | None,
            gpu_type: str) -> tuple[float, float]:
    """(r_job, r_partner) = shared / isolated throughput of each, for the power model."""
    if truth is not None and job and partner and truth.has(job, gpu_type) and truth.has(partner, gpu_type):
        iso_j, iso_k = truth.isolated(job, gpu_type), truth.isolated(partner, gpu_type)
        tj, tk = truth.pair(job, partner, gpu_type)
        if iso_j > 0 and iso_k > 0 and tj > 0 and tk > 0:
            return min(1.0, tj / iso_j), min(1.0, tk / iso_k)
    return UNKNOWN_PAIR_RATIO, UNKNOWN_PAIR_RATIO


def device_power(energy: EnergyModel, truth: ThroughputTable | None, gpu_type: str,
                 job_type: str | None, partners: Sequence[str]) -> tuple[float, float]:
    """(device watts, this job's share of them) with ``partners`` on the same GPU.

    The share splits the device's power in proportion to each job's load
    ``activity * shared/isolated``, the same quantity the energy model adds up.
    """
    if len(partners) > 1:
        raise EmulationError(
            f"the emulator models at most one co-located partner (pairwise data), got {list(partners)}"
        )
    a_j = _activity(truth, job_type, gpu_type)
    if not partners:
        return energy.power_alone(gpu_type, a_j), 1.0
    partner = partners[0]
    a_k = _activity(truth, partner, gpu_type)
    r_j, r_k = _ratios(truth, job_type, partner, gpu_type)
    load_j, load_k = a_j * r_j, a_k * r_k
    watts = energy.power_shared(gpu_type, ((a_j, r_j), (a_k, r_k)))
    share = load_j / (load_j + load_k) if load_j + load_k > 0 else 0.5
    return watts, share


def check_time_scale(time_scale: float) -> None:
    """Wall seconds slept per emulated second: finite and >= 0 (an infinite one advanced no step)."""
    if not 0 <= time_scale < math.inf:
        raise ValueError(f"time_scale must be a finite number >= 0 (0 = do not sleep), got {time_scale!r}")


#: the longest wall-time stretch one ``advance()`` sleeps at one rate (partners, limit) before
#: it looks again, and between which a stopped run's body is interrupted
STRETCH_WALL_S = 0.25


class EmulatedMeter(StepCounter):
    """Emulated progress, time and energy of one run on one emulated GPU.

    Thread-safe: the body reports from its own thread while the pool's
    occupancy tracking calls :meth:`set_partners` from others' threads.
    ``partners`` may be a callable returning the partner job types; it then
    overrides the tracked occupants (for partners the pool does not run).
    """

    source = "emulated"

    def __init__(self, device: GpuDevice, *, job_type: str | None, truth: ThroughputTable | None,
                 time_scale: float = 0.0, energy: EnergyModel | None = None,
                 partners: Callable[[], Sequence[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 warmup_steps: float = DEFAULT_WARMUP_STEPS) -> None:
        check_time_scale(time_scale)
        self.device = device
        self.gpu_type = device.gpu_type
        self.job_type = job_type
        self.truth = truth
        self.time_scale = float(time_scale)
        self.energy = energy or EnergyModel()
        self._override = partners
        self._sleep = sleep
        super().__init__(threading.RLock(), clock=clock, warmup_steps=warmup_steps)
        self._seen: list[str] = []
        self._emulated_s = 0.0
        self._emulated_steps = 0.0  # the steps advance() ran (report()ed ones have no emulated time)
        self._emulated_j = 0.0
        self._emulated_attr_j = 0.0
        self._wall_j = 0.0
        self._wall_attr_j = 0.0
        self._t0: float | None = None
        self._seg_t = 0.0
        self._seg_power = (0.0, 1.0)
        self._window_j: tuple[float, float] | None = None  # (device, attributed) J at the window's opening
        self._last_j = (0.0, 0.0)  # ... and at the latest report
        self._limit: float | None = None  # the board's power limit (None: its maximum)
        self._slow = 1.0  # how much that limit slows the board's jobs now
        self._slow_steps = 0.0  # steps advanced, weighted by the slowdown they ran at

    # -- partners ------------------------------------------------------------------
    @property
    def seen_partners(self) -> tuple[str, ...]:
        """Partner job types seen during an overridden run, in order of first sighting."""
        return tuple(self._seen)

    def _refresh_override(self) -> None:
        if self._override is not None:
            self._set(tuple(self._override()))

    def set_partners(self, partners: tuple[str, ...]) -> None:
        if self._override is None:
            self._set(tuple(partners))

    def _set(self, partners: tuple[str, ...]) -> None:
        with self._lock:
            if partners == self._partners and self._t0 is not None:
                return
            self._close_segment()
            self._partners = partners
            for p in partners:
                if p not in self._seen:
                    self._seen.append(p)
            self._seg_power = self._board_power()

    def set_power_limit(self, limit_w: float | None) -> None:
        """The board's limit changed (a run joined and its placement chose one, or the board emptied)."""
        with self._lock:
            if limit_w == self._limit and self._t0 is not None:
                return
            self._close_segment()
            self._limit = limit_w
            self._seg_power = self._board_power()

    def _board_power(self) -> tuple[float, float]:
        """(board watts, this run's share) now, under the board's limit; sets the slowdown too."""
        watts, share = device_power(self.energy, self.truth, self.gpu_type, self.job_type, self._partners)
        self._slow, capped = self.energy.at_limit(self.gpu_type, watts, self._limit)
        return capped, share

    def _close_segment(self, now: float | None = None) -> None:
        if self._t0 is None:
            return
        now = self._clock() if now is None else now
        watts, share = self._seg_power
        self._wall_j += watts * (now - self._seg_t)
        self._wall_attr_j += watts * share * (now - self._seg_t)
        self._seg_t = now

    def _on_report(self, now: float, opened: bool) -> None:
        self._close_segment(now)
        if opened:
            self._window_j = (self._wall_j, self._wall_attr_j)
        self._last_j = (self._wall_j, self._wall_attr_j)

    # -- the run -------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            self._t0 = self._seg_t = self._clock()
            self._seg_power = self._board_power()
        self._refresh_override()

    def throughput(self) -> float:
        """True steps/s of this job on this GPU type with its current partners."""
        if self.job_type is None:
            raise EmulationError("advance() needs the run's job type: pass job_type=... to GpuPool.submit")
        if self.truth is None:
            raise EmulationError("advance() needs a truth table; the pool was created without one")
        gpu = self.gpu_type
        if not self._partners:
            tput = self.truth.isolated(self.job_type, gpu)  # unknown -> ThroughputLookupError, clear
            if tput <= 0:
                raise EmulationError(
                    f"job type {self.job_type!r} does not fit on a {gpu} (truth {self.truth.source}: "
                    "throughput 0, e.g. out of memory)"
                )
            return tput
        if len(self._partners) > 1:
            raise EmulationError(f"at most one co-located partner is modelled, got {list(self._partners)}")
        self.truth.isolated(self.job_type, gpu)  # a clear error if the job type is unknown
        tput = self.truth.pair(self.job_type, self._partners[0], gpu)[0]
        if tput <= 0:
            raise EmulationError(
                f"{self.job_type!r} and {self._partners[0]!r} do not fit together on a {gpu} "
                f"(truth {self.truth.source} has no positive paired throughput for them)"
            )
        return tput

    def advance(self, steps: float, between: Callable[[], None] | None = None) -> None:
        """Run ``steps`` at the true rate of the board as it is while they run.

        With ``time_scale > 0`` the steps run in stretches of at most :data:`STRETCH_WALL_S` of
        wall time, each at the rate, power and share of the partners and limit of its own
        start, and ``between`` is called between stretches (the body's context raises there
        when the run was asked to stop). One rate for the whole call, fixed when it began, gave
        a body that advanced its work at once its alone rate and the whole board's energy
        however long a partner shared the board with it (that stretch was then counted in the
        partner's row as well), and a cancelled or timed-out run slept on to its last step.
        """
        if not steps >= 0:
            raise ValueError(f"advance() takes a number of steps >= 0, got {steps!r}")
        # A watched run on a limited board is looked at when its warm-up ends, as a real board
        # reporting step by step would be, however many steps one call covers (a body that
        # advances its whole work at once, or the declared work counted at the end): the rest
        # then runs at the limit the guard left, not all of it at one it would have lifted.
        first = self.warmup_steps - self._steps
        if self.watch is not None and self._limit is not None and 0 < first < steps:
            self._advance(first, between)
            steps -= first
        self._advance(steps, between)

    def _advance(self, steps: float, between: Callable[[], None] | None) -> None:
        left = float(steps)
        while True:
            self._refresh_override()
            with self._lock:
                tput = self.throughput() / self._slow
                take = left if self.time_scale <= 0 else min(left, tput * STRETCH_WALL_S / self.time_scale)
                dt = take / tput
                self._slow_steps += self._slow * take
                watts, share = self._seg_power
                self._emulated_s += dt
                self._emulated_steps += take
                self._emulated_j += watts * dt
                self._emulated_attr_j += watts * share * dt
                self._steps += take
                left -= take
            if self.time_scale > 0 and dt > 0:
                self._sleep(dt * self.time_scale)
            # the guard looks after every stretch, as at every report of a real board: a limit a
            # partner's placement lowered mid-call is looked at while lifting it still helps
            if self.watch is not None:
                self.watch(self)
            if left <= 0:
                break
            if between is not None:
                between()

    def rate_now(self) -> float | None:
        """The run's true rate now (partners and limit as they are), once the warm-up is done."""
        with self._lock:
            if self._steps < self.warmup_steps - 1e-9 or self.job_type is None or self.truth is None:
                return None
            return self.throughput() / self._slow

    def stop(self) -> TelemetryReading:
        with self._lock:
            if self._t0 is None:
                raise RuntimeError("EmulatedMeter.stop() called before start()")
            self._close_segment()
            wall = self._seg_t - self._t0
            common = dict(source="emulated", steps=self._steps, max_memory_bytes=None, mean_utilisation=None,
                          wall_s=wall, energy_method="model", power_limit_w=self._limit,
                          limit_slowdown=(self._slow_steps / self._emulated_steps if self._emulated_steps > 0
                                          else self._slow))
            if self._emulated_s > 0:
                duration, energy, attr = self._emulated_s, self._emulated_j, self._emulated_attr_j
                reported = self._steps - self._emulated_steps
                if reported > 1e-9:
                    # steps a body report()ed beside the ones it advance()d have no emulated time: the
                    # rate is the advanced steps' (dividing every step by their time doubled it)
                    log.warning("gogh: this run both advance()d (%g steps, emulated) and report()ed (%g steps) on "
                                "the emulated %s; its rate and energy are the advanced steps' alone, its step count "
                                "both. Use one of the two in a body", self._emulated_steps, reported,
                                self.device.id)
                return TelemetryReading(
                    duration_s=duration, throughput=self._emulated_steps / duration, mean_power_w=energy / duration,
                    energy_j=energy, attributed_energy_j=attr, window="emulated", window_steps=self._emulated_steps,
                    run_energy_j=attr, board_run_energy_j=energy, **common)
            win, timing = self._timing(self._t0, self._seg_t)
            if win is not None:  # _on_report marked the energies when the window opened
                energy = self._last_j[0] - self._window_j[0]
                return TelemetryReading(
                    mean_power_w=energy / win.duration_s, energy_j=energy,
                    attributed_energy_j=self._last_j[1] - self._window_j[1], startup_energy_j=self._window_j[1],
                    run_energy_j=self._wall_attr_j, board_run_energy_j=self._wall_j, **timing, **common)
            return TelemetryReading(
                mean_power_w=self._wall_j / wall if wall > 0 else self._seg_power[0], energy_j=self._wall_j,
                attributed_energy_j=self._wall_attr_j, run_energy_j=self._wall_attr_j,
                board_run_energy_j=self._wall_j, **timing, **common)

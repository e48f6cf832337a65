"""Progress of long work with an ETA: rich's live bars on a terminal, plain lines in a log.

A bar redrawn with ``\\r`` turns a log file into one unreadable line, and silence for ten
minutes looks like a hang; so a terminal gets rich's bars (done/total, elapsed, time left),
anything else a line at every tenth of the way with the same figures (no more than one
every few seconds). One reporter serves
several named tasks (the policies of a simulation, the families of an evaluation).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any


def report_console() -> Any:
    """A rich console for a report's tables: a terminal's own width, else 200 columns.

    Printed into a file or a pipe, rich assumes 80 columns and squeezes a wide table until its
    headers read "violatio..." and "median-f..."; a log or a saved report should keep them whole.
    """
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@dataclass
class _Task:
    total: int
    started: float
    next_line: int = 1  # plain mode: the next tenth (1-10) that prints a line
    last_line: float = 0.0
    rich_id: Any = None


@dataclass
class Progress:
    """``with Progress() as p: p.update("oracle", done, total)``; ``p.callback(name)`` for a (done, total) hook.

    ``live``: rich's bars (default: when ``stream`` is a terminal); otherwise a line per tenth
    of the way, at most one per ``min_interval_s`` (work that ends sooner says only that it ended).
    """

    stream: IO[str] | None = None
    live: bool | None = None
    min_interval_s: float = 5.0
    _tasks: dict[str, _Task] = field(default_factory=dict, init=False)
    _rich: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stream = self.stream if self.stream is not None else sys.stderr
        if self.live is None:
            self.live = bool(getattr(self.stream, "isatty", lambda: False)())

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._rich = RichProgress(TextColumn("{task.description:18s}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      console=Console(file=self.stream), transient=False)
            self._rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def update(self, name: str, done: int, total: int) -> None:
        """``name`` has done ``done`` of ``total`` units."""
        task = self._tasks.get(name)
        if task is None:
            now = time.monotonic()
            task = self._tasks[name] = _Task(total=total, started=now, last_line=now)
            if self._rich is not None:
                task.rich_id = self._rich.add_task(name, total=total)
        if self._rich is not None:
            self._rich.update(task.rich_id, completed=done, total=total)
            return
        tenth = 10 * done // max(total, 1)
        now = time.monotonic()
        if done < total and (tenth < task.next_line or now - task.last_line < self.min_interval_s):
            return
        task.next_line, task.last_line = tenth + 1, now
        elapsed = now - task.started
        left = elapsed * (total - done) / done if done else float("nan")
        eta = f", about {_clock(left)} left" if 0 < done < total else ""
        print(f"{name}: {done}/{total} ({done / max(total, 1):.0%}), {_clock(elapsed)} elapsed{eta}",
              file=self.stream, flush=True)

    def callback(self, name: str):
        """A ``(done, total)`` hook reporting as ``name``."""
        return lambda done, total: self.update(name, done, total)


__all__ = ["Progress"]

"""The measurement table on disk: append in O(1), read with polars' scan, nothing lost or doubled.

The table used to be one parquet file rewritten whole on every append (O(rows) per run:
57 ms at 50k rows, under a lock every writer queued on). Now it is a folder:

``parts/``
    one small parquet file per appended measurement, written to a temporary name and
    renamed in, so a reader never sees half of one;
``segments/``
    parts merged into larger files (level 0: ``PARTS_PER_SEGMENT`` parts; level L+1:
    ``FANOUT`` segments of level L), so a reader opens a few dozen files however long the
    table, and each row is rewritten O(log rows) times over its life;
``keys/``
    one empty file per measurement key (``run_id:gpu_id``), created exclusively
    (``O_CREAT | O_EXCL``): the atomic "is this measurement already logged?" that makes a
    retried hook log nothing twice, without reading the table and without a lock.

An append writes its part *before* it claims its key, so a crash in between leaves a row
without a claim (a retry adds the same row again and readers keep one), never a claim
without a row (which would drop the measurement). Merges write their result before they
delete their inputs, so a crash leaves the same rows twice, which readers also keep once.
Rows with one key are the same measurement (a retried log), so keeping the earliest logged
is exact, with one exception: a *provisional* row (:data:`PROVISIONAL`: a run its placing
process heard nothing from, telemetry ``"none"``) yields to a later row of its key that has
telemetry, the record the run's worker made of the same run (a run given up on a silent
scheduler whose body went on: docs/reliability.md). Such a row claims the key a second time,
``keys/<digest>.final``, so it too is added once; a provisional appender marks the key
``keys/<digest>.provisional`` before it claims it, so a superseding row never finds a
provisional claim unmarked. Only merging takes a lock, and an appender that finds it held goes on.

A table written by an earlier version (one parquet file, given as ``legacy``) is taken in
as a segment the first time the folder is opened.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl
from filelock import FileLock, Timeout

from gogh_flows import durable

log = logging.getLogger(__name__)


class DamagedTableFile(ValueError):
    """A file of a measurement table that polars cannot read (damaged outside gogh: its files
    are written whole, then renamed into place)."""


#: what to do about damaged files, wherever they are met (a read, a merge)
_DAMAGED_TODO = ("Move them out of the folder to read the rest: their rows are then missing from this table "
                 "(each measurement logged to MLflow is kept there as a run)")

#: parts merged into one level-0 segment once there are this many
PARTS_PER_SEGMENT = 64
#: segments of one level merged into one of the next once there are this many
FANOUT = 4
#: reads that may find a merge under them before a reader holds merges off
_OPTIMISTIC_READS = 20


#: (column, value) of a provisional row: one that a row of the same key with telemetry supersedes
PROVISIONAL = ("telemetry", "none")
_FINAL, _MARKED = ".final", ".provisional"


def key_digest(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()


def is_provisional(row: Mapping[str, Any]) -> bool:
    column, value = PROVISIONAL
    return row.get(column) == value


class MeasurementTable:
    """An append-only parquet table keyed by ``key``; see the module docstring for the layout."""

    def __init__(self, root: Path, schema: Mapping[str, pl.DataType], *, legacy: Path | None = None,
                 lock_timeout_s: float = 120.0, parts_per_segment: int = PARTS_PER_SEGMENT,
                 fanout: int = FANOUT) -> None:
        if parts_per_segment < 2 or fanout < 2:
            raise ValueError(f"parts_per_segment and fanout must be at least 2, got {parts_per_segment}, {fanout}")
        self.root = Path(root)
        self.schema = dict(schema)
        self.parts_per_segment = parts_per_segment
        self.fanout = fanout
        self._lock_timeout_s = lock_timeout_s
        for sub in (self.parts_dir, self.segments_dir, self.keys_dir):
            sub.mkdir(parents=True, exist_ok=True)
        if legacy is not None and Path(legacy).exists():
            self._take_in_legacy(Path(legacy))

    @property
    def parts_dir(self) -> Path:
        return self.root / "parts"

    @property
    def segments_dir(self) -> Path:
        return self.root / "segments"

    @property
    def keys_dir(self) -> Path:
        return self.root / "keys"

    def _merge_lock(self, blocking: bool = True) -> FileLock:
        return FileLock(str(self.root / ".merge.lock"), timeout=self._lock_timeout_s if blocking else 0)

    # -- writing ------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """Whether a row of ``key`` is in the table (provisional or not)."""
        return self._key_path(key).exists()

    def settled(self, key: str) -> bool:
        """Whether ``key`` has a row that no later row supersedes (one with telemetry)."""
        path = self._key_path(key)
        if not path.exists():
            return False
        return not path.with_name(path.name + _MARKED).exists() or path.with_name(path.name + _FINAL).exists()

    def append(self, row: Mapping[str, Any]) -> str | None:
        """Add one row: ``"added"`` (its ``key`` not seen before), ``"superseded"`` (it replaces
        the key's provisional row, see the module docstring), or None, adding nothing, when the
        key is there (settled, or the new row is provisional too).

        Cost does not depend on the table's length: one small file written, one key claimed,
        and every ``parts_per_segment`` appends one merge of that many parts.
        """
        key = str(row["key"])
        provisional = is_provisional(row)
        if self.has(key) and (provisional or self.settled(key)):
            return None
        part = self._write(pl.DataFrame([dict(row)], schema=self.schema), self.parts_dir,
                           f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}")
        try:
            if provisional:
                self._mark(key)
            outcome = "added" if self._claim(key) else None
            if outcome is None and not provisional and not self.settled(key):
                outcome = "superseded" if self._claim(key, _FINAL) else None
        except OSError:  # the keys cannot be written: the row is not in the table, nor its file
            part.unlink(missing_ok=True)
            raise
        if outcome is None:
            part.unlink(missing_ok=True)  # another writer logged it first: its row stands
            return None
        if self._count(self.parts_dir) >= self.parts_per_segment:
            try:
                self.compact(blocking=False)
            except (OSError, pl.exceptions.PolarsError) as exc:  # the row is in: merged another time
                log.warning("gogh: merging the measurement table at %s failed (%s); the row is kept, and the "
                            "merge tried again at a later append", self.root, exc)
        return outcome

    def _key_path(self, key: str) -> Path:
        digest = key_digest(key)
        return self.keys_dir / digest[:2] / digest

    def _mark(self, key: str) -> None:
        """Say ``key``'s claim is (about to be) a provisional row's; made before the claim and
        never removed (a provisional writer that loses the claim leaves a mark on a settled row:
        a later row with telemetry is then added beside it, and readers keep one of the two)."""
        path = self._key_path(key)
        path.parent.mkdir(exist_ok=True)
        path.with_name(path.name + _MARKED).touch()

    def _claim(self, key: str, suffix: str = "") -> bool:
        path = self._key_path(key)
        path = path.with_name(path.name + suffix)
        path.parent.mkdir(exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    @staticmethod
    def _write(frame: pl.DataFrame, folder: Path, stem: str) -> Path:
        """Write ``frame`` as ``folder/stem.parquet``, whole or not at all (temporary file, fsync, rename)."""
        final = folder / f"{stem}.parquet"
        with durable.replacing(final) as tmp:
            frame.write_parquet(tmp)
        return final

    @staticmethod
    def _count(folder: Path) -> int:
        with os.scandir(folder) as entries:
            return sum(1 for e in entries if e.name.endswith(".parquet"))

    # -- merging ------------------------------------------------------------------------
    def compact(self, *, blocking: bool = True) -> bool:
        """Merge parts into a segment and full levels of segments upward; False if another process is merging.

        Appenders call it without blocking when the parts pile up; ``blocking=True`` waits
        for the lock (a test, or a user tidying a table by hand).
        """
        lock = self._merge_lock(blocking)
        try:
            lock.acquire()
        except Timeout:
            if blocking:
                raise
            return False
        try:
            parts = sorted(self.parts_dir.glob("*.parquet"))
            if parts:
                self._merge(parts, level=0)
            level = 0
            while True:
                segments = self._segments(level)
                if len(segments) < self.fanout:
                    if level > self._top_level():
                        break
                    level += 1
                    continue
                self._merge(segments, level=level + 1)
                level += 1
        finally:
            lock.release()
        return True

    def _top_level(self) -> int:
        levels = [int(p.name[1:].split("-", 1)[0]) for p in self.segments_dir.glob("L*.parquet")]
        return max(levels, default=0)

    def _segments(self, level: int) -> list[Path]:
        return sorted(self.segments_dir.glob(f"L{level:02d}-*.parquet"))

    def _merge(self, files: list[Path], *, level: int) -> None:
        while True:
            try:
                frame = unique_rows(self._read_files(files, self.schema))
                break
            except FileNotFoundError:
                # only an appender that lost its key's claim removes a file outside the merge lock
                # (its own part: the row is another writer's); merge without it
                kept = [f for f in files if f.exists()]
                if len(kept) == len(files):
                    raise
                files = kept
            except pl.exceptions.PolarsError:
                # a file damaged outside gogh (its files are written whole): merged without it and
                # left where it is, named, so the rest of the table still merges (every append from
                # the 64th part on merged, failed, and the measurement never reached MLflow: a review)
                damaged = _unreadable(files, self.schema)
                if not damaged:
                    raise
                log.warning("gogh: the measurement table at %s has file(s) that cannot be read, left out of its "
                            "merges: %s. %s", self.root, ", ".join(str(p) for p in damaged), _DAMAGED_TODO)
                files = [f for f in files if f not in damaged]
                if not files:
                    return
        self._write(frame, self.segments_dir, f"L{level:02d}-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}")
        for path in files:  # the merged copy is in place first: a crash here only doubles rows
            path.unlink(missing_ok=True)

    def _take_in_legacy(self, legacy: Path) -> None:
        """A one-file table of an earlier version becomes a segment, its keys claimed, the file kept as ``.migrated``."""
        with self._merge_lock():
            if not legacy.exists():
                return  # another process took it in meanwhile
            frame = with_schema(pl.read_parquet(legacy), self.schema)
            if frame.height:
                self._write(unique_rows(frame), self.segments_dir,
                            f"L00-{time.time_ns():020d}-legacy-{uuid.uuid4().hex[:8]}")
                for key in frame.get_column("key").to_list():
                    self._claim(str(key))
            os.replace(legacy, legacy.with_name(legacy.name + ".migrated"))
            log.info("measurement table %s taken into the folder layout %s (the old file is kept as %s.migrated)",
                     legacy, self.root, legacy.name)

    # -- reading ------------------------------------------------------------------------
    def version(self) -> tuple[int, ...]:
        """Changes whenever a row is added or files merged: what a cache of the table keys on."""
        stamps = []
        for folder in (self.parts_dir, self.segments_dir):
            stamps += [folder.stat().st_mtime_ns, self._count(folder)]
        return tuple(stamps)

    def read(self) -> pl.DataFrame:
        """Every row once (the earliest logged of a key), as one polars scan over the folder."""
        return read_table_folder(self.root, self.schema, lock_timeout_s=self._lock_timeout_s)

    @staticmethod
    def _read_files(files: list[Path], schema: Mapping[str, pl.DataType]) -> pl.DataFrame:
        if not files:
            return pl.DataFrame(schema=dict(schema))
        # one scan over every file (half the time of a scan per file); a file written by an
        # earlier version may lack the columns added since: those read as nulls
        return pl.scan_parquet([str(f) for f in files], schema=dict(schema), missing_columns="insert",
                               extra_columns="ignore").collect()


def read_table_folder(root: str | os.PathLike[str], schema: Mapping[str, pl.DataType], *,
                      lock_timeout_s: float = 120.0) -> pl.DataFrame:
    """A table folder's rows, each key once, without creating anything unless merges keep racing it.

    Parts are listed before segments, and the segments again after reading: a merge moves rows
    from parts (or lower segments) into a new segment before deleting its inputs, so a read
    whose segment listing did not change saw every row; otherwise (or when a listed file was
    merged away meanwhile) it reads again. A reader that loses that race ``_OPTIMISTIC_READS``
    times in a row (many writers merging often on a loaded machine) takes the merge lock and
    reads with merges held off, so it is never starved; only then does it create the lock
    file, and a reader not allowed to (a read-only copy, where nothing merges) keeps retrying.
    """
    root = Path(root)
    for attempt in range(_OPTIMISTIC_READS):
        frame = _read_once(root, schema)
        if frame is not None:
            return frame
        time.sleep(0.002 * (attempt + 1))
    try:
        lock = FileLock(str(root / ".merge.lock"), timeout=lock_timeout_s)
        lock.acquire()
    except Timeout:
        raise
    except OSError:  # cannot create the lock file: nobody merges here either
        lock = None
    try:
        for _ in range(_OPTIMISTIC_READS):
            frame = _read_once(root, schema)
            if frame is not None:
                return frame
            time.sleep(0.01)
    finally:
        if lock is not None:
            lock.release()
    raise RuntimeError(f"the measurement table {root} kept changing under a reader {2 * _OPTIMISTIC_READS} times, "
                       "the last ones with merges held off: is something other than gogh-flows deleting its files?")


def _read_once(root: Path, schema: Mapping[str, pl.DataType]) -> pl.DataFrame | None:
    """The rows if no merge moved them while they were read, else None (read again)."""
    parts = sorted((root / "parts").glob("*.parquet"))
    segments = sorted((root / "segments").glob("*.parquet"))
    try:
        frame = unique_rows(MeasurementTable._read_files(segments + parts, schema))
    except FileNotFoundError:  # merged away (or a part that lost its key claim) since listed
        return None
    except pl.exceptions.PolarsError as exc:
        damaged = _unreadable(segments + parts, schema)
        if not damaged:
            return None  # merged away while read: polars says so in its own words
        raise DamagedTableFile(
            f"the measurement table at {root} has {len(damaged)} file(s) that cannot be read ({damaged[0].name}: "
            f"{str(exc).splitlines()[0][:200]}): {', '.join(str(p) for p in damaged[:3])}. {_DAMAGED_TODO}") from None
    if sorted((root / "segments").glob("*.parquet")) != segments:
        return None
    return frame


def _unreadable(files: list[Path], schema: Mapping[str, pl.DataType]) -> list[Path]:
    """The files of ``files`` that exist and polars cannot read, one by one."""
    bad = []
    for f in files:
        try:
            MeasurementTable._read_files([f], schema)
        except FileNotFoundError:
            continue
        except pl.exceptions.PolarsError:
            if f.exists():
                bad.append(f)
    return bad


def with_schema(frame: pl.DataFrame, schema: Mapping[str, pl.DataType]) -> pl.DataFrame:
    """``frame`` with every column of ``schema`` (those added since it was written: empty), in order."""
    missing = [pl.lit(None, dtype=dtype).alias(name) for name, dtype in schema.items() if name not in frame.columns]
    return frame.with_columns(missing).select(list(schema)).cast(dict(schema))


def unique_rows(frame: pl.DataFrame) -> pl.DataFrame:
    """Each key once: the earliest logged (rows with one key are one measurement, logged again),
    a provisional row only where its key has no other."""
    if frame.is_empty():
        return frame
    column, value = PROVISIONAL
    order: list[Any] = ["logged_at"]
    if column in frame.columns:
        order.insert(0, (pl.col(column) == value).fill_null(False))
    return frame.sort(order, nulls_last=True).unique("key", keep="first", maintain_order=True)


__all__ = ["DamagedTableFile", "FANOUT", "PARTS_PER_SEGMENT", "PROVISIONAL", "MeasurementTable", "is_provisional",
           "key_digest",
           "read_table_folder", "unique_rows", "with_schema"]

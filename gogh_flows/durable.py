"""Files written whole and durably: a reader never sees half of one, and a power loss after the
write returns leaves the whole file under its name, not an empty one or none.

A temporary file renamed into place is atomic for other processes, but without ``fsync`` the
rename can reach the disk before the data, and a machine that loses power then keeps an empty
file under the final name (a concurrency review: a spooled measurement would be set aside as
unreadable, a features file would fail every retraining); and until the folder is synced the
rename itself may be lost. The measurement table's parquet parts and the JSON files beside them
are written here.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; once written, it replaces ``path`` whole (the
    file synced, renamed, the folder synced). Nothing is left behind if writing fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all (see :func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform that cannot open a folder (Windows): its renames are durable there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a folder: the file itself is synced
    finally:
        os.close(fd)


__all__ = ["replacing", "write_text"]

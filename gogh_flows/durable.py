"""Small files written whole and durably: a reader never sees half of one, and a power loss
after the write returns leaves the whole file, not an empty one.

A temporary file renamed into place is atomic for other processes, but without ``fsync`` the
rename can reach the disk before the data, and a machine that loses power then keeps an empty
file under the final name (a concurrency review: a spooled measurement would be set aside as
unreadable, a features file would fail every retraining). The table's parquet parts were
written this way already (``tracking.table``); these are the JSON files beside them.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all (a unique temporary name, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["write_text"]

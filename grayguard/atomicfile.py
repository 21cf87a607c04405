"""Replace a file's content atomically: a reader sees the old text or the new one, never a mix, even after a crash."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, prefix: str | None = None, sync_dir: bool = False) -> None:
    """Write text to a temporary file beside path, fsync it, and rename it over path (the temporary file is removed
    on any error). sync_dir: also fsync the directory, so that the rename itself survives a power cut."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)

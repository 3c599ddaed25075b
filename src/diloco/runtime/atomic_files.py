"""A file replaced whole or not at all: written beside itself, synced, renamed into place,
its directory synced. The one way the library writes a file a crash must not leave half
written (the syncer's state files, exported tensors)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"
"""Files written under this suffix and renamed into place once synced to disk."""


def fsync_dir(path: Path) -> None:
    """fsync a directory (a rename or a new file in it reaches the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically_with(
    path: Path,
    write: Callable[[BinaryIO], object],
    *,
    tmp: Path | None = None,
    fence: Callable[[], None] | None = None,
) -> None:
    """Make what ``write(file)`` writes the content of ``path``, whole or not at all: written
    to ``tmp`` (by default ``path`` + ``TMP_SUFFIX``) beside it, fsynced, renamed over
    ``path``, then the directory fsynced. ``fence`` (``diloco.syncer.fencing.Claim.check``)
    is called just before the rename, which it refuses by raising, and again just after it,
    to say that a rename landed when it no longer should have. Raises ``OSError`` (disk
    full, I/O error, a failed fsync) with ``path`` as it was and no temporary file left."""
    tmp = tmp or path.with_name(path.name + TMP_SUFFIX)
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if fence is not None:
            fence()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fence is not None:
        fence()
    fsync_dir(path.parent)

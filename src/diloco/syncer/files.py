"""Writing the syncer's state directory safely: whole files or nothing, appends that are all
written or report why, and the errors a state directory raises (``StateError``, and
``SyncFailed`` for an ``fsync`` that failed). Shared by the fragment store, the commit
journal, the receipt log, the generation file and the claim."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from diloco.runtime.atomic_files import TMP_SUFFIX, fsync_dir, replace_atomically_with

__all__ = [
    "TMP_SUFFIX",
    "StateError",
    "SyncFailed",
    "fsync_dir",
    "replace_atomically",
    "write_all",
]


class StateError(RuntimeError):
    """The state directory is unusable (corrupt file, other model); the message says which."""


class SyncFailed(OSError):
    """An ``fsync`` failed, so what was written since the file's last good ``fsync`` may
    never reach the disk, and no later ``fsync`` can tell: after a failed writeback the kernel
    may mark the pages clean (or drop them) and report the error once, so a second ``fsync``
    succeeds for data that was never written ("fsyncgate"). Never retried as an I/O error
    is: the committer fails the syncer at once, and its restart rebuilds from the fragment
    files, each written whole and synced before its rename (``replace_atomically``)."""

    @classmethod
    def of(cls, path: Path, exc: OSError) -> SyncFailed:
        return cls(
            exc.errno,
            f"fsync of {path} failed ({exc.strerror or exc}): what was "
            "written since its last fsync may never reach the disk",
        )


def write_all(fd: int, data: bytes, path: Path) -> None:
    """Write all of ``data`` to ``fd`` (the file at ``path``), however short each write;
    ``OSError`` (ENOSPC when the disk takes no more) if it cannot."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, f"could not write {path}")
        view = view[written:]


def _write_into(file: BinaryIO, data: bytes) -> None:
    """Write ``data`` into the file being replaced (``replace_atomically``)."""
    file.write(data)


def replace_atomically(
    path: Path, data: bytes, *, tmp: Path | None = None, fence: Callable[[], None] | None = None
) -> None:
    """Make ``data`` the content of ``path``, whole or not at all
    (``diloco.runtime.atomic_files.replace_atomically_with``: ``tmp`` beside it, ``fence``
    around the rename). Raises ``OSError`` (disk full, I/O error) with ``path`` as it was
    and no temporary file left."""
    replace_atomically_with(path, lambda file: _write_into(file, data), tmp=tmp, fence=fence)

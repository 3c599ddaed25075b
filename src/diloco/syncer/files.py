"""Writing the syncer's state directory safely: whole files or nothing, appends that are all
written or report why, and the errors a state directory raises (``StateError``, and
``SyncFailed`` for an ``fsync`` that failed). Shared by the fragment store, the commit
journal, the receipt log, the generation file and the claim."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path


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


def fsync_dir(path: Path) -> None:
    """fsync a directory (a rename or a new file in it reaches the disk)."""
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes, path: Path) -> None:
    """Write all of ``data`` to ``fd`` (the file at ``path``), however short each write;
    ``OSError`` (ENOSPC when the disk takes no more) if it cannot."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, f"could not write {path}")
        view = view[written:]


def _write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it; ``OSError`` (disk full, I/O
    error) if any of it could not be written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data, path)
        os.fsync(fd)
    finally:
        os.close(fd)


TMP_SUFFIX = ".tmp"
"""Files written under this suffix and renamed into place once synced to disk."""


def replace_atomically(
    path: Path, data: bytes, *, tmp: Path | None = None, fence: Callable[[], None] | None = None
) -> None:
    """Make ``data`` the content of ``path``, whole or not at all: written to ``tmp`` (by
    default ``path`` + ``TMP_SUFFIX``) beside it, fsynced, renamed over ``path``, then the
    directory fsynced. ``fence`` (``diloco.syncer.fencing.Claim.check``) is called just
    before the rename, which it refuses by raising, and again just after it, to say that a
    rename landed when it no longer should have. Raises ``OSError`` (disk full, I/O error)
    with ``path`` as it was and no temporary file left."""
    tmp = tmp or path.with_name(path.name + TMP_SUFFIX)
    try:
        _write_synced(tmp, data)
        if fence is not None:
            fence()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fence is not None:
        fence()
    fsync_dir(path.parent)

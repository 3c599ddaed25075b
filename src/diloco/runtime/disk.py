"""A real filesystem that fills up: a small tmpfs to mount, fill to the last byte and free.

The syncer's disk failures are tested on one (``tests/test_syncer_failures.py``, the torture
run of ``diloco.launch.torture``): a write to a full tmpfs fails with ``ENOSPC`` exactly as
on a real disk. Mounting needs root.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class SmallDisk:
    """A tmpfs of ``size_bytes`` mounted at ``path`` (created; root only)."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(self.path)],
            check=True,
        )
        self._filler = self.path / ".filler"

    def fill(self) -> None:
        """Write zeros until the disk is full (ENOSPC), to the last byte."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = 1 << 20
            while size:
                try:
                    if os.write(fd, bytes(size)) < size:
                        size //= 2
                except OSError:
                    size //= 2
        finally:
            os.close(fd)

    def pad(self, path: Path) -> None:
        """Fill the last block of an existing file with newlines (a full disk still takes
        appends that fit the file's last block): its next append fails too."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            while os.write(fd, b"\n"):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)

    def unmount_keeping_files(self) -> None:
        """Free the disk, copy what it holds aside, unmount it and put the copy back at
        ``path`` (a plain directory then): what was written there outlives the mount."""
        import shutil
        import tempfile

        self.free()
        aside = Path(tempfile.mkdtemp(prefix=".kept-", dir=self.path.parent))
        try:
            shutil.copytree(self.path, aside, dirs_exist_ok=True)
            self.unmount()
            shutil.copytree(aside, self.path, dirs_exist_ok=True)
        finally:
            shutil.rmtree(aside, ignore_errors=True)

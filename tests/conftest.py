"""Settings of the test process itself, and the fixtures several test modules share.

Many tests run several in-process learners (threads) beside a syncer on a 2-core machine;
one torch thread per process keeps them from oversubscribing the cores (the Learner leaves
the thread count to its user, see ``LearnerConfig.cpu_threads``)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.02):
    """Poll ``condition`` until it returns something true (returned) or ``timeout`` seconds
    pass (``AssertionError``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {condition}")
        time.sleep(interval)


class SmallDisk:
    """A real filesystem of a few MiB (a tmpfs) that a test can fill up and free again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / ".filler"

    def fill(self) -> None:
        """Write zeros until the disk is full (ENOSPC), to the last byte."""
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = 1 << 16
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


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted in the test's directory (root only; skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield SmallDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)

"""Settings of the test process itself, and the fixtures several test modules share.

Many tests run several in-process learners (threads) beside a syncer on a 2-core machine;
one torch thread per process keeps them from oversubscribing the cores (the Learner leaves
the thread count to its user, see ``LearnerConfig.cpu_threads``)."""

from __future__ import annotations

import os

import pytest
import torch

from diloco.runtime.disk import SmallDisk

torch.set_num_threads(1)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted in the test's directory (root only; skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    disk = SmallDisk(tmp_path / "small-disk", 4 << 20)
    try:
        yield disk
    finally:
        disk.unmount()


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple[str, str]]:
    """What the test's code asks of the disk from now on, in order: ``("fsync", path)`` for
    each ``os.fsync`` (the path its descriptor names) and ``("replace", source)`` for each
    ``os.replace``; both still happen."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events

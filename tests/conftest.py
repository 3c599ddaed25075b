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

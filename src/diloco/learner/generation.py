"""A learner process's generation (the fencing number it joins with), monotonic across the
processes of one work directory.

The syncer refuses for good a join whose generation is lower than one it saw for the id
(``diloco.syncer.generations``), so a replacement must have a larger generation than the
process it replaces, a zombie perhaps still running. The wall clock alone does not promise
it: a clock stepped back between two starts (NTP, a VM resumed from a snapshot) gives the
replacement the lower number, and the replacement, not the zombie, is refused. So a learner
with a work directory takes its generation from a counter kept there
(``GENERATION_FILE``): under an exclusive ``flock`` on the file, the larger of the last one
taken plus one and the wall clock in nanoseconds (``following_generation``), written back and
fsynced before it is used. Processes that share the directory (restarts of one learner, on
one host or over a filesystem whose locks work) never take the same or a lower one.
"""

from __future__ import annotations

import fcntl
import os
import time

GENERATION_FILE = "generation"
"""The file of a learner's work directory holding the last generation taken there."""
_WIDTH = 20
"""Digits the file holds (2^64 has 20): always written whole at offset 0, same length."""
MAX_GENERATION = 2**64 - 1
"""The largest generation a join may carry (``JoinRequest.generation`` is a uint64)."""


def following_generation(last: int, wall_ns: int) -> int:
    """The generation after ``last`` (0: none taken yet) at wall time ``wall_ns``: above
    ``last`` whatever the clock says, and the clock's reading when it is ahead. Pure.

    >>> following_generation(0, 1_000), following_generation(5_000, 1_000)
    (1000, 5001)
    """
    following = max(last + 1, wall_ns, 1)
    if following > MAX_GENERATION:
        raise ValueError(f"the generation counter is exhausted ({last})")
    return following


def next_generation(path: str | os.PathLike) -> int:
    """Take the next generation from the counter at ``path`` (created if missing) and
    persist it before returning it (see the module docstring). Unreadable contents count as
    no generation taken yet (the wall clock then decides). ``OSError`` when the file cannot
    be opened, locked or written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        text = os.pread(fd, _WIDTH + 1, 0).decode(errors="replace").strip()
        last = int(text) if text.isdigit() else 0
        generation = following_generation(last, time.time_ns())
        os.pwrite(fd, f"{generation:0{_WIDTH}d}\n".encode(), 0)
        os.fsync(fd)
        return generation
    finally:
        os.close(fd)  # (drops the lock)

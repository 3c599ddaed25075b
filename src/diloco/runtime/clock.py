"""The two clocks every process reads, each through one function.

Decisions (leases, ticks, grace windows, deadlines, rates) use :func:`monotonic`: it never
steps, so an NTP correction or a VM that resumes after a pause cannot stop the syncer's
clock for the length of the step or keep a dead learner live. What is written for people and
for other processes (the tape's ``t``, a progress file) carries wall time, :func:`wall`, or
:func:`wall_of`, the wall time of a monotonic reading taken a moment ago.
"""

from __future__ import annotations

import os
import time

WALL_OFFSET_FILE_ENV = "DILOCO_WALL_CLOCK_OFFSET_FILE"
"""Fault injection (the torture run's clock step, ``diloco.launch.torture``): the name of a
file holding seconds added to this process's wall clock, read again whenever it changes. A
wall-clock step without root or a faked libc; decisions, on the monotonic clock, never see
it."""
_offset_seen: tuple[int, float] = (-1, 0.0)


def _wall_offset() -> float:
    """The injected wall-clock offset (0 without ``WALL_OFFSET_FILE_ENV``)."""
    global _offset_seen
    path = os.environ.get(WALL_OFFSET_FILE_ENV)
    if not path:
        return 0.0
    try:
        changed = os.stat(path).st_mtime_ns
        if changed != _offset_seen[0]:
            with open(path) as f:
                _offset_seen = (changed, float(f.read().strip() or 0.0))
    except (OSError, ValueError):
        return _offset_seen[1]
    return _offset_seen[1]


def monotonic() -> float:
    """Seconds on a clock that never steps (``time.monotonic``); only differences mean
    anything. Every decision takes its ``now`` from here."""
    return time.monotonic()


def wall() -> float:
    """Seconds since the epoch (``time.time``, plus an injected step, ``WALL_OFFSET_FILE_ENV``):
    for records only, never for a decision."""
    return time.time() + _wall_offset()


def wall_of(monotonic_s: float) -> float:
    """The wall time of the monotonic reading ``monotonic_s``: the wall clock now, less the
    monotonic time since that reading (a record stamped when it is made, from the ``now`` its
    decision used). After a wall-clock step the records follow the stepped wall clock."""
    return wall() - (time.monotonic() - monotonic_s)

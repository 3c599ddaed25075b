"""The two clocks every process reads, each through one function.

Decisions (leases, ticks, grace windows, deadlines, rates) use :func:`monotonic`: it never
steps, so an NTP correction or a VM that resumes after a pause cannot stop the syncer's
clock for the length of the step or keep a dead learner live. What is written for people and
for other processes (the tape's ``t``, a progress file) carries wall time, :func:`wall`, or
:func:`wall_of`, the wall time of a monotonic reading taken a moment ago.
"""

from __future__ import annotations

import time


def monotonic() -> float:
    """Seconds on a clock that never steps (``time.monotonic``); only differences mean
    anything. Every decision takes its ``now`` from here."""
    return time.monotonic()


def wall() -> float:
    """Seconds since the epoch (``time.time``): for records only, never for a decision."""
    return time.time()


def wall_of(monotonic_s: float) -> float:
    """The wall time of the monotonic reading ``monotonic_s``: the wall clock now, less the
    monotonic time since that reading (a record stamped when it is made, from the ``now`` its
    decision used). After a wall-clock step the records follow the stepped wall clock."""
    return time.time() - (time.monotonic() - monotonic_s)

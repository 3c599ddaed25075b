"""The learners' pace as the syncer measures it, and how much of a claimed pace it believes.

A learner's step time (``steps_per_s`` in its heartbeats, ``step_time_s`` in its uploads) is
its own claim, and so are its step counter and the steps an upload says it covers. Believed
as sent, one claim of 1e9 steps/s set the syncer's tick to 1 ms (every fragment asked of
every learner at every step), and a delta claiming 2^24 steps passed the norm guard's
step-scaled bounds. So the syncer measures on its own clock:

- **a learner's measured step time** (``StepPace``): the syncer's time between two of the
  learner's heartbeats (at least ``PACE_SPAN_S`` apart) over the advance of the step counter
  they carry; the median of its last ``PACE_SAMPLES`` such intervals, once it holds
  ``PACE_MIN_SAMPLES`` of them, so one message (a counter that jumps) cannot move it far;
- **the fleet's**: the lower median of the live learners' measured times
  (``rounds.fleet_step_time``).

A claimed step time is clamped to ``[m / MAX_SPEEDUP, m · MAX_SPEEDUP]`` around the
learner's measured time ``m``, or the fleet's while it has none (``believed_step_s``): the
clock's pace (``ξ_step``) comes from those clamped claims. The norm guard believes no claim
at all: a learner is credited with at most ``MAX_SPEEDUP`` times its measured pace, itself
taken as at most ``MAX_SPEEDUP`` times the fleet's (``fastest_step_s``), over the time since
its steps can have begun (``steps_since``). Pure functions and small records; every time is
the syncer's clock, passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.algorithm.guard import MAX_SPEEDUP

PACE_SAMPLES = 9
"""Intervals a learner's measured step time is the median of."""
PACE_MIN_SAMPLES = 3
"""Intervals a learner needs before it has a measured step time (a median of 3 is not moved
by one of them: a counter restored from a checkpoint, a jump)."""
PACE_SPAN_S = 0.5
"""An interval spans at least this long on the syncer's clock: heartbeats (1 s apart) each
close one, a flood of messages closes no more."""
MIN_STEP_S = 1e-3
"""The fastest step the norm guard credits anyone with (when nobody has a measured pace yet);
the syncer's clock ticks no faster either (``rounds.MIN_TICK_S``)."""


@dataclass
class StepPace:
    """A learner's step time as the syncer's clock sees its step counter advance."""

    mark: tuple[float, int] | None = None
    """(time, counter) where the interval being measured began."""
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=PACE_SAMPLES))

    def observe(self, now: float, step: int) -> None:
        """A message of the learner carrying its step counter ``step`` arrived at ``now``.
        An interval closes once it spans ``PACE_SPAN_S`` and the counter advanced; a counter
        that went back (a restart) or a clock that did starts a new interval."""
        if self.mark is None or step < self.mark[1] or now < self.mark[0]:
            self.mark = (now, step)
            return
        began, counted = self.mark
        if step == counted or now - began < PACE_SPAN_S:
            return
        self.samples.append((now - began) / (step - counted))
        self.mark = (now, step)

    def restart(self) -> None:
        """A new session: its counter may start anywhere; the samples so far still hold."""
        self.mark = None

    @property
    def step_s(self) -> float | None:
        """The measured step time (seconds), ``None`` before ``PACE_MIN_SAMPLES`` intervals."""
        if len(self.samples) < PACE_MIN_SAMPLES:
            return None
        return statistics.median(self.samples)


def believed_step_s(claimed: float, measured: float | None, fleet: float | None) -> float:
    """The step time the clock takes from a learner's ``claimed`` one: clamped to a factor
    ``MAX_SPEEDUP`` around its ``measured`` step time, or around the ``fleet``'s measured one
    while it has none; the claim itself while nobody has one.

    >>> believed_step_s(1e-9, 0.1, None), believed_step_s(3000.0, None, 0.1)
    (0.025, 0.4)
    >>> believed_step_s(0.12, 0.1, 0.5), believed_step_s(1e-9, None, None)
    (0.12, 1e-09)
    """
    reference = measured if measured is not None else fleet
    if reference is None:
        return claimed
    return min(max(claimed, reference / MAX_SPEEDUP), reference * MAX_SPEEDUP)


def fastest_step_s(measured: float | None, fleet: float | None) -> float:
    """The shortest step time the norm guard credits a learner with: ``MAX_SPEEDUP`` times
    faster than its ``measured`` step time (the ``fleet``'s while it has none), which itself
    counts as at most ``MAX_SPEEDUP`` times faster than the fleet's; never under
    ``MIN_STEP_S``. No claim enters it.

    >>> fastest_step_s(0.1, 0.1), fastest_step_s(1e-9, 0.1), fastest_step_s(None, None)
    (0.025, 0.00625, 0.001)
    """
    pace = measured if measured is not None else fleet
    if pace is None:
        return MIN_STEP_S
    if fleet is not None:
        pace = max(pace, fleet / MAX_SPEEDUP)
    return max(pace / MAX_SPEEDUP, MIN_STEP_S)


def steps_since(base_committed_at: float | None, first_joined_at: float) -> float:
    """When the steps of a learner's next delta of a fragment can have begun, on the
    syncer's clock: the commit of the version its previous accepted delta of the fragment
    was taken against (``base_committed_at``; it cut that delta holding the version, and
    every step of the next one came after the cut), else its first join.

    Not the commit of the new delta's own base version: a learner keeps its undelivered
    progress when it applies a newer version (docs/algorithm.md, "Learner side"), so a delta
    against a version committed a moment ago may hold steps trained long before it. A version
    this syncer did not commit (the one it started from) has no time: the join is taken.
    """
    return first_joined_at if base_committed_at is None else base_committed_at


class CommitTimes:
    """When this syncer committed each fragment's last ``keep`` versions (``steps_since``):
    the versions a delta it still admits may be taken against."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._at: dict[int, dict[int, float]] = {}

    def note(self, fragment: int, version: int, now: float) -> None:
        """``fragment``'s ``version`` was committed at ``now``."""
        times = self._at.setdefault(fragment, {})
        times[version] = now
        for old in [v for v in times if v <= version - self.keep]:
            del times[old]

    def at(self, fragment: int, version: int) -> float | None:
        """When ``version`` of ``fragment`` was committed; ``None``: not by this syncer, or
        too long ago."""
        return self._at.get(fragment, {}).get(version)


class FleetPace:
    """The fleet's measured step time, measured again at most every ``PACE_SPAN_S`` (the
    learners' own move no faster): every heartbeat and upload asks for it, and measuring
    looks at every learner."""

    def __init__(self) -> None:
        self._measured: tuple[float, float | None] | None = None  # (when, step time)

    def step_s(self, now: float, measure: Callable[[], float | None]) -> float | None:
        """The fleet's step time at ``now``: ``measure()``'s, or the one taken less than
        ``PACE_SPAN_S`` before."""
        if self._measured is None or not 0 <= now - self._measured[0] < PACE_SPAN_S:
            self._measured = (now, measure())
        return self._measured[1]

"""Upload pacing: a learner on a slow link sends less, and only it slows down.

On the syncer's clock (the default; on the learners' own schedule, which synchronous
DiLoCo's lockstep uses, every due fragment is sent) the learner measures its own link:
every upload's payload bytes over the time its Upload call took (request sent to reply
received), averaged (:class:`UploadMeter`). What is waiting to go out (the queued and
in-flight uploads) divided by that rate is its **backlog** in seconds. When the syncer asks
for a fragment while the backlog would take longer than ``lag_steps`` of the learner's own
steps to drain, answering now would only queue a delta that reaches the syncer
rounds late; the learner **defers** instead: it keeps that fragment's progress (nothing is
lost: the next answer carries it, together with the steps trained meanwhile) and answers a
later request. That is a longer period for that fragment on that learner, and bytes spent
on fresh rather than stale deltas. A fragment is deferred at most ``max_stretch - 1`` times
in a row, so its period never exceeds ``max_stretch × H`` (the user's bound); with
``max_stretch = 1`` pacing is off.

Deferral is said where a user looks: the learner's heartbeat state (``training, link
behind``: the live view and the syncer's status) and its progress file (``deferred`` in
every record, ``up_rate_Bps`` in the exit record). Pure but for the meter's state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from diloco.wire.protocol import syncer_upload_deadline_s

DEFAULT_MAX_STRETCH = 4
"""A fragment's period on a slow link is at most this many times H."""
DEFAULT_LAG_STEPS = 8.0
"""Defer while the upload backlog would take longer than this many of the learner's steps."""
DOWNLINK_BEHIND_VERSIONS = 2
"""A learner that lacks this many versions or more of some fragment (what it holds and what
has arrived, against the syncer's version in a heartbeat's reply) says its downlink is
behind."""


def versions_missing(current: int, held: int) -> int | None:
    """How many versions of a fragment the learner lacks against the syncer's ``current``
    (``None``: it holds none and waits for a keyframe, which says nothing about its link)."""
    return max(0, current - held) if held >= 0 else None


class UploadMeter:
    """The learner's upload rate (payload bytes per second), measured on its own uploads:
    an exponential average of bytes and of seconds per upload (so tiny uploads, mostly round
    trip, barely move it), counting the upload in flight for as long as it has been in flight
    (so a link that delivers nothing shows a falling rate, not an unknown one)."""

    def __init__(self, decay: float = 0.7, clock=time.monotonic) -> None:
        self.decay = decay
        self.clock = clock
        self._lock = threading.Lock()
        self._bytes = 0.0
        self._seconds = 0.0
        self._in_flight: tuple[int, float] | None = None  # (bytes, since)

    def began(self, nbytes: int) -> None:
        """An upload of ``nbytes`` went on the wire."""
        with self._lock:
            self._in_flight = (nbytes, self.clock())

    def ended(self, delivered: bool) -> None:
        """The upload in flight was answered (``delivered``) or failed (not counted)."""
        with self._lock:
            flown, self._in_flight = self._in_flight, None
        if flown is not None and delivered:
            self.record(flown[0], self.clock() - flown[1])

    def record(self, nbytes: int, seconds: float) -> None:
        """One delivered upload of ``nbytes`` that took ``seconds``."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._bytes = self.decay * self._bytes + nbytes
                self._seconds = self.decay * self._seconds + seconds

    @property
    def rate_Bps(self) -> float | None:  # noqa: N802 - bytes, not bits
        with self._lock:
            b, s = self._bytes, self._seconds
            if self._in_flight is not None:
                b, s = b + self._in_flight[0], s + self.clock() - self._in_flight[1]
            return b / s if s > 0 and b > 0 else None


UPLOAD_RATE_SHARE = 0.25
"""An upload's deadline allows for the link carrying this share of the rate measured on it
(four times the expected time: other traffic, a rate that fell)."""


def upload_deadline_s(nbytes: int, rate_Bps: float | None, base_s: float) -> float:  # noqa: N803
    """How long an upload of ``nbytes`` payload bytes may take before the learner gives up on
    it (and sends it again): ``base_s`` (the link's ``rpc_timeout_s``), or longer for a big
    upload on a slow link: its bytes at ``UPLOAD_RATE_SHARE`` of the rate measured on this
    link's uploads, at most the syncer's own deadline for it
    (``diloco.wire.protocol.syncer_upload_deadline_s``: past it the syncer cancels the
    upload anyway), which is also the deadline before any rate is measured. With a fixed
    deadline a 22 MB int4 fragment (1B parameters, P = 24) on 5 Mbit/s (35 s) was given up
    at 30 s, every time. Pure."""
    syncers = syncer_upload_deadline_s(nbytes)
    need = nbytes / (UPLOAD_RATE_SHARE * rate_Bps) if rate_Bps else syncers
    return max(base_s, min(need, syncers))


def backlog_seconds(backlog_bytes: int, rate_Bps: float | None) -> float:  # noqa: N803
    """How long the queued uploads take to drain at the measured rate (0 before any upload:
    nothing is known yet, nothing is deferred). Pure."""
    if not rate_Bps or backlog_bytes <= 0:
        return 0.0
    return backlog_bytes / rate_Bps


@dataclass(frozen=True)
class Pace:
    """The user's bounds: ``max_stretch`` (1: off) and the lag budget in learner steps."""

    max_stretch: int = DEFAULT_MAX_STRETCH
    lag_steps: float = DEFAULT_LAG_STEPS

    def __post_init__(self) -> None:
        if self.max_stretch < 1 or not self.lag_steps > 0:
            raise ValueError(
                f"pacing needs max_stretch >= 1 and lag_steps > 0 "
                f"(got {self.max_stretch}, {self.lag_steps})"
            )

    def defer(self, backlog_s: float, step_s: float | None, deferred_in_row: int) -> bool:
        """Whether to defer a request: the backlog exceeds ``lag_steps`` of this learner's
        steps, and the fragment has been deferred fewer than ``max_stretch - 1`` times in a
        row. Pure."""
        if self.max_stretch <= 1 or not step_s:
            return False
        return backlog_s > self.lag_steps * step_s and deferred_in_row < self.max_stretch - 1


class Pacer:
    """A learner's step time and its deferrals (training thread; the listener reads
    ``step_time`` and ``behind`` for the heartbeat): ``stepped`` at each step, with ``now``
    from the learner's clock, and ``defer`` for each request (``Pace.defer``)."""

    def __init__(self, pace: Pace, step_time_decay: float, num_fragments: int) -> None:
        self.pace, self.decay = pace, step_time_decay
        self.step_time: float | None = None
        """Seconds per step (exponential average; None before two steps)."""
        self.behind = False
        """Whether the last request was deferred: the link's uploads fall behind."""
        self.last_step_at: float | None = None
        self.deferred_in_row = [0] * num_fragments

    def stepped(self, now: float) -> None:
        """A step ended at ``now``: the step time takes in the time since the last one."""
        if self.last_step_at is not None:
            dt = now - self.last_step_at
            d = self.decay
            self.step_time = dt if self.step_time is None else d * self.step_time + (1 - d) * dt
        self.last_step_at = now

    def defer(self, p: int, backlog_s: float) -> bool:
        """Whether to defer a request for ``p`` with ``backlog_s`` seconds of uploads waiting
        (``Pace.defer``); counts the deferrals in a row and sets ``behind``."""
        if self.pace.defer(backlog_s, self.step_time, self.deferred_in_row[p]):
            self.deferred_in_row[p] += 1
            self.behind = True
            return True
        self.deferred_in_row[p] = 0
        self.behind = False
        return False

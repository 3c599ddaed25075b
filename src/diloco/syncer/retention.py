"""How long the syncer keeps commit logs: until every learner that may still ask has said so.

A learner reports, at every join and heartbeat, per fragment the oldest admission it may
still ask about (``JoinRequest.unsettled_from``): the version its oldest unsettled upload
was admitted at (made against, while unanswered), or with nothing unsettled the version it
holds. That report *pins* the fragment's commit logs from there on: ``Receipts`` lets a
log go only when it is older than every pin of its fragment (and outside the last
``commit_logs_kept`` logs, which are kept whatever the pins say, for learners that report
nothing). Three things end a pin:

* the learner reports again (its pin moves to what it reports now);
* it stops reporting: ``commit_log_pin_s`` after its lease (``lease_s``) has run out since
  its last report the pin *expires* (``pin_expired`` on the tape): a learner that never
  comes back does not hold logs for ever;
* the logs outgrow ``commit_logs_max``: the oldest are let go anyway, pinned or not
  (``commit_logs_dropped`` on the tape, with their count); an upload they held is then
  answered ``fate_unknown`` as before, never guessed.

**A restart needs no persisted pins.** A syncer that starts from a state directory holds
*every* log it restored (and all it commits after) for one pin time (``lease_s +
commit_log_pin_s``), as if every learner had pinned the oldest: within it each learner that
may still ask rejoins and reports its pin again (a learner away longer would have lost its
pin in the old syncer too). So the pins a crash lost are re-derived from the learners, and
until then nothing is let go that one of them may need; the receipt log on disk only ever
holds more than memory (it is rewritten after memory lets go: ``ReceiptLog.compact``).

Pure bookkeeping, the clock as input; not thread-safe (the syncer's lock is held).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COMMIT_LOG_PIN_S = 6 * 3600.0
"""Seconds after its lease that a learner no longer reporting keeps its pin
(``SyncerConfig.commit_log_pin_s``): a partition shorter than lease + this loses no fate
(within ``commit_logs_max``)."""
MAX_COMMIT_LOGS = 131_072
"""Most commit logs a syncer keeps however many learners still pin them
(``SyncerConfig.commit_logs_max``): 8 x ``RETAINED_COMMIT_LOGS``, ~24 hours at P = 24,
H = 16 and 1 s steps; at ~150 bytes of memory and ~40 of disk per upload a log holds,
~160 MB of memory and ~42 MB of ``receipts.jsonl`` with 8 learners."""
PIN_EXPIRED = "pin_expired"
"""Tape event: a learner's pin expired (``learner``)."""
LOGS_DROPPED = "commit_logs_dropped"
"""Tape event: logs still pinned were let go past ``commit_logs_max`` (``fragment``,
``logs``: how many, ``logged_from``: the version the fragment's kept logs now start at)."""


@dataclass
class Pin:
    floors: dict[int, int]
    """Per fragment, the oldest admission the learner may still ask about."""
    until: float
    """When the pin expires unless the learner reports again (the syncer's clock)."""


class Pins:
    """The learners' pins, and the hold a restart puts on every log (see the module)."""

    def __init__(self, hold_s: float) -> None:
        """``hold_s``: how long a pin lasts after its last report (lease + pin time)."""
        self.hold_s = hold_s
        self._pins: dict[str, Pin] = {}
        self.held_until: float | None = None
        """Until then every log is pinned (set by ``hold_all`` at a restart)."""
        self.expired = 0
        """Pins that expired (learners that did not report within ``hold_s``)."""

    def report(
        self, learner: str, reported: Sequence[int], versions: Sequence[int], now: float
    ) -> None:
        """``learner`` reported ``unsettled_from`` (``check_unsettled``'d) at ``now``; -1
        reads as ``versions[p]``, the syncer's own (it has seen no later one). Empty: an
        older learner: its pin, if any, is left as it was."""
        if reported:
            floors = {p: v if v >= 0 else versions[p] for p, v in enumerate(reported)}
            self._pins[learner] = Pin(floors, now + self.hold_s)

    def hold_all(self, now: float) -> None:
        """Pin every log for ``hold_s`` from ``now`` (a syncer restarted from its state)."""
        self.held_until = now + self.hold_s

    def expire(self, now: float | None) -> list[str]:
        """Drop the pins whose time ran out by ``now`` (None: none); their learners."""
        if now is None:
            return []
        if self.held_until is not None and now >= self.held_until:
            self.held_until = None
        gone = [lid for lid, pin in self._pins.items() if pin.until <= now]
        for lid in gone:
            del self._pins[lid]
        self.expired += len(gone)
        return gone

    def floors(self) -> Mapping[int, float]:
        """Per fragment, the oldest admission some pin keeps (absent: none; -inf: all)."""
        if self.held_until is not None:
            return _Everything()
        least: dict[int, float] = {}
        for pin in self._pins.values():
            for p, v in pin.floors.items():
                least[p] = min(v, least.get(p, math.inf))
        return least

    def of(self, learner: str) -> dict[int, int] | None:
        """The floors ``learner`` pins (None: it pins nothing)."""
        pin = self._pins.get(learner)
        return dict(pin.floors) if pin is not None else None


class _Everything(dict):
    """Floors of a hold: every fragment pinned from its oldest log."""

    def get(self, key, default=None):
        return -math.inf

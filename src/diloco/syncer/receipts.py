"""What the syncer knows of each accepted upload, kept across its own restarts.

Every upload carries an id chosen by its learner and kept across resends. Once the syncer
has accepted an upload, the upload has a *fate*: it was admitted at version ``a`` of its
fragment (merged by the commit that makes ``a + 1``), then either merged by that commit or
left out of its round's merge by the direction check (*excluded*: never merged). The
syncer answers a resend of an accepted upload with the version it was first admitted at, and
never merges it again; it tells a learner which of its uploads were excluded (the
``dropped_uploads`` of every heartbeat reply), so the learner counts their steps as dropped
instead of merged.

**Durability.** What a commit merged and left out (a :class:`CommitLog`: upload ids, steps
and tokens per learner) is persisted *with* the commit: in the fragment's state file (the
last ``PERSISTED_COMMITS`` logs of the fragment, written in the same rename as Θ_p) and,
right after that rename, appended to the state directory's receipt log
(``diloco.syncer.receipt_log``), which keeps the logs memory keeps: the last
``RETAINED_COMMIT_LOGS`` of the syncer, and every older one a learner may still ask about
(its pin, ``diloco.syncer.retention``), at most ``MAX_COMMIT_LOGS``. A restarted syncer
rebuilds the fates of every log kept (:meth:`Receipts.restore`), so

* a resend of an upload a committed round merged (its reply was lost, then the syncer died)
  is answered, not merged a second time, however many commits came since, as long as the
  log is kept;
* an upload accepted into a round the dead syncer never committed is unknown to its
  successor: its resend is a new upload and is merged once; a learner that already had its
  "accepted" answer returns it to its undelivered progress when it rejoins, because it was
  admitted at or after the version from which the logs are complete (``complete_from``)
  and its id is not among those the successor holds (``docs/algorithm.md``, "Syncer
  failures");
* an upload admitted before ``complete_from`` (its log was let go) has a fate nobody can
  tell any more: the syncer says so (``fate_unknown``) and the learner counts its steps as
  *unknown*, neither merged nor sent again. Never a guess.

Pure bookkeeping: no I/O, not thread-safe (the syncer's lock is held).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from diloco.syncer.retention import (
    COMMIT_LOG_PIN_S,
    LOGS_DROPPED,
    MAX_COMMIT_LOGS,
    PIN_EXPIRED,
    Pins,
)

PERSISTED_COMMITS = 64
"""Commits of each fragment whose logs are written into the fragment's state file, in the
same rename as the commit (the receipt log, appended after it, holds them all)."""
RETAINED_COMMIT_LOGS = 16_384
"""Commit logs a syncer keeps (in memory and in its receipt log), over all its fragments,
whatever its learners' pins say (older ones while a pin needs them: ``retention``): the
fates of the uploads they hold stay known across restarts and partitions. 16,384 logs
are ~3 hours of a fleet at P = 24, H = 16 and 1 s steps (~680 commits per fragment), ~30
hours at 10 s steps; each upload they hold costs ~150 bytes of memory and ~40 bytes of
disk (16,384 logs of 8 learners: ~20 MB of memory, ~6 MB on disk)."""
UPLOADS_PER_ROUND = 4
"""Uploads one learner may add to one round of a fragment (its contribution sums them); one
more is refused ``FAILED_PRECONDITION`` (``records.check_room_in_round``) and its learner sends
that progress again with its next upload, after the round's commit. Every admitted upload is
named in the round's tape record, in the commit log persisted with each of the fragment's
next ``PERSISTED_COMMITS`` commits and in the receipt log, so without a cap zero-norm uploads, which pass every size
check, made each commit rewrite thousands of parts. Why 4: an honest learner adds at most
three to a round, one per request of the syncer's clock (the answer to this round, and a
late answer to the previous one that rides along) plus its final upload when it stops (its
link queues at most one new job per fragment, and a resend of an accepted upload is answered
without being added); the fourth is spare. Synchronous DiLoCo's lockstep (``wait_for_all``
with ``--wait-for-merge``) sends a fragment once per round."""
REPORTED_DROPS = 64
"""Most recent excluded upload ids of a learner repeated in each heartbeat reply."""


@dataclass(frozen=True)
class UploadPart:
    """One accepted upload inside a round's contribution (increments are summed)."""

    upload_id: int
    steps: int
    tokens: int

    def to_json(self) -> list[int]:
        return [self.upload_id, self.steps, self.tokens]


@dataclass
class CommitLog:
    """What one closed round did with its uploads: ``merged`` and ``excluded`` per learner.

    ``admitted`` is the version the round's uploads were admitted at; ``version`` the version
    the round made (``admitted + 1``), or ``admitted`` when the direction check left every
    contribution out and nothing was committed (a *dropped* round)."""

    fragment: int
    version: int
    admitted: int
    merged: dict[str, list[UploadPart]] = field(default_factory=dict)
    excluded: dict[str, list[UploadPart]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """The tokens of the uploads the round merged (the excluded ones are not)."""
        return sum(part.tokens for parts in self.merged.values() for part in parts)

    def to_json(self) -> dict:
        return {
            "fragment": self.fragment,
            "version": self.version,
            "admitted": self.admitted,
            "merged": {k: [u.to_json() for u in v] for k, v in sorted(self.merged.items())},
            "excluded": {k: [u.to_json() for u in v] for k, v in sorted(self.excluded.items())},
        }

    @classmethod
    def from_json(cls, data: dict) -> CommitLog:
        """Parse what ``to_json`` wrote; ``ValueError`` if it is malformed."""
        try:
            return cls(
                int(data["fragment"]),
                int(data["version"]),
                int(data["admitted"]),
                {str(k): [UploadPart(*map(int, u)) for u in v] for k, v in data["merged"].items()},
                {
                    str(k): [UploadPart(*map(int, u)) for u in v]
                    for k, v in data["excluded"].items()
                },
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed commit log: {exc!r}") from None


@dataclass
class Fate:
    fragment: int
    admitted: int
    committed: bool = False
    """A closed round merged it or left it out (its log is persisted with that commit)."""
    excluded: bool = False
    """That round left it out of its merge (the direction check)."""


class Receipts:
    """Per learner, the fates of its accepted upload ids: those of the rounds still open, and
    those of the commit logs kept (older ones are let go with their logs, which moves
    ``complete_from``). A log is kept while it is among the last ``retained_logs`` or some
    learner's pin still needs it (``diloco.syncer.retention``), and never past ``max_logs``."""

    def __init__(
        self,
        retained_logs: int = RETAINED_COMMIT_LOGS,
        max_logs: int = MAX_COMMIT_LOGS,
        pin_s: float = COMMIT_LOG_PIN_S,
    ) -> None:
        """``pin_s``: how long a learner's pin lasts after its last report (its lease and the
        pin time, ``SyncerConfig.commit_log_pin_s``)."""
        self.retained_logs = retained_logs
        self.max_logs = max(max_logs, retained_logs)
        self.pins = Pins(pin_s)
        """The learners' pins (``diloco.syncer.retention.Pins``)."""
        self._fates: dict[str, dict[int, Fate]] = {}
        self._dropped: dict[str, OrderedDict[int, None]] = {}
        self._logs: dict[int, deque[tuple[int, int, list[tuple[str, int]]]]] = {}
        """Per fragment, the settled logs kept, oldest first: (order settled, admitted,
        (learner, upload id)...)."""
        self._settled = 0
        self.kept = 0
        """Logs kept, over all fragments."""
        self.logs_dropped = 0
        """Logs let go past ``max_logs`` while some pin still needed them."""
        self.events: list[dict] = []
        """Tape records of what retention did (``retention.PIN_EXPIRED``,
        ``retention.LOGS_DROPPED``) since ``take_events``."""
        self.complete_from: dict[int, int] = {}
        """Per fragment, the version from which the log of every commit is kept (absent: 0,
        every commit): an upload admitted at or after it that no kept log holds was never
        committed."""

    def admitted(self, learner: str, upload_id: int, fragment: int) -> int | None:
        """The version an accepted upload of ``fragment`` was admitted at, or None if the id
        is unknown (or 0, no id)."""
        fate = self._fates.get(learner, {}).get(upload_id) if upload_id else None
        return None if fate is None or fate.fragment != fragment else fate.admitted

    def fate_known(self, fragment: int, base_version: int) -> bool:
        """Whether the fate of an upload of ``fragment`` made against ``base_version`` can be
        told: its admission (at ``base_version`` or later) is not older than the kept logs."""
        return base_version >= self.complete_from.get(fragment, 0)

    def never_admitted(self, learner: str, upload_id: int, fragment: int, base_version: int):
        """Whether an upload with an id is known never to have been admitted by this syncer
        or a predecessor whose commits it restored: its id is not held and its fate can be
        told (``fate_known``). An accepted upload whose round died with a predecessor was
        never merged either."""
        unheld = upload_id and self.admitted(learner, upload_id, fragment) is None
        return bool(unheld) and self.fate_known(fragment, base_version)

    def logged_from(self, num_fragments: int, owned: Collection[int]) -> list[int]:
        """Per fragment, the version from which the log of every commit is kept (-1: a
        fragment not in ``owned``): a rejoining learner's accepted delta admitted since then
        is held iff its id is listed; an older one's fate is unknown."""
        return [self.complete_from.get(p, 0) if p in owned else -1 for p in range(num_fragments)]

    def admit(
        self,
        learner: str,
        upload_id: int,
        fragment: int,
        version: int,
        committed: bool = False,
        excluded: bool = False,
    ) -> None:
        """Remember an upload accepted at ``version`` (id 0: the learner gave none)."""
        if upload_id:
            fate = Fate(fragment, version, committed, excluded)
            self._fates.setdefault(learner, {})[upload_id] = fate

    def pin(self, learner: str, reported, versions, now: float) -> None:
        """``learner`` reported its ``unsettled_from`` at ``now`` (``Pins.report``)."""
        self.pins.report(learner, reported, versions, now)

    def settle(self, log: CommitLog, now: float | None = None) -> None:
        """Record what a closed round merged and left out, then let go the logs no pin needs
        past the last ``retained_logs``, and any past ``max_logs`` (pins expire by ``now``;
        None: none does)."""
        held = []
        for learner, parts in log.merged.items():
            for part in parts:
                self.admit(learner, part.upload_id, log.fragment, log.admitted, True)
                held.append((learner, part.upload_id))
        for learner, parts in log.excluded.items():
            dropped = self._dropped.setdefault(learner, OrderedDict())
            for part in parts:
                self.admit(learner, part.upload_id, log.fragment, log.admitted, True, True)
                held.append((learner, part.upload_id))
                if part.upload_id:
                    dropped[part.upload_id] = None
            while len(dropped) > REPORTED_DROPS:
                dropped.popitem(last=False)
        self._settled += 1
        self._logs.setdefault(log.fragment, deque()).append((self._settled, log.admitted, held))
        self.kept += 1
        self._prune(now)

    def _prune(self, now: float | None) -> None:
        for learner in self.pins.expire(now):
            self.events.append({"event": PIN_EXPIRED, "learner": learner})
        if self.kept <= self.retained_logs:
            return
        floors = self.pins.floors()
        while self.kept > self.retained_logs:  # the oldest log no pin needs
            fronts = [(q[0][0], p) for p, q in self._logs.items() if q]
            free = [(n, p) for n, p in fronts if self._logs[p][0][1] < floors.get(p, math.inf)]
            if not free:
                break
            self._let_go(min(free)[1])
        dropped: dict[int, int] = {}
        while self.kept > self.max_logs:  # pinned, but past the bound: the oldest anyway
            p = min((q[0][0], p) for p, q in self._logs.items() if q)[1]
            self._let_go(p)
            dropped[p] = dropped.get(p, 0) + 1
        for p, count in sorted(dropped.items()):
            self.logs_dropped += count
            record = {"fragment": p, "logs": count, "logged_from": self.complete_from[p]}
            self.events.append({"event": LOGS_DROPPED, **record})

    def take_events(self) -> list[dict]:
        """The tape records of what retention did since the last call."""
        events, self.events = self.events, []
        return events

    def _let_go(self, fragment: int) -> None:
        """Forget the fragment's oldest kept log: its uploads' fates become unknown."""
        _, admitted, held = self._logs[fragment].popleft()
        self.kept -= 1
        start = self.complete_from.get(fragment, 0)
        self.complete_from[fragment] = max(start, admitted + 1)
        for learner, upload_id in held:
            fates = self._fates.get(learner)
            fate = fates.get(upload_id) if fates is not None else None
            if fate is not None and fate.committed and fate.admitted <= admitted:
                del fates[upload_id]
                if not fates:
                    del self._fates[learner]

    def committed(self, learner: str) -> list[int]:
        """The learner's upload ids that closed rounds merged or left out (kept ones)."""
        return [u for u, fate in self._fates.get(learner, {}).items() if fate.committed]

    def held(self, learner: str) -> list[int]:
        """The learner's upload ids this syncer holds: merged or left out by closed rounds,
        or accepted into a round still open (it merges them unless it drops the round; a
        join with a new session does not withdraw them). What a rejoining learner is told
        (``JoinReply.committed_uploads``): a restored learner whose previous life died
        before an answer must not send those steps again. After a restart only the
        committed ones are left (open rounds died with the syncer)."""
        return list(self._fates.get(learner, ()))

    def fates(self, learner: str) -> dict[int, Fate]:
        """The fates of the learner's ``held`` upload ids (a copy): which a committed round
        merged or left out (``excluded``, however many were left out since: ``dropped``
        names only the most recent), and which sit in a round still open (not
        ``committed``), admitted at which version (``JoinReply.fates``)."""
        return dict(self._fates.get(learner, {}))

    def dropped(self, learner: str) -> list[int]:
        """The learner's most recent excluded upload ids (at most ``REPORTED_DROPS``)."""
        return list(self._dropped.get(learner, ()))

    def restore(
        self,
        logs: Iterable[CommitLog],
        complete_from: dict[int, int] | None = None,
        now: float | None = None,
    ) -> None:
        """Rebuild the fates of persisted commits (in the order they were committed) and the
        versions from which their logs are complete (``complete_from``; default: from
        version 0). With ``now`` (a syncer restarted from its state directory) every log is
        held for one pin time from ``now`` (``Pins.hold_all``): the learners' pins died with
        the old syncer and come back with their next reports."""
        if now is not None:
            self.pins.hold_all(now)
        for fragment, version in (complete_from or {}).items():
            self.complete_from[fragment] = max(self.complete_from.get(fragment, 0), version)
        for log in logs:
            self.settle(log, now)

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
and tokens per learner) is persisted *with* the commit, in the fragment's state file
(``diloco.syncer.store``), for the last ``PERSISTED_COMMITS`` commits of each fragment. A
restarted syncer rebuilds the fates of those uploads (:meth:`Receipts.restore`), so

* a resend of an upload a committed round merged (its reply was lost, then the syncer died)
  is answered, not merged a second time;
* an upload accepted into a round the dead syncer never committed is unknown to its
  successor: its resend is a new upload and is merged once; a learner that already had its
  "accepted" answer returns it to its undelivered progress when it rejoins, because it was
  admitted at or after the version the successor restored (``docs/algorithm.md``, "Syncer
  failures").

Pure bookkeeping: no I/O, not thread-safe (the syncer's lock is held).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

PERSISTED_COMMITS = 64
"""Commits of each fragment whose upload ids are kept in the fragment's state file."""
REMEMBERED_UPLOADS = 4 * PERSISTED_COMMITS
"""Accepted upload ids remembered per learner and fragment: every upload of the persisted
commit logs (a learner has one contribution per round, rarely more than a few uploads summed
in it), so a restarted syncer forgets none of them (a resend comes within the ~80 s a
learner keeps resending, ``diloco.learner.uploads.MAX_RESENDS``: far fewer uploads)."""
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


class Receipts:
    """Per learner and fragment, the fates of its last ``REMEMBERED_UPLOADS`` accepted
    upload ids."""

    def __init__(self, per_fragment: int = REMEMBERED_UPLOADS) -> None:
        self.per_fragment = per_fragment
        self._fates: dict[tuple[str, int], OrderedDict[int, Fate]] = {}
        self._dropped: dict[str, OrderedDict[int, None]] = {}

    def admitted(self, learner: str, upload_id: int, fragment: int) -> int | None:
        """The version an accepted upload of ``fragment`` was admitted at, or None if the id
        is unknown (or 0, no id)."""
        fate = self._fates.get((learner, fragment), {}).get(upload_id) if upload_id else None
        return None if fate is None else fate.admitted

    def admit(
        self, learner: str, upload_id: int, fragment: int, version: int, committed: bool = False
    ) -> None:
        """Remember an upload accepted at ``version`` (id 0: the learner gave none)."""
        if not upload_id:
            return
        fates = self._fates.setdefault((learner, fragment), OrderedDict())
        fates[upload_id] = Fate(fragment, version, committed)
        while len(fates) > self.per_fragment:
            fates.popitem(last=False)

    def settle(self, log: CommitLog) -> None:
        """Record what a closed round merged and left out."""
        for learner, parts in log.merged.items():
            for part in parts:
                self.admit(learner, part.upload_id, log.fragment, log.admitted, True)
        for learner, parts in log.excluded.items():
            dropped = self._dropped.setdefault(learner, OrderedDict())
            for part in parts:
                self.admit(learner, part.upload_id, log.fragment, log.admitted, True)
                if part.upload_id:
                    dropped[part.upload_id] = None
            while len(dropped) > REPORTED_DROPS:
                dropped.popitem(last=False)

    def committed(self, learner: str) -> list[int]:
        """The learner's upload ids that closed rounds merged or left out (remembered ones)."""
        return [
            u
            for (who, _), fates in self._fates.items()
            if who == learner
            for u, fate in fates.items()
            if fate.committed
        ]

    def held(self, learner: str) -> list[int]:
        """The learner's upload ids this syncer holds: merged or left out by closed rounds,
        or accepted into a round still open (it merges them unless it drops the round; a
        join with a new session does not withdraw them). What a rejoining learner is told
        (``JoinReply.committed_uploads``): a restored learner whose previous life died
        before an answer must not send those steps again. After a restart only the
        committed ones are left (open rounds died with the syncer)."""
        return [u for (who, _), fates in self._fates.items() if who == learner for u in fates]

    def dropped(self, learner: str) -> list[int]:
        """The learner's most recent excluded upload ids (at most ``REPORTED_DROPS``)."""
        return list(self._dropped.get(learner, ()))

    def restore(self, logs: Iterable[CommitLog]) -> None:
        """Rebuild the fates of persisted commits (oldest first)."""
        for log in sorted(logs, key=lambda c: (c.version, c.fragment)):
            self.settle(log)

"""What the link's threads hand to a learner's training thread, under one lock.

The link's threads only put things here (arrived versions, the clock's requests, upload
answers, rejoins); the training thread takes them at a step boundary. Arrived versions are
kept per fragment in stream order, as a chain: a keyframe (``base`` -1, the value itself)
replaces whatever was pending, a delta is appended to be added on top of the version before
it, exactly as the syncer added it (``diloco.syncer.service``). After a rejoin to a syncer of
another lineage (``restart``) the first keyframe of each of its fragments is a *rebase*
(base ``REBASE``): applied whatever its version, since version numbers of two lineages
do not compare.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from diloco.learner.listener import HeldFates

Chain = list[tuple[int, int, torch.Tensor, frozenset[str]]]
"""``(version, base_version, tensor, contributors)`` in stream order; base -1: a keyframe,
``REBASE``: the first keyframe of another lineage."""

REBASE = -2
"""The base of a keyframe that starts another lineage's versions (``Inbox.restart``)."""


def rebases(chain: Chain) -> bool:
    """Whether ``chain`` holds the first keyframe of another lineage."""
    return any(base == REBASE for _, base, _, _ in chain)


MAX_WAITING_CHAIN = 4
"""A chain that waits (its fragment has a delta on the wire without an answer) longer than
this is kept as the one value it gives (``bounded``): a slow upload must not let a
fragment's versions pile up as fp32 deltas without bound."""


def follow(
    chain: Chain, version: int, value: torch.Tensor | None
) -> tuple[int, torch.Tensor] | None:
    """The version and value at the end of ``chain`` on top of ``value`` at ``version`` (what
    the learner holds), adding each delta in turn exactly as the syncer added it; ``None`` if
    a delta does not start from the version before it (or nothing is held to add it to)."""
    for v, base, tensor, _ in chain:
        if base < 0:
            version, value = v, tensor
        elif value is not None and base == version:
            version, value = v, value + tensor
        else:
            return None
    return (version, value) if value is not None else None


def bounded(chain: Chain, version: int, value: torch.Tensor | None) -> Chain:
    """``chain``, or when longer than ``MAX_WAITING_CHAIN`` one keyframe-like entry: the value
    it gives on top of ``value`` at ``version`` (``follow``: bit for bit what applying the
    chain gives), its contributors unioned. A chain that does not fit is kept as it is (it
    is resynced when applied)."""
    if len(chain) <= MAX_WAITING_CHAIN:
        return chain
    followed = follow(chain, version, value)
    if followed is None:
        return chain
    contributors = frozenset().union(*(item[3] for item in chain))
    return [(followed[0], REBASE if rebases(chain) else -1, followed[1], contributors)]


@dataclass(frozen=True)
class Rejoin:
    """A (re)join: which syncer instance, the versions it reported, the fragments it owns,
    this learner's upload ids it holds (its commit logs', and for a syncer that did not
    restart those in its open rounds too), per fragment, the version the oldest of those
    logs admitted at (-1: none), the lineage of its versions ("": not said) and whether it
    is another lineage than the one the learner holds versions of (``another_lineage``)."""

    address: str
    syncer_id: str
    versions: list[int]
    fragments: tuple[int, ...]
    committed: frozenset[int] = frozenset()
    logged_from: tuple[int, ...] = ()
    lineage: str = ""
    another_lineage: bool = False
    fates: HeldFates | None = None
    """Which held ids were left out and which sit in open rounds (None: not told)."""


@dataclass(frozen=True)
class Dropped:
    """Upload ids a syncer says it left out of their rounds' merges (never merged)."""

    address: str
    upload_ids: frozenset[int]


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: dict[int, Chain] = {}
        self._requested: set[int] = set()
        self._answers: list = []
        """Upload answers ``(job, result)``, ``Rejoin`` and ``Dropped`` notes, in the order
        the link's threads reported them: settled in that order (an answer from a syncer
        that then restarted must be settled before the rejoin to its successor)."""
        self._need_keyframe: set[int] = set()
        self._claims: dict[int, torch.Tensor] = {}
        self._rebase: set[int] = set()
        """Fragments whose next keyframe starts another lineage (``restart``)."""
        self._restarted: set[int] = set()
        """Fragments restarted since the last ``take_arrived``: what was taken before is of
        the lineage left, and is not put back."""

    # ------------------------------------------------------------ link side
    def arrive(self, fragment: int, version: int, base: int, value, contributors) -> bool:
        """An arrived version; ``value`` ``None`` means "you hold this already" and takes
        the value claimed for it (False if there is no claim: ask for a keyframe)."""
        with self._lock:
            claimed = self._claims.pop(fragment, None)  # moot once anything arrives for it
            if value is None:
                value = claimed
                if value is None:
                    self._need_keyframe.add(fragment)
                    return False
            chain = self._arrived.setdefault(fragment, [])
            if base < 0:
                if fragment in self._rebase or rebases(chain):
                    base = REBASE  # (a later keyframe still starts the lineage)
                self._rebase.discard(fragment)
                chain.clear()  # a keyframe replaces whatever was pending
                self._need_keyframe.discard(fragment)
            chain.append((version, base, value, frozenset(contributors)))
            return True

    def restart(self, fragments) -> None:
        """The learner joined a syncer of another lineage owning ``fragments``: what arrived
        of them is dropped, and each needs a keyframe, its first one a rebase (``REBASE``).
        Call it before subscribing to that syncer."""
        with self._lock:
            for p in fragments:
                self._arrived.pop(p, None)
                self._claims.pop(p, None)
                self._need_keyframe.add(p)
                self._rebase.add(p)
                self._restarted.add(p)

    def request(self, fragment: int) -> None:
        with self._lock:
            self._requested.add(fragment)

    def answer(self, job, result) -> None:
        with self._lock:
            self._answers.append((job, result))

    def rejoin(self, rejoin: Rejoin) -> None:
        with self._lock:
            self._answers.append(rejoin)

    def dropped(self, dropped: Dropped) -> None:
        with self._lock:
            self._answers.append(dropped)

    def claim(self, fragment: int, value: torch.Tensor) -> None:
        """The learner sent the digest of ``value`` for a fragment it never received."""
        with self._lock:
            self._claims[fragment] = value

    def have_versions(self, versions: list[int]) -> list[int]:
        """What the learner will hold once it applied what arrived; -1 where it needs a
        keyframe."""
        with self._lock:
            pending = {p: chain[-1][0] for p, chain in self._arrived.items() if chain}
            need = set(self._need_keyframe)
        return [-1 if p in need else max(v, pending.get(p, -1)) for p, v in enumerate(versions)]

    def needs_keyframe(self, fragment: int) -> bool:
        with self._lock:
            return fragment in self._need_keyframe

    # -------------------------------------------------------- training side
    def ask_keyframe(self, fragment: int) -> None:
        with self._lock:
            self._need_keyframe.add(fragment)

    def take_requested(self) -> set[int]:
        with self._lock:
            asked, self._requested = self._requested, set()
        return asked

    def take_answers(self) -> list:
        """Everything reported since the last call, in order: ``(job, result)`` pairs,
        ``Rejoin`` and ``Dropped`` notes."""
        with self._lock:
            answers, self._answers = self._answers, []
        return answers

    def take_arrived(self) -> dict[int, Chain]:
        with self._lock:
            arrived, self._arrived = self._arrived, {}
            self._restarted.clear()
        return arrived

    def put_back(self, waiting: dict[int, Chain]) -> None:
        """Chains taken but not applied yet go back in front of what arrived since (a
        keyframe that arrived since makes them moot, and keeps their rebase; so does a
        ``restart`` since they were taken)."""
        with self._lock:
            for p, chain in waiting.items():
                if p in self._restarted:
                    continue
                later = self._arrived.get(p, [])
                keys = [i for i, item in enumerate(later) if item[1] < 0]
                if not keys:
                    self._arrived[p] = chain + later
                    continue
                kept = later[keys[-1] :]
                if rebases(chain):
                    version, _, value, contributors = kept[0]
                    kept[0] = (version, REBASE, value, contributors)
                self._arrived[p] = kept

"""Lineages: which history a syncer's version numbers belong to.

A version number names one value only within one history of commits. A state directory
restored from a backup (docs/security.md) holds older versions than the ones its syncer
broadcast before; started as it was, the syncer would reuse those numbers for other values,
and learners holding the lost versions would apply new deltas onto the wrong base (or be
refused forever, their base versions ahead of the syncer's). So every state directory
carries a **lineage**: a random id (``LINEAGE_CHARS`` hex characters) made with the
directory (``meta.json``), sent to learners at join (``JoinReply.lineage``) and written in
the tape's ``start`` records.

A backup carries the lineage of the directory it copied, so the lineage alone does not
reveal a rollback. The tape does (append-only, kept outside the state directory): the
versions it records under a start of this lineage (``store.Taped.of_lineage``) are ones
the directory held. A directory behind them has been rolled back: the syncer refuses to
start (``rollback_refusal``) unless the operator accepts the rollback
(``diloco syncer --accept-rollback``); it then starts a new lineage, so that every learner
holding versions of the old one takes keyframes and settles what it cannot know as
unknown, and tapes a ``rollback`` record (``rollback_record``). A receipt log holding
commits above the fragment files (``diloco.syncer.receipt_log``) is the same rollback,
seen from inside the directory. A syncer without a state directory has a new lineage at
every start: its restart loses every version, and its learners see another lineage.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

LINEAGE_CHARS = 16
"""Hex characters of a lineage id (64 random bits)."""


def new_lineage() -> str:
    """A fresh random lineage id."""
    return secrets.token_hex(LINEAGE_CHARS // 2)


@dataclass(frozen=True)
class Behind:
    """A fragment whose version on disk is below one its lineage is known to have reached
    (``reached``: by the tape, or by the receipt log)."""

    fragment: int
    reached: int
    version: int


def behind(
    reached: Mapping[int, int],
    versions: Mapping[int, int] | Sequence[int],
    owned: Collection[int],
) -> list[Behind]:
    """The ``owned`` fragments whose version in ``versions`` (on disk, by fragment) is
    below the version ``reached`` records for it, by fragment.

    >>> behind({0: 4, 1: 2}, [2, 2], (0, 1))
    [Behind(fragment=0, reached=4, version=2)]
    """
    return [
        Behind(p, reached[p], versions[p]) for p in sorted(owned) if reached.get(p, 0) > versions[p]
    ]


def rollback_refusal(state_dir: object, tape: object, fragments: Sequence[Behind]) -> str:
    """The one line a syncer refuses to start with when its tape is ahead of its state
    directory."""
    first = fragments[0]
    more = f" (and {len(fragments) - 1} more fragments)" if len(fragments) > 1 else ""
    return (
        f"the state directory {state_dir} was rolled back: fragment {first.fragment} is at "
        f"version {first.version} on disk, but the tape {tape} records version "
        f"{first.reached} of it{more}. Learners holding the lost versions would apply new "
        "values onto the wrong base. Start with --accept-rollback to serve it as a new "
        "lineage (learners then take keyframes; their uploads it cannot account for count "
        "as unknown), or restore the newer state"
    )


@dataclass
class Rollback:
    """A rollback the operator accepted: the lineage left, the new one, and what the tape
    (``taped``) and the receipt log (``logged``) recorded beyond the directory."""

    from_lineage: str | None
    lineage: str
    taped: list[Behind] = field(default_factory=list)
    logged: list[Behind] = field(default_factory=list)


def rollback_record(rollback: Rollback, t: float) -> dict:
    """The tape's ``rollback`` record: the lineage left and the new one; per fragment, the
    version the tape (``fragments``) or the receipt log (``receipts``) recorded and the
    version the directory holds."""
    return {
        "event": "rollback",
        "t": t,
        "from_lineage": rollback.from_lineage,
        "lineage": rollback.lineage,
        "fragments": [
            {"fragment": b.fragment, "taped_version": b.reached, "version": b.version}
            for b in rollback.taped
        ],
        "receipts": [
            {"fragment": b.fragment, "logged_version": b.reached, "version": b.version}
            for b in rollback.logged
        ],
    }

"""Syncer shards: which syncer process owns which fragment, and checking that a set covers all.

Fragments are independent (each has its own value, version, momentum and rounds), so the
syncer's work splits across ``S`` processes without any coordination between them: shard
``i`` of ``S`` owns the fragments ``p`` with ``p mod S == i``. A learner connects to every
shard, sends each fragment's outer gradient to its owner and merges the fragment streams.

Why round-robin (``p mod S``) and not contiguous blocks: with the schedule's offsets
``floor(p·H/P)`` consecutive fragments go out at consecutive steps, so round-robin spreads a
learner's uploads evenly over the shards *in time* (at P = H, shard after shard, step after
step), and the balanced fragmentation makes every fragment nearly the same size, so each shard
carries ~1/S of the bytes and commits. The rule is a pure function of ``(p, S)``: nothing is
negotiated, a syncer started with ``--shard i/S`` knows its fragments and tells learners at
join (``JoinReply.fragments``), and the learner checks with :func:`check_cover` that the
syncers it was given cover every fragment exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ShardError",
    "ShardInfo",
    "check_cover",
    "parse_shard",
    "shard_fragments",
    "shard_of",
]


class ShardError(ValueError):
    """A shard specification or a set of syncers that does not cover the model correctly."""


def shard_of(fragment: int, num_shards: int) -> int:
    """The shard that owns ``fragment`` among ``num_shards``: ``fragment mod num_shards``."""
    if num_shards < 1 or fragment < 0:
        raise ShardError(f"need fragment >= 0 and num_shards >= 1 (got {fragment}, {num_shards})")
    return fragment % num_shards


def shard_fragments(num_fragments: int, shard: int, num_shards: int) -> list[int]:
    """The fragments shard ``shard`` of ``num_shards`` owns, ascending.

    Over ``shard = 0..num_shards-1`` these lists partition ``range(num_fragments)``. Raises
    ``ShardError`` unless ``0 <= shard < num_shards <= num_fragments`` (a shard with no
    fragment would be a process with nothing to do, almost certainly a mistake).
    """
    if not 1 <= num_shards <= num_fragments:
        raise ShardError(
            f"the number of shards must be in [1, P={num_fragments}] (got {num_shards}): "
            "every shard needs at least one fragment"
        )
    if not 0 <= shard < num_shards:
        raise ShardError(f"shard index must be in [0, {num_shards}) (got {shard})")
    return list(range(shard, num_fragments, num_shards))


def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)``: shard index and shard count, as ``diloco syncer --shard`` takes
    them. Raises ``ShardError`` naming the expected form."""
    index, sep, count = text.strip().partition("/")
    try:
        i, s = int(index), int(count)
    except ValueError:
        i, s = -1, 0
    if not sep or s < 1 or not 0 <= i < s:
        raise ShardError(
            f"--shard {text!r}: expected I/S with 0 <= I < S, e.g. --shard 0/2 and --shard 1/2"
        )
    return i, s


@dataclass(frozen=True)
class ShardInfo:
    """What one syncer said at join: its address, the fragments it owns, ``--shard i/S``."""

    address: str
    fragments: tuple[int, ...]
    shard: int = 0
    num_shards: int = 1

    def label(self) -> str:
        return f"{self.address} (shard {self.shard}/{self.num_shards})"


def check_cover(num_fragments: int, shards: Sequence[ShardInfo]) -> list[int]:
    """Check that ``shards`` together own every fragment exactly once; return the owner of
    each fragment (an index into ``shards``).

    Raises ``ShardError`` with a message that says what is wrong and what to pass instead:
    shards of different splits, a fragment out of range, a fragment owned twice (the same
    shard given twice) or fragments nobody owns (a shard's address missing).
    """
    if not shards:
        raise ShardError("no syncer address given")
    counts = {s.num_shards for s in shards}
    if len(counts) > 1:
        listed = ", ".join(s.label() for s in shards)
        raise ShardError(f"the syncers belong to different shard splits: {listed}")
    owner = [-1] * num_fragments
    for i, info in enumerate(shards):
        for p in info.fragments:
            if not 0 <= p < num_fragments:
                raise ShardError(
                    f"{info.label()} claims fragment {p}, outside [0, {num_fragments})"
                )
            if owner[p] >= 0:
                raise ShardError(
                    f"fragment {p} is owned by both {shards[owner[p]].label()} and "
                    f"{info.label()}: was one shard's address given twice?"
                )
            owner[p] = i
    missing = [p for p in range(num_fragments) if owner[p] < 0]
    if missing:
        n = shards[0].num_shards
        given = sorted({s.shard for s in shards})
        absent = [i for i in range(n) if i not in given]
        hint = (
            f"missing shard(s) {absent} of {n}: give the learner every shard's address, "
            "comma-separated (--syncer HOST0:PORT0,HOST1:PORT1,...)"
            if absent
            else "the syncers do not split the model the same way"
        )
        shown = missing[:8] + (["..."] if len(missing) > 8 else [])
        raise ShardError(
            f"{len(missing)} of {num_fragments} fragments ({', '.join(map(str, shown))}) are "
            f"owned by none of the syncers given ({', '.join(s.label() for s in shards)}); {hint}"
        )
    return owner

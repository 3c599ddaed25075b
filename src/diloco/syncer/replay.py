"""A commit of one fragment as a pure function of what it took in, so that it can be made
again, bit for bit, from the commit journal (``diloco.syncer.journal``).

A commit moves three things: Θ_p, its outer momentum and its wire image ``W_p`` (what
learners hold). ``RoundInputs`` is everything that move depends on beyond those three: the
uploads the merge kept as they arrived (encoded bytes and codec, in the order each learner's
were summed), the capped weights, the round's share, the outer learning rate and momentum,
which pieces are merged by weighted mean, and the down codec with its feedback switch. The
decisions that chose them (the direction check, the weights, the share: they read the
learner table and the clock) are taken once, live, and recorded, never taken again.

The live commit and the replay run the same three steps, in this order: ``merged_delta``
(``records.Closing.merge``), ``NesterovOuter.step`` (``model.GlobalModel.step``) and
``down_step`` (the committer's encoding of the broadcast delta); ``redo`` chains them for
the replay. The same machine with the same thread count gives the same bits (the digest of
Θ_p each record carries is checked after each replayed commit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from diloco.algorithm import codecs, streaming
from diloco.algorithm.encoded_delta import Encoded, EncodedDelta
from diloco.algorithm.fragments import fragment_digest
from diloco.algorithm.outer import NesterovOuter
from diloco.syncer.files import StateError
from diloco.syncer.receipts import PERSISTED_COMMITS, CommitLog


@dataclass(frozen=True)
class RoundInputs:
    """One commit of ``fragment``, enough to make it again (see the module docstring).

    ``log``: what it merged and left out (``receipts.CommitLog``; ``log.version`` is the
    version it made, ``log.admitted`` the one it started from); ``merged_tokens``: the
    fragment's running total with it; ``digest``: ``fragment_digest`` of Θ_p after it. A
    dropped round (``changed`` False) carries only these: it moved nothing."""

    fragment: int
    log: CommitLog
    merged_tokens: int
    changed: bool = True
    contributions: list[list[Encoded]] = field(default_factory=list)
    """Per contribution the merge kept (in the merge's order), its uploads in the order
    they were summed."""
    weights: list[float] = field(default_factory=list)
    share: float = 1.0
    outer_lr: float = 0.0
    outer_momentum: float = 0.0
    mean_pieces: list[str] = field(default_factory=list)
    """The names of the fragment's tensors merged by weighted mean (the others by RDA)."""
    down_codec: str = "fp32"
    down_feedback: bool = True
    digest: str = ""

    @property
    def version(self) -> int:
        return self.log.version

    @property
    def admitted(self) -> int:
        return self.log.admitted


def merged_delta(
    deltas: Sequence[streaming.Delta],
    weights: Sequence[float],
    share: float,
    piece_layout,
    is_embedding: Callable[[str], bool],
    empty: Callable[[int], torch.Tensor] = codecs.new_vector,
    scratch: Callable[[int], torch.Tensor] = codecs.new_vector,
) -> torch.Tensor:
    """A round's merged delta (``merge.merge_contributions``), scaled by its share: a new
    tensor (from ``empty(n)``: a ``runtime.buffers.BufferPool``'s, or new), written chunk by
    chunk (``streaming.merge_into``: the same bits; an encoded delta's tensor spans are
    decoded into ``scratch`` buffers, one tensor's at a time)."""
    if not deltas:  # (refused by merge_into, as before: "need at least one contribution")
        return streaming.merge_into(torch.empty(0), deltas, weights, share, piece_layout, None)
    out = empty(deltas[0].numel()).view(deltas[0].shape)
    return streaming.merge_into(
        out, deltas, weights, share, piece_layout, is_embedding, scratch=scratch
    )


def down_step(
    params: torch.Tensor,
    wire: torch.Tensor,
    codec: str,
    empty: Callable[[int], torch.Tensor] = codecs.new_vector,
) -> tuple[bytes, torch.Tensor]:
    """``(d, W')``: the broadcast delta ``d = encode(Θ_p − W_p)`` and the wire image a
    learner holds after applying it, ``W' = W_p + decode(d)`` (a tensor from ``empty(n)``),
    made chunk by chunk (``streaming.down_step``: the same bits, without whole-fragment
    temporaries)."""
    return streaming.down_step(params, wire, codec, empty=empty)


def redo(
    inputs: RoundInputs,
    params: torch.Tensor,
    outer: NesterovOuter,
    wire: torch.Tensor,
    piece_layout,
) -> torch.Tensor:
    """Make the commit ``inputs`` records again on ``params`` (Θ_p, changed in place) and
    ``outer``'s momentum of the fragment; returns the new wire image."""
    numel = params.numel()
    deltas = [EncodedDelta(parts, numel) for parts in inputs.contributions]
    mean = frozenset(inputs.mean_pieces)
    merged = merged_delta(deltas, inputs.weights, inputs.share, piece_layout, mean.__contains__)
    outer.step(inputs.fragment, params, merged, lr=inputs.outer_lr)
    _, wire = down_step(params, wire, inputs.down_codec)
    if not inputs.down_feedback:
        params.copy_(wire)  # (``GlobalModel.take_wire_image``)
    return wire


@dataclass
class Recovered:
    """A fragment as its snapshot and the journal records after it make it."""

    version: int
    params: torch.Tensor
    state: dict[str, torch.Tensor]
    """``"momentum"`` (absent: none kept yet) and ``"wire"``."""
    history: list[CommitLog]
    merged_tokens: int | None
    replayed: int = 0
    """Journal records replayed onto the snapshot."""
    digest: str | None = None
    """``fragment_digest`` of ``params`` when the replay checked it (None: not known)."""


def after_snapshot(
    records: Sequence[RoundInputs], history: Sequence[CommitLog], version: int
) -> list[RoundInputs]:
    """The records a snapshot at ``version`` whose last commit logs are ``history`` does
    not hold: those after the record of its newest log, or, when the journal no longer has
    that record, the commits above ``version`` and the dropped rounds at or above it that
    ``history`` does not name."""
    if history:
        newest = history[-1].to_json()
        for i in range(len(records) - 1, -1, -1):
            if records[i].log.to_json() == newest:
                return list(records[i + 1 :])
    named = [h.to_json() for h in history]
    return [
        r
        for r in records
        if (r.changed and r.version > version)
        or (not r.changed and r.admitted >= version and r.log.to_json() not in named)
    ]


def replay(recovered: Recovered, records: Sequence[RoundInputs], piece_layout, where) -> None:
    """Apply ``records`` (the journal's records after the snapshot, in order) to
    ``recovered`` in place. Raises ``StateError`` naming ``where`` when a record does not
    follow the version before it, or when replaying one does not give the Θ_p digest it
    recorded."""
    params = recovered.params
    wire = recovered.state.get("wire")
    wire = params.clone() if wire is None else wire  # (``redo`` never changes it in place)
    outer = None
    for r in records:
        if r.admitted != recovered.version:
            raise StateError(
                f"{where}: a commit from version {r.admitted} follows version "
                f"{recovered.version} (a gap in the commit journal)"
            )
        if r.changed:
            if outer is None or outer.momentum != r.outer_momentum:
                if outer is not None:  # (the state so far, for the next momentum's optimizer)
                    recovered.state = _replayed_state(outer, r.fragment, wire)
                outer = NesterovOuter(momentum=r.outer_momentum)
                outer.load_fragment_state(r.fragment, recovered.state)
            wire = redo(r, params, outer, wire, piece_layout)
            recovered.digest = fragment_digest(params) if r.digest else None
            if r.digest and recovered.digest != r.digest:
                raise StateError(
                    f"{where}: replaying the commit of version {r.version} does not give "
                    "the value it recorded"
                )
        recovered.version = r.version
        recovered.history = [*recovered.history, r.log][-PERSISTED_COMMITS:]
        recovered.merged_tokens = r.merged_tokens
        recovered.replayed += 1
    if outer is not None:
        recovered.state = _replayed_state(outer, records[-1].fragment, wire)


def _replayed_state(outer: NesterovOuter, fragment: int, wire: torch.Tensor) -> dict:
    """A replay's fragment state: ``outer``'s momentum buffer itself (the replay's optimizer is
    its own and let go after it: no copy per record) and the wire image."""
    momentum = outer.buffer(fragment)
    return {"wire": wire} if momentum is None else {"momentum": momentum, "wire": wire}

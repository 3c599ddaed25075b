"""A commit's arithmetic chunk by chunk: the merge and the down step without whole-fragment
temporaries, bit for bit what the whole-tensor functions give.

A fragment of a 1B-parameter model at P = 24 holds 42M values (168 MB in fp32). Written on
whole tensors, a commit makes several such temporaries: per tensor RDA's direction, the
merged vector and its copy scaled by the round's share, then ``Θ_p − W_p``, the encoder's
working copy, the decoded delta and ``W_p + d̂``. Here the merge writes into one output
vector (``merge_into``) and the down step (``down_step``) goes through ``CHUNK_VALUES``
values at a time, so that what a commit allocates beyond its results is a few chunks; the
chunks of a pass are split over ``chunk_threads``' threads (the same bits on any of them).
The merge reads uploads kept as they arrived (``encoded_delta.EncodedDelta``) one tensor's
span at a time (``merge_sizes.WHOLE_SPAN_VALUES``).

**Bit for bit.** Every operation done chunk by chunk is elementwise (a sum with a scalar
factor, a product, a quantisation of a block that a chunk holds whole), and every reduction
(a tensor's norm, the norm of RDA's direction) is taken once over the whole tensor, as
before: ``merge.merge_contributions`` and ``codecs.encode`` / ``codecs.decode`` on whole
tensors give the same bits (``tests/test_streaming.py`` compares them), and so the journal's
replay (``diloco.syncer.replay``), which runs these same functions, gives the live bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from diloco.algorithm import codecs, merge_sizes
from diloco.algorithm.chunk_threads import for_each_chunk, map_whole
from diloco.algorithm.encoded_delta import EncodedDelta
from diloco.algorithm.merge import CANCEL_TOL, check_contributions, spans_by_tensor

CHUNK_VALUES = 1 << 18
"""Values per chunk (1 MB of fp32, a few of which stay in the CPU's caches): a multiple of
``codecs.ALIGN_VALUES``."""


Delta = torch.Tensor | EncodedDelta
"""A contribution to merge: decoded, or as its uploads arrived (decoded where it is read)."""


class _Span:
    """Values ``[start, stop)`` of an ``EncodedDelta``: one tensor's part of a fragment,
    decoded a piece at a time where it is read (``_piece``) or whole for its norm."""

    def __init__(self, delta: EncodedDelta, start: int, stop: int) -> None:
        self.delta, self.start, self.stop = delta, start, stop

    def read(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.delta.read(self.start + a, self.start + b, out)


def _part(delta: Delta, where: list[tuple[int, int]], scratch):
    """One tensor's values of ``delta``: a view (one span of a tensor), an encoded delta's
    span decoded into ``scratch(n)`` (up to ``merge_sizes.WHOLE_SPAN_VALUES``) or a
    ``_Span`` read where it is used, or, for a tensor cut into several spans, the spans
    gathered into a new tensor (as ``merge.merge_contributions`` gathers them)."""
    if len(where) == 1:
        a, b = where[0]
        if isinstance(delta, torch.Tensor):
            return delta[a:b]
        if b - a <= merge_sizes.WHOLE_SPAN_VALUES:
            return delta.read(a, b, scratch(b - a)[: b - a])
        return _Span(delta, a, b)
    if isinstance(delta, torch.Tensor):
        return torch.cat([delta[a:b] for a, b in where])
    return torch.cat([delta.read(a, b) for a, b in where])


def _piece(v, a: int, b: int) -> torch.Tensor:
    """Values ``[a, b)`` of a part (``_part``)."""
    return v[a:b] if isinstance(v, torch.Tensor) else v.read(a, b)


def _weighted_mean_into(out, parts, ws, total, share, chunk) -> None:
    """``out := Σ w·v / Σ w · share`` (``merge.weighted_mean``'s order of sums; ``× share``
    when it is not 1), chunk by chunk: each chunk's last product while it is in cache."""

    def mean(a: int, b: int) -> None:
        piece = out[a:b].zero_()
        for v, w in zip(parts, ws, strict=True):
            if w:
                piece.add_(_piece(v, a, b), alpha=w / total)
        if share != 1.0:
            piece.mul_(share)

    for_each_chunk(out.numel(), chunk, mean)


def _norm(v: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(v, dtype=torch.float32))


def _rda_into(out, parts, ws, share, chunk, scratch=codecs.new_vector) -> None:
    """``out := merge.rda(parts, ws) · share``: the norms first (whole, side by side), then
    the direction chunk by chunk into ``out``, its norm (whole), then its scaling and the
    share's chunk by chunk (one pass over ``out`` for both, the same two products per
    value). The chunks are split over ``chunk_threads``' threads: the same bits."""
    total = sum(ws)
    radius = 0.0
    factors = []

    def norm_of(v) -> float:  # (a whole tensor's norm: an encoded part decoded whole first)
        if isinstance(v, torch.Tensor):
            return _norm(v)
        n = v.stop - v.start
        return _norm(v.read(0, n, scratch(n)[:n]))

    for v, w, norm in zip(parts, ws, map_whole(norm_of, parts), strict=True):
        if w and norm > 0:
            radius += w * norm / total
            factors.append((v, w / (total * norm)))

    def direction(a: int, b: int) -> None:
        piece = out[a:b].zero_()
        for v, factor in factors:
            piece.add_(_piece(v, a, b), alpha=factor)

    for_each_chunk(out.numel(), chunk, direction)
    dir_norm = float(torch.linalg.vector_norm(out))
    if dir_norm < CANCEL_TOL:
        _weighted_mean_into(out, parts, ws, total, share, chunk)
        return
    scale = radius / dir_norm

    def scaled(a: int, b: int) -> None:
        piece = out[a:b].mul_(scale)
        if share != 1.0:
            piece.mul_(share)

    for_each_chunk(out.numel(), chunk, scaled)


def merge_into(
    out: torch.Tensor,
    deltas: Sequence[Delta],
    weights: Sequence[float],
    share: float,
    fragment,
    is_embedding: Callable[[str], bool],
    *,
    chunk: int = CHUNK_VALUES,
    scratch: Callable[[int], torch.Tensor] = codecs.new_vector,
) -> torch.Tensor:
    """``out := merge.merge_contributions(deltas, weights, fragment, is_embedding) · share``
    (``× share`` only when it is not 1), bit for bit, without a whole-tensor temporary
    (``out``: a flat float32 tensor of the deltas' length, not one of them). A tensor cut
    into several spans of the fragment is gathered as ``merge_contributions`` gathers it.
    An ``EncodedDelta`` is decoded where it is read (the bits of its decoded tensor): a
    tensor's span into a ``scratch(n)`` buffer, held while that tensor is merged, or, beyond
    ``merge_sizes.WHOLE_SPAN_VALUES``, whole for its norm (let go right after) and a chunk
    at a time for the sums. Returns ``out``."""
    ws = check_contributions(deltas, weights)
    if out.shape != deltas[0].shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 of shape {tuple(deltas[0].shape)}")
    spans = {"": [(0, out.numel())]} if fragment is None else spans_by_tensor(fragment)
    covered = 0
    for name, where in spans.items():
        mean = fragment is not None and is_embedding(name)
        parts = [_part(d, where, scratch) for d in deltas]
        if len(where) == 1:
            target = out[where[0][0] : where[0][1]]
        else:  # (rare: gathered as the whole-tensor merge gathers it)
            target = torch.empty(sum(b - a for a, b in where), dtype=torch.float32)
        if mean:
            _weighted_mean_into(target, parts, ws, sum(ws), share, chunk)
        else:
            _rda_into(target, parts, ws, share, chunk, scratch)
        if len(where) > 1:
            start = 0
            for a, b in where:
                out[a:b] = target[start : start + (b - a)]
                start += b - a
        del parts  # (decoded spans go back before the next tensor's are asked for)
        covered += sum(b - a for a, b in where)
    if covered != out.numel():
        raise ValueError(
            f"fragment pieces cover {covered} values but the deltas have {out.numel()}"
        )
    return out


def down_step(
    params: torch.Tensor,
    wire: torch.Tensor,
    codec: str,
    *,
    chunk: int = CHUNK_VALUES,
    empty: Callable[[int], torch.Tensor] = codecs.new_vector,
) -> tuple[bytes, torch.Tensor]:
    """``(d, W')``: the broadcast delta ``d = codecs.encode(Θ_p − W_p, codec)`` and the wire
    image a learner holds after applying it, ``W' = W_p + codecs.decode(d)`` (a new tensor
    from ``empty(n)``, every value written; ``params`` and ``wire`` are not changed), bit for
    bit, made ``chunk`` values at a time (a multiple of ``codecs.ALIGN_VALUES``)."""
    if chunk <= 0 or chunk % codecs.ALIGN_VALUES:
        raise ValueError(f"chunk must be a positive multiple of {codecs.ALIGN_VALUES}")
    n = params.numel()
    params, wire = params.reshape(-1), wire.reshape(-1)
    after = empty(n)
    if n == 0:
        return codecs.encode(params - wire, codec), after
    payloads: list[bytes] = [b""] * (-(-n // chunk))

    def encoded(a: int, b: int) -> None:
        payload, values = codecs.encode_decoded(params[a:b] - wire[a:b], codec)
        torch.add(wire[a:b], values, out=after[a:b])
        payloads[a // chunk] = payload

    for_each_chunk(n, chunk, encoded)  # (split over chunk_threads' threads: the same bytes)
    sections: list[list[memoryview]] = [[] for _ in codecs.payload_sections(0, codec)]
    for i, payload in enumerate(payloads):
        view, at = memoryview(payload), 0
        for k, size in enumerate(
            codecs.payload_sections(min(n, (i + 1) * chunk) - i * chunk, codec)
        ):
            sections[k].append(view[at : at + size])
            at += size
    return b"".join(piece for section in sections for piece in section), after

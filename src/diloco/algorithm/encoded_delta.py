"""A delta kept as the uploads that make it, decoded a span at a time when it is read.

The syncer holds every admitted upload of its open rounds until their commit. Decoded, each
is 4 bytes per value of its fragment: at 1B parameters, P = 24 and M = 4 learners the open
rounds held 8 to 12 of them, 1.3-2 bytes per parameter of the syncer's memory. As it arrived
(``sign1``: 0.156 bytes per value) the same upload is 26 times smaller. An
:class:`EncodedDelta` is that: its uploads' payloads (summed in order, as a learner's late
upload and its answer to the round are), decoded only where something reads them: a span for
a tensor's norm, a chunk for the merge's passes (``diloco.algorithm.streaming``), a sample
for the direction check (``diloco.algorithm.direction``).

**The same bits.** A span is decoded from the payload's own bytes for the values around it
(every codec encodes each ``codecs.ALIGN_VALUES`` values on their own,
``codecs.payload_sections``), so reading values ``[a, b)`` gives, bit for bit,
``codecs.decode(payload)[a:b]``; a sum of uploads is summed in their order, as the whole
decoded tensors were.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from diloco.algorithm import codecs
from diloco.algorithm.codec_sizes import BLOCK_SIZE, SIGN_BLOCKS, CodecError, encoded_nbytes

Encoded = tuple[str, bytes]
"""One upload's delta as it arrived: ``(codec, payload)``."""

READ_CHUNK_VALUES = 1 << 20
"""Values a read decodes at a time (4 MB of float32), a multiple of ``codecs.ALIGN_VALUES``.
Each chunk costs a few calls that let go of the interpreter lock, and a thread that lets it
go may wait for another thread's turn to get it back: beside a thread running Python, a
42M-value sign1 norm took 3.1 s in chunks of 2^18 values, 2.5 s in chunks of 2^20 and 1.8 s
decoded whole (reference machine, median of 5; 17-22 ms each alone)."""

_INT_LEVELS = {"int8": 1, "int4": 2, "int2": 4}  # codes per byte


def decode_span(
    data: bytes | memoryview,
    numel: int,
    codec: str,
    start: int,
    stop: int,
    empty: Callable[[int], torch.Tensor] = codecs.new_vector,
) -> torch.Tensor:
    """Values ``[start, stop)`` of the ``numel``-value payload ``data``: bit for bit
    ``codecs.decode(data, numel, codec)[start:stop]``, decoded from the bytes of the
    ``codecs.ALIGN_VALUES``-aligned values around them only (a view of ``empty(k)``, ``k``
    at most ``stop − start`` plus two aligned pieces). The payload's length is not checked
    here (``EncodedDelta`` does it once); what ``decode`` refuses in those bytes raises."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"span [{start}, {stop}) is outside [0, {numel}]")
    align = codecs.ALIGN_VALUES
    first = start - start % align
    last = min(numel, -(-stop // align) * align)
    mv = memoryview(data).cast("B")
    pieces, at = [], 0
    for whole, before, size in zip(
        codecs.payload_sections(numel, codec),
        codecs.payload_sections(first, codec),
        codecs.payload_sections(last - first, codec),
        strict=True,
    ):
        pieces.append(mv[at + before : at + before + size])
        at += whole
    values = codecs.decode(b"".join(pieces), last - first, codec, empty)
    return values[start - first : stop - first]


def values_at(data: bytes | memoryview, numel: int, codec: str, indices: torch.Tensor):
    """``codecs.decode(data, numel, codec)[indices]`` bit for bit, read from the payload at
    those indices only (``sign1``, ``sign1w``, the ``int`` codecs, ``fp32``, ``bf16``), or
    by decoding it a chunk at a time (``topk2``). A float32 tensor of ``len(indices)``."""
    mv = memoryview(data).cast("B")
    idx = indices.numpy().astype(np.int64)
    if codec in SIGN_BLOCKS:
        nb = -(-numel // SIGN_BLOCKS[codec])
        scale_bits = np.frombuffer(mv, dtype="<u4", count=nb).astype(np.uint32)
        packed = np.frombuffer(mv, dtype=np.uint8, offset=4 * nb)
        negative = (packed[idx >> 3] >> (idx & 7).astype(np.uint8)) & 1
        bits = scale_bits[idx // SIGN_BLOCKS[codec]] ^ (negative.astype(np.uint32) << 31)
        return torch.from_numpy(bits.view(np.float32).copy())
    if codec in _INT_LEVELS:
        per_byte = _INT_LEVELS[codec]
        nb = -(-numel // BLOCK_SIZE)
        scale = np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32)
        raw = np.frombuffer(mv, dtype=np.uint8, offset=4 * nb)[idx // per_byte]
        if per_byte == 1:
            codes = raw.view(np.int8)
        else:  # (each byte's codes, as decode reads them: a table row per byte)
            table = codecs.codes_of_byte(codec).view(np.int8).reshape(256, per_byte)
            codes = table[raw, idx % per_byte]
        return torch.from_numpy(codes.astype(np.float32) * scale[idx // BLOCK_SIZE])
    if codec == "fp32":
        return torch.from_numpy(np.frombuffer(mv, dtype="<f4")[idx].astype(np.float32))
    if codec == "bf16":
        high = np.frombuffer(mv, dtype="<u2")[idx].astype(np.uint32) << 16
        return torch.from_numpy(high.view(np.float32))
    out = torch.empty(idx.size, dtype=torch.float32)  # (topk2: chunk by chunk)
    order = np.argsort(idx, kind="stable")
    ranked = idx[order]
    for a in range(0, numel, READ_CHUNK_VALUES):
        b = min(numel, a + READ_CHUNK_VALUES)
        lo, hi = np.searchsorted(ranked, [a, b])
        if lo < hi:
            chunk = decode_span(mv, numel, codec, a, b)
            out[torch.from_numpy(order[lo:hi])] = chunk[torch.from_numpy(ranked[lo:hi] - a)]
    return out


class EncodedDelta:
    """A delta of ``numel`` values held as its uploads' payloads, ``Σ decode(upload)`` in
    their order, decoded where it is read (see the module docstring). Immutable: ``plus``
    makes the sum with a later upload. Its payloads' lengths are checked when it is made;
    their values by ``norm`` (the syncer's admission reads them all)."""

    def __init__(self, parts: Sequence[Encoded], numel: int) -> None:
        if not parts:
            raise ValueError("an encoded delta needs at least one upload")
        for codec, payload in parts:
            codecs.check_codec(codec)
            want = encoded_nbytes(numel, codec)
            if len(payload) != want:
                raise CodecError(
                    f"{codec}: payload is {len(payload)} bytes, expected {want} for {numel} values"
                )
        self.parts: tuple[Encoded, ...] = tuple(parts)
        self._numel = numel

    def numel(self) -> int:
        """Values it holds (as ``torch.Tensor.numel``)."""
        return self._numel

    @property
    def shape(self) -> torch.Size:
        """``(numel,)``: the flat fragment vector it stands for."""
        return torch.Size([self._numel])

    @property
    def nbytes(self) -> int:
        """The bytes it holds: its payloads'."""
        return sum(len(payload) for _, payload in self.parts)

    def plus(self, later: EncodedDelta) -> EncodedDelta:
        """This delta with ``later``'s uploads summed after its own."""
        if later.numel() != self._numel:
            raise ValueError(f"deltas of {self._numel} and {later.numel()} values cannot be summed")
        return EncodedDelta(self.parts + later.parts, self._numel)

    def read(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[start, stop)`` into ``out`` (float32, ``stop − start`` values; new by
        default): the uploads' decoded spans summed in their order, ``READ_CHUNK_VALUES``
        at a time (what a read allocates beyond ``out`` stays under a few MB, which the C
        allocator reuses: ``runtime.memory``); a chunk aligned to whole codec pieces is
        decoded straight into ``out``. Returns ``out``."""
        n = stop - start
        if out is None:
            out = torch.empty(n, dtype=torch.float32)
        elif out.numel() != n or out.dtype != torch.float32:
            raise ValueError(f"out must be float32 of {n} values")
        a = start
        while a < stop:
            b = min(stop, (a // READ_CHUNK_VALUES + 1) * READ_CHUNK_VALUES)
            piece = out[a - start : b - start]
            for i, (codec, payload) in enumerate(self.parts):
                if i:
                    piece.add_(decode_span(payload, self._numel, codec, a, b))
                    continue

                def into_piece(k: int, piece=piece) -> torch.Tensor:
                    return piece if k == piece.numel() else codecs.new_vector(k)

                span = decode_span(payload, self._numel, codec, a, b, into_piece)
                if span.data_ptr() != piece.data_ptr():  # (decoded around it: copied in)
                    piece.copy_(span)
            a = b
        return out

    def at(self, indices: torch.Tensor) -> torch.Tensor:
        """The values at ``indices`` (a new float32 tensor), summed in the uploads' order."""
        total = None
        for codec, payload in self.parts:
            values = values_at(payload, self._numel, codec, indices)
            total = values if total is None else total.add_(values)
        return total

    def decoded(self, empty: Callable[[int], torch.Tensor] = codecs.new_vector) -> torch.Tensor:
        """The whole delta, decoded into a view of ``empty(numel)``."""
        return self.read(0, self._numel, empty(self._numel)[: self._numel])

    def norm(self) -> float:
        """``‖delta‖``: for one upload of a sign codec from its scales alone
        (``codecs.payload_norm``), else from one pass a chunk at a time (the chunks' norms
        summed in float64); not the bits of a whole-tensor norm, but ``inf`` where that one
        overflows float32 (its sum of squares past float32's largest value: the norm guard
        refuses it, as it refused the decoded tensor's). Raises what ``codecs.decode``
        raises on a bad payload: the syncer admits an upload only after this."""
        if len(self.parts) == 1:
            codec, payload = self.parts[0]
            fast = codecs.payload_norm(payload, self._numel, codec)
            if fast is not None:
                return fast
        squares = 0.0
        chunk = torch.empty(min(self._numel, READ_CHUNK_VALUES), dtype=torch.float32)
        for a in range(0, self._numel, READ_CHUNK_VALUES):
            b = min(self._numel, a + READ_CHUNK_VALUES)
            squares += float(torch.linalg.vector_norm(self.read(a, b, chunk[: b - a]))) ** 2
        return math.inf if squares > codecs.F32_MAX else math.sqrt(squares)

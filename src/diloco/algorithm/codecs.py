"""Wire formats for tensors: ``fp32``, ``bf16``, ``int8``, ``int4``, ``int2``, ``sign1``, ``sign1w`` and the sparse ``topk2``.

Why these (docs/algorithm.md, "What travels"): learners send outer gradients ``Δ = A_p − θ_p`` *up* to the syncer,
in ``sign1`` by default (``int4`` until 2026-11-27; the paper found int4 outer gradients about
as good as bf16; signs with the learners' error feedback cost about as little). The syncer
sends each version *down* as a delta against what learners hold, in ``int2`` by default
(``int8`` until 2026-11-27; its rounding stays on the syncer and goes out with the next
delta); keyframes are ``fp32``. The default's choice is measured in benchmarks/RESULTS.md
("The default at 200×"). ``topk2`` is an experiment (``diloco.wire.experimental``: no named
``--comms`` setting uses it): 2-bit values of each chunk's few largest entries, the rest
carried by error feedback both ways.

Payloads are raw little-endian bytes (never pickle). A payload carries no header: the receiver
knows the codec and the shape from the message around it, and :func:`decode` checks that the
length is exactly :func:`encoded_nbytes`. The tensor is flattened in row-major order. Every
multi-byte value goes through a numpy dtype with explicit ``<`` byte order, so payloads are
little-endian on any host (a big-endian host byte-swaps).

=======  ==========================================================  =========================
codec    byte layout (n values)                                      error bound per value
=======  ==========================================================  =========================
fp32     n × float32                                                 exact
bf16     n × uint16, the bfloat16 bits (round-to-nearest-even)       ``|x|·2⁻⁸`` (relative)
int8     nb × float32 scales, then n × int8 in [-127, 127]           ``scale/2``, scale=absmax/127
int4     nb × float32 scales, then ⌈n/2⌉ bytes of signed nibbles     ``scale/2``, scale=absmax/7
int2     nb × float32 scales, then ⌈n/4⌉ bytes of 2-bit codes        ``scale/2``, scale=absmax
sign1    nb × float32 scales, then ⌈n/8⌉ bytes of sign bits          ``absmax`` (see below)
sign1w   nw × float32 scales, then ⌈n/8⌉ bytes of sign bits          ``absmax`` (see below)
=======  ==========================================================  =========================

``nb = ⌈n / BLOCK_SIZE⌉``; block ``b`` holds values ``[b·BLOCK_SIZE, (b+1)·BLOCK_SIZE)`` (the
last one may be partial) and ``absmax`` is the largest ``|x|`` in the block. Quantization is
symmetric absmax: ``q = round(x / absmax · L)`` with ``L = 127``, ``7`` or ``1`` (round half
to even), decoded as ``q · scale``. The range is symmetric so zero is exact and ±absmax round-trip
to ±absmax; a block of zeros has scale 0 and decodes to exact zeros. int4 nibbles are two's
complement, two per byte, the *low* nibble first; for odd n the last high nibble is 0. int2
is ternary (-1, 0, +1 times the block's absmax: a value below half the absmax is sent as 0),
four two's-complement codes per byte, the lowest bits first, padding codes 0 (0.281 bytes
per value; error feedback carries what it rounds away, as for the others). The values -128
(int8), -8 (int4) and -2 (int2) are never produced and are refused on decode, as are set
int2 padding bits.

**sign1** (dense, one bit per value): a value is sent as its block's scale with its own sign,
the scale being the block's mean ``|x|`` (over its real values; of all one-scale codes the one
with the least squared error). A bit is set for a negative value, eight per byte, the first in
the lowest bit, padding bits 0 (set ones are refused, as are negative scales). A zero decodes
as ``+scale`` unless its whole block is zero. ``0.156`` bytes per value (3.4× fewer than int4);
one payload's error is up to the block's ``absmax``, and error feedback sends it later (as for
the others). **sign1w** is the same with wide blocks of ``WIDE_BLOCK_SIZE = 1024`` values per
scale (``nw = ⌈n / 1024⌉``): ``0.129`` bytes per value, 17% fewer than sign1, for the links of
the lowest setting, where the scales are a fifth of sign1's bytes.

The bounds hold up to float32 rounding (a few ulps of absmax, see :func:`roundtrip_error_bound`);
values below float32's smallest normal (~1.2e-38) may lose all precision in a block whose absmax
is itself that small.

**topk2** (sparse; experimental, in no named setting): each chunk of ``TOPK_CHUNK = 1024`` values
keeps its ``TOPK_K = 32`` largest ``|x|`` (3.1%; of equal ones the lower offsets), the rest
is sent as zero. A kept value is 2
bits: its sign and whether its magnitude is in the chunk's upper group (``|x| ≥ (min + max)/2``
of the kept magnitudes; every non-zero one if the chunk keeps a zero, so zeros decode as
zeros); it decodes as ``±hi`` or ``±lo``, the mean magnitude of its group.
Layout: ``nc × (lo, hi)`` float32 scale pairs (``nc = ⌈n / TOPK_CHUNK⌉``), then one uint16
offset within its chunk per kept value (chunk after chunk, strictly increasing within a
chunk), then the 2-bit codes, four per byte, the first in the low bits (bit 0: negative, bit
1: upper group; the last byte's unused bits are 0). The last chunk keeps ``min(TOPK_K, its
length)`` values. ``0.078`` bytes per value: 6.8× fewer than int4, 13× fewer than int8. What
it drops is not lost: senders keep ``x − decode(encode(x))`` and send it with the next delta
(error feedback: the learner's undelivered progress up, the syncer's ``Θ − W`` down), so the
error bound of one payload is only ``max|x|``; decoding refuses offsets out of order or out
of range, scales with ``lo > hi``, negative or non-finite, and set padding bits.

``BLOCK_SIZE = 128`` with float32 scales: int4 costs ``0.5 + 4/128 = 0.531`` bytes per value and
int8 ``1.031``. float16 scales would save 2 bytes per block but overflow above 65504 (and lose
precision below 6e-5), which outer gradients of a diverging run can reach; float32 scales never
do. Smaller blocks track outliers better but cost more bytes; 128 keeps the overhead near 6 %.

Non-finite input (NaN/Inf, including values that overflow float32 or bfloat16) is refused with
:class:`NonFiniteError`: a NaN on the wire would poison every learner after the next merge.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import numpy as np
import torch

from diloco.algorithm.codec_sizes import (
    BLOCK_SIZE,
    CODECS,  # noqa: F401 (re-exported: codecs.CODECS)
    SIGN_BLOCKS,
    TOPK_CHUNK,
    TOPK_K,
    WIDE_BLOCK_SIZE,  # noqa: F401 (re-exported)
    CodecError,
    check_codec,
    encoded_nbytes,
    topk_counts,
)

_LEVELS = {"int8": 127, "int4": 7, "int2": 1}  # largest |q|
F32_MAX = float(torch.finfo(torch.float32).max)
"""float32's largest finite value."""
_F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32
DECODE_CHUNK_VALUES = 1 << 18
"""Values a sign decode writes at a time (1 MB of float32): its passes over them stay in the
CPU's caches."""
_BF16_REL = 2.0**-8  # half an ulp of bfloat16's 8-bit significand, relative


def new_vector(n: int) -> torch.Tensor:
    """A new uninitialised float32 vector of ``n`` values: the default ``empty`` of the
    functions that write a fragment-sized result (``decode``, ``streaming``'s and the
    syncer's), which a caller may replace by its own buffers (``runtime.buffers``)."""
    return torch.empty(n, dtype=torch.float32)


class NonFiniteError(CodecError):
    """A tensor (to encode) or payload (to decode) holds NaN or Inf values."""


ALIGN_VALUES = TOPK_CHUNK
"""Every codec encodes the values ``[k·ALIGN_VALUES, (k+1)·ALIGN_VALUES)`` on their own (its
blocks and chunks divide it) into whole bytes of each section: a payload can be made piece
by piece (``payload_sections``)."""


def payload_sections(numel: int, codec: str) -> list[int]:
    """The sizes of the sections of ``codec``'s payload of ``numel`` values, in order (the
    byte layout in the module docstring: scales, then offsets, then codes). A payload of
    values cut at multiples of ``ALIGN_VALUES`` is, section by section, the concatenation of
    its pieces' sections: what ``diloco.algorithm.streaming`` encodes by. Pure."""
    check_codec(codec)
    total = encoded_nbytes(numel, codec)
    if codec in _LEVELS or codec in SIGN_BLOCKS:
        block = SIGN_BLOCKS.get(codec, BLOCK_SIZE)
        scales = 4 * -(-numel // block)
        return [scales, total - scales]
    if codec == "topk2":
        chunks, kept = topk_counts(numel)
        return [8 * chunks, 2 * kept, total - 8 * chunks - 2 * kept]
    return [total]


def _non_finite_error(x: torch.Tensor, codec: str, what: str) -> NonFiniteError:
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    return NonFiniteError(
        f"{codec}: {what} has {nan + inf} non-finite value(s) of {x.numel()} "
        f"(NaN: {nan}, Inf: {inf}); refusing it"
    )


def all_finite(t: torch.Tensor) -> bool:
    """True if ``t`` has no NaN/Inf. min/max propagate NaN; far faster than ``isfinite().all()``."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _le(t: torch.Tensor, dtype: str) -> np.ndarray:
    """``t`` (CPU, contiguous) as a numpy array with explicit little-endian ``dtype``."""
    return t.numpy().astype(dtype, copy=False)


def _flat_f32(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise CodecError(f"{codec}: expected a floating-point torch.Tensor, got {tensor!r:.80}")
    return tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)


def _block_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block max |x| of a zero-padded (nb, BLOCK_SIZE) view, ``maximum(max, -min)``;
    NaN/Inf propagate. The maxima and minima come from ``amax`` and ``amin``, an order of
    magnitude faster than ``torch.aminmax`` along rows; a positive result is the same either
    way. A block of zeros has a scale of +0 or -0, and payloads carry that sign as they always
    did: its min and max are ``torch.aminmax``'s, and ``maximum`` runs over the whole vectors
    (its vector lanes and its scalar tail pick between +0 and -0 by a block's position)."""
    hi, lo = blocks.amax(1), blocks.amin(1)
    zero = ((hi == 0) & (lo == 0)).nonzero().view(-1)
    if zero.numel():
        lo[zero], hi[zero] = torch.aminmax(blocks[zero], dim=1)
    return torch.maximum(hi, -lo)


def encode(tensor: torch.Tensor, codec: str) -> bytes:
    """Encode ``tensor`` (any float dtype, shape and device) into ``codec``'s payload.

    Deterministic: the same values always give the same bytes. The input is not modified.
    Raises :class:`NonFiniteError` if any value is NaN/Inf (or overflows float32/bfloat16),
    :class:`CodecError` for an unknown codec or a non-float tensor.
    """
    check_codec(codec)
    if codec in _LEVELS:
        return _encode_int(tensor, codec)
    x = _flat_f32(tensor, codec)
    if codec == "topk2" or codec in SIGN_BLOCKS:
        if not all_finite(x):
            raise _non_finite_error(x, codec, "tensor")
        return _encode_topk(x) if codec == "topk2" else _encode_sign(x, SIGN_BLOCKS[codec])
    if codec == "fp32":
        if not all_finite(x):
            raise _non_finite_error(x, codec, "tensor")
        return _le(x, "<f4").tobytes()
    y = x.to(torch.bfloat16)  # round to nearest even
    if not all_finite(y):
        raise _non_finite_error(y, codec, "tensor (after rounding to bfloat16)")
    return _le(y.view(torch.int16), "<i2").tobytes()


def _int_codes(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, q)`` of an int codec: per block its float32 scale, and the int8 codes of
    ``tensor``'s values in ``(nb, BLOCK_SIZE)`` blocks (a partial last block padded with 0
    codes). ``tensor`` is not modified; a contiguous float32 CPU tensor of whole blocks is
    read where it is, without a working copy."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise CodecError(f"{codec}: expected a floating-point torch.Tensor, got {tensor!r:.80}")
    src = tensor.detach().reshape(-1)
    n = src.numel()
    nb = -(-n // BLOCK_SIZE)
    shared = src.dtype == torch.float32 and src.device.type == "cpu" and src.is_contiguous()
    shared = shared and n % BLOCK_SIZE == 0
    if shared:
        blocks = src.view(nb, BLOCK_SIZE)  # the caller's values: read only
    else:
        buf = torch.empty(nb * BLOCK_SIZE, dtype=torch.float32)  # working copy, zero-padded
        buf[:n].copy_(src)
        buf[n:].zero_()
        blocks = buf.view(nb, BLOCK_SIZE)
    absmax = _block_absmax(blocks)
    if not all_finite(absmax):
        raise _non_finite_error(blocks.view(-1)[:n], codec, "tensor")
    levels = _LEVELS[codec]
    scale = absmax / levels
    # Keep levels·scale <= absmax so decoding never overflows float32 (absmax near FLT_MAX).
    scale = torch.where(scale * levels > absmax, torch.nextafter(scale, torch.zeros(())), scale)
    # x / absmax is in [-1, 1] even for subnormal absmax (1/absmax could overflow).
    denom = torch.where(absmax > 0, absmax, torch.ones(()))[:, None]
    q = blocks / denom if shared else blocks.div_(denom)
    if levels != 1:  # (× 1 changes no float: int2 skips that pass)
        q.mul_(levels)
    return scale, q.round_().to(torch.int8)


def _pack_codes(q: torch.Tensor, n: int, codec: str) -> np.ndarray:
    """The code bytes of ``n`` values' int8 codes ``q`` (zero-padded to whole blocks): int8
    as they are; int4 two nibbles per byte, int2 four pairs of bits, the first value in the
    lowest bits. Done on little-endian words (``<u2`` / ``<u4``: the same bytes on any host)
    that hold one byte's codes: masked, then shifted down onto the low byte."""
    codes = q.numpy().reshape(-1)
    if codec == "int8":
        return codes[:n].view(np.uint8)
    if codec == "int4":
        words = codes.view("<u2") & 0x0F0F  # (nb·BLOCK_SIZE is even)
        words |= words >> 4
        return words.astype(np.uint8)[: (n + 1) // 2]
    words = codes.view("<u4") & 0x03030303  # int2 (nb·BLOCK_SIZE is a multiple of 4)
    words |= words >> 6
    words |= words >> 12
    return words.astype(np.uint8)[: (n + 3) // 4]


def _encode_int(tensor: torch.Tensor, codec: str) -> bytes:
    scale, q = _int_codes(tensor, codec)
    return _le(scale, "<f4").tobytes() + _pack_codes(q, tensor.numel(), codec).tobytes()


def encode_decoded(tensor: torch.Tensor, codec: str) -> tuple[bytes, torch.Tensor]:
    """``(data, values)``: ``data = encode(tensor, codec)`` and ``values = decode(data,
    tensor.shape, codec)``, bit for bit: what a sender that keeps its receivers' image needs
    (the syncer's down step). The int codecs take the values from their codes (each code
    times its block's scale, as decoding does) instead of unpacking the payload again."""
    check_codec(codec)
    if codec not in _LEVELS:
        data = encode(tensor, codec)
        return data, decode(data, tuple(tensor.shape), codec)
    scale, q = _int_codes(tensor, codec)
    n = tensor.numel()
    data = _le(scale, "<f4").tobytes() + _pack_codes(q, n, codec).tobytes()
    values = q.to(torch.float32).mul_(scale[:, None]).view(-1)[:n]
    return data, values.view(tuple(tensor.shape))


def _numel(shape: tuple[int, ...] | int) -> tuple[tuple[int, ...], int]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in dims):
        raise CodecError(f"bad shape {shape!r}: dimensions must be non-negative ints")
    return dims, math.prod(dims)


def decode(
    data: bytes | bytearray | memoryview,
    shape: tuple[int, ...] | int,
    codec: str,
    empty: Callable[[int], torch.Tensor] = new_vector,
) -> torch.Tensor:
    """Decode a payload into a float32 tensor of ``shape``: a view of ``empty(k)`` (a
    contiguous float32 vector of at least ``k`` values, its contents never read; ``k`` is
    ``numel``, rounded up to whole blocks for a sign codec), every value written; the caller
    owns it.

    Raises :class:`CodecError` if ``len(data) != encoded_nbytes(numel, codec)``, on an unknown
    codec or bad shape, or on a quantized code the encoder never produces; raises
    :class:`NonFiniteError` if a decoded value or scale is NaN/Inf.
    """
    check_codec(codec)
    dims, n = _numel(shape)
    mv = memoryview(data).cast("B")
    want = encoded_nbytes(n, codec)
    if mv.nbytes != want:
        raise CodecError(
            f"{codec}: payload is {mv.nbytes} bytes, expected {want} for {n} values {dims}"
        )
    if codec in _LEVELS:
        out = _decode_int(mv, n, codec, empty)
    elif codec == "topk2":
        out = _decode_topk(mv, n, empty)
    elif codec in SIGN_BLOCKS:
        out = _decode_sign(mv, n, codec, empty)
    else:
        out = empty(n)[:n]
        if codec == "fp32":
            out.numpy()[:] = np.frombuffer(mv, dtype="<f4")  # (to native order)
        else:
            # bfloat16 bits are the high half of float32: place them, zero the low half.
            wide = out.numpy().view(np.uint16)
            high = 1 if sys.byteorder == "little" else 0
            wide[1 - high :: 2] = 0
            wide[high::2] = np.frombuffer(mv, dtype="<u2")
        if not all_finite(out):
            raise _non_finite_error(out, codec, "payload")
    return out.view(dims)


def _codes_of_byte(per_byte: int) -> np.ndarray:
    """Entry b: the ``per_byte`` codes of byte b (two's complement, the lowest bits first)
    as int8 bytes of one little-endian word, the first code in its lowest byte."""
    width = 8 // per_byte
    words = []
    for b in range(256):
        fields = [(b >> (width * k)) & ((1 << width) - 1) for k in range(per_byte)]
        words.append(bytes((f - (f >> (width - 1) << width)) & 0xFF for f in fields))
    return np.frombuffer(b"".join(words), dtype=f"<u{per_byte}")


_CODES_OF_BYTE = {"int4": _codes_of_byte(2), "int2": _codes_of_byte(4)}


def codes_of_byte(codec: str) -> np.ndarray:
    """``int4``'s or ``int2``'s table: entry b holds byte b's codes, as :func:`decode` reads
    them (a copy: the table itself stays as it is)."""
    return _CODES_OF_BYTE[codec].copy()


def _decode_int(mv: memoryview, n: int, codec: str, empty) -> torch.Tensor:
    levels = _LEVELS[codec]
    nb = -(-n // BLOCK_SIZE)
    scale = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32))
    if not all_finite(scale):
        raise _non_finite_error(scale, codec, "payload scales")
    if bool((scale < 0).any()) or bool((scale > F32_MAX / levels).any()):
        raise CodecError(f"{codec}: payload has a scale outside [0, float32 max / {levels}]")
    codes = np.frombuffer(mv, dtype=np.int8, offset=4 * nb)
    if codec in _CODES_OF_BYTE:  # each byte's codes at once: one table lookup per byte
        codes = np.take(_CODES_OF_BYTE[codec], codes.view(np.uint8), mode="clip").view(np.int8)
    if codec == "int2" and bool(codes[n:].any()):
        raise CodecError(f"{codec}: payload has set padding bits after the last value")
    codes = codes[:n]
    if n and int(codes.min()) == -(levels + 1):
        raise CodecError(f"{codec}: payload holds the code -{levels + 1}, never produced")
    out = empty(n)[:n]
    out.numpy()[:] = codes  # |code| <= levels and scale <= max /
    full = (n // BLOCK_SIZE) * BLOCK_SIZE  # levels: all finite
    out[:full].view(-1, BLOCK_SIZE).mul_(scale[: full // BLOCK_SIZE, None])
    if full < n:
        out[full:].mul_(scale[-1])
    return out


def roundtrip_error_bound(tensor: torch.Tensor, codec: str) -> float:
    """Largest ``|decode(encode(t)) - t|`` over elements that ``codec`` guarantees for ``t``.

    fp32: 0. topk2, sign1 and sign1w: ``max|t|`` (see the module docstring). bf16: ``max|t| · 2⁻⁸`` (elementwise the bound is relative: ``|t_i| · 2⁻⁸``).
    int8/int4: the largest ``absmax_b / levels / 2`` over blocks, plus float32 rounding slack
    (2⁻²⁰ of absmax) and an absolute ``2⁻¹²⁶`` for subnormals.
    """
    check_codec(codec)
    x = _flat_f32(tensor, codec)
    if x.numel() == 0 or codec == "fp32":
        return 0.0
    top = float(x.abs().max())
    if codec == "topk2" or codec in SIGN_BLOCKS:  # up to all of a value; feedback sends it later
        return top * (1 + 2.0**-20) + _F32_TINY
    if codec == "bf16":
        return top * _BF16_REL + _F32_TINY
    return top * (0.5 / _LEVELS[codec] + 2.0**-20) + _F32_TINY


# ---------------------------------------------------------------------------------- topk2


def _kept(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, values) of the kept entries of ``x`` (one chunk per row, equal lengths):
    each row's ``min(TOPK_K, row length)`` largest ``|x|``, in increasing offset order."""
    k = min(TOPK_K, x.shape[1])
    # A stable sort: of equal magnitudes the lower offsets are kept (topk's pick is unspecified).
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices
    offsets = order[:, :k].sort(dim=1).values
    return offsets, torch.gather(x, 1, offsets)


def _encode_topk(x: torch.Tensor) -> bytes:
    n = x.numel()
    chunks, _ = topk_counts(n)
    if not chunks:
        return b""
    full = (n // TOPK_CHUNK) * TOPK_CHUNK
    parts = [_kept(x[:full].view(-1, TOPK_CHUNK))] if full else []
    if full < n:
        parts.append(_kept(x[full:].view(1, -1)))
    scales, offsets, codes = [], [], []
    for offs, vals in parts:
        # float64: the midpoint and the sums of values near float32's max overflow in float32
        wide = vals.abs().double()
        lo_end, hi_end = torch.aminmax(wide, dim=1)
        # The upper group: |x| >= the midpoint of the kept range; in a chunk that keeps a
        # zero (fewer non-zero values than TOPK_K), every non-zero value, so zeros stay zero.
        split = torch.where(lo_end > 0, (lo_end + hi_end) / 2, torch.zeros((), dtype=wide.dtype))
        upper = (wide >= split[:, None]) & (wide > 0)
        hi = (wide * upper).sum(1) / upper.sum(1).clamp(min=1)
        lo = (wide * ~upper).sum(1) / (~upper).sum(1).clamp(min=1)
        lo, hi = lo.float(), hi.float()  # a mean is at most its largest value: finite
        scales.append(torch.stack([torch.minimum(lo, hi), hi], dim=1))
        offsets.append(offs.reshape(-1))
        codes.append(((vals < 0).to(torch.uint8) | (upper.to(torch.uint8) << 1)).reshape(-1))
    code = torch.cat(codes)
    packed = torch.zeros(-(-code.numel() // 4) * 4, dtype=torch.uint8)
    packed[: code.numel()] = code
    packed = packed.view(-1, 4)
    packed = packed[:, 0] | (packed[:, 1] << 2) | (packed[:, 2] << 4) | (packed[:, 3] << 6)
    return b"".join(
        (
            _le(torch.cat(scales).reshape(-1), "<f4").tobytes(),
            _le(torch.cat(offsets).to(torch.int32), "<u2").tobytes(),
            packed.numpy().tobytes(),
        )
    )


def _decode_topk(mv: memoryview, n: int, empty) -> torch.Tensor:
    chunks, kept = topk_counts(n)
    out = empty(n)[:n].zero_()
    if not chunks:
        return out
    scales = torch.from_numpy(np.frombuffer(mv, dtype="<f4", count=2 * chunks).astype(np.float32))
    if not all_finite(scales):
        raise _non_finite_error(scales, "topk2", "payload scales")
    lo, hi = scales.view(-1, 2).unbind(1)
    if bool((lo < 0).any()) or bool((lo > hi).any()):
        raise CodecError("topk2: payload has a scale pair that is negative or has lo > hi")
    offsets = torch.from_numpy(
        np.frombuffer(mv, dtype="<u2", count=kept, offset=8 * chunks).astype(np.int64)
    )
    packed = torch.from_numpy(
        np.frombuffer(mv, dtype=np.uint8, offset=8 * chunks + 2 * kept).copy()
    )
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)
    if bool(codes[kept:].any()):
        raise CodecError("topk2: payload has set bits after its last code")
    codes = codes[:kept]
    per_chunk = torch.full((chunks,), TOPK_K, dtype=torch.int64)
    per_chunk[-1] = kept - (chunks - 1) * TOPK_K
    chunk_of = torch.repeat_interleave(torch.arange(chunks), per_chunk)
    length = torch.full((chunks,), TOPK_CHUNK, dtype=torch.int64)
    length[-1] = n - (chunks - 1) * TOPK_CHUNK
    increasing = offsets[1:] > offsets[:-1]
    first_of_chunk = chunk_of[1:] != chunk_of[:-1]
    if bool((offsets >= length[chunk_of]).any()) or not bool((increasing | first_of_chunk).all()):
        raise CodecError("topk2: payload has offsets out of order or out of their chunk")
    magnitude = torch.where((codes & 2).bool(), hi[chunk_of], lo[chunk_of])
    out[chunk_of * TOPK_CHUNK + offsets] = torch.where((codes & 1).bool(), -magnitude, magnitude)
    return out


# ---------------------------------------------------------------------------------- sign1


def _block_counts(n: int, block: int) -> torch.Tensor:
    """Real values in each of the ``⌈n / block⌉`` blocks (the last may be partial). Pure."""
    nb = -(-n // block)
    counts = torch.full((nb,), float(block), dtype=torch.float32)
    if nb:
        counts[-1] = n - (nb - 1) * block
    return counts


def _encode_sign(x: torch.Tensor, block: int) -> bytes:
    n = x.numel()
    nb = -(-n // block)
    buf = torch.zeros(nb * block, dtype=torch.float32)
    buf[:n] = x
    bits = (buf < 0).to(torch.uint8).view(-1, 8)  # nb·block is a multiple of 8
    # each |x| / count before the sum (in place, after the signs were read): a sum of values
    # near float32's max would overflow float32, and a float64 copy costs 8 bytes per value
    scale = buf.view(nb, block).abs_().div_(_block_counts(n, block)[:, None]).sum(1)
    # a mean is at most its largest |x|, but the rounding of a block whose length is not a
    # power of two can carry it above float32's max: keep what is sent decodable
    scale.clamp_(max=F32_MAX)
    packed = np.packbits(bits.numpy(), axis=None, bitorder="little")  # value 8j + k: bit k
    return _le(scale, "<f4").tobytes() + packed[: (n + 7) // 8].tobytes()


_SIGN_BITS_OF_BYTE = np.array(
    [[0x80000000 if b >> k & 1 else 0 for k in range(8)] for b in range(256)], dtype=np.uint32
)
"""Row b: the float32 sign bits of the eight values whose sign bits are byte b (value k: bit k)."""


def _sign_parts(mv: memoryview, n: int, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """A sign payload's scales (native float32) and packed bits, refused as :func:`decode`
    refuses them: non-finite or negative scales, set padding bits."""
    nb = -(-n // SIGN_BLOCKS[codec])
    scale = np.frombuffer(mv, dtype="<f4", count=nb).astype(np.float32)  # (native order)
    if not all_finite(torch.from_numpy(scale)):
        raise _non_finite_error(torch.from_numpy(scale), codec, "payload scales")
    if bool((scale < 0).any()):
        raise CodecError(f"{codec}: payload has a negative scale")
    packed = np.frombuffer(mv, dtype=np.uint8, offset=4 * nb)
    if n % 8 and packed[-1] >> (n % 8):
        raise CodecError(f"{codec}: payload has set padding bits after the last value")
    return scale, packed


def payload_norm(data: bytes | bytearray | memoryview, numel: int, codec: str) -> float | None:
    """``‖decode(data, numel, codec)‖`` read from a sign codec's scales alone (every value of
    a block is ± its scale: ``√Σ count·scale²``, summed in float64, not the bits of a norm
    of the decoded tensor; ``inf`` once the sum of squares passes float32's largest value,
    as a float32 norm overflows), the payload refused as :func:`decode` refuses it; ``None``
    for the other codecs (their values need their codes)."""
    if codec not in SIGN_BLOCKS:
        return None
    mv = memoryview(data).cast("B")
    want = encoded_nbytes(numel, codec)
    if mv.nbytes != want:
        raise CodecError(f"{codec}: payload is {mv.nbytes} bytes, expected {want}")
    scale, _ = _sign_parts(mv, numel, codec)
    counts = _block_counts(numel, SIGN_BLOCKS[codec]).numpy().astype(np.float64)
    squares = float(np.dot(counts, np.square(scale, dtype=np.float64)))
    return math.inf if squares > F32_MAX else math.sqrt(squares)


def _decode_sign(mv: memoryview, n: int, codec: str, empty) -> torch.Tensor:
    block = SIGN_BLOCKS[codec]
    nb = -(-n // block)
    scale, packed = _sign_parts(mv, n, codec)
    # two passes per value, a chunk at a time (in the CPU's caches): its sign bit from a
    # table row per byte, then its block's scale's bits under it: ±scale, exactly the
    # product ±1 · scale (a zero scale included)
    words = empty(nb * block)[: nb * block].numpy().view(np.uint32).reshape(-1, 8)
    scale_bits = scale.view(np.uint32)[:, None]
    per_chunk = max(1, DECODE_CHUNK_VALUES // block)  # blocks
    for first in range(0, nb, per_chunk):
        last = min(nb, first + per_chunk)
        a, b = first * block // 8, last * block // 8  # these blocks' bytes of sign bits
        real = min(b, packed.size) - a  # (the rest: the last block's padding, +)
        rows = words[a:b]
        # (a byte indexes a 256-row table: never out of range; numpy's default mode,
        # "raise", would write into a copy of ``rows`` and copy it back)
        np.take(_SIGN_BITS_OF_BYTE, packed[a : a + real], axis=0, out=rows[:real], mode="clip")
        rows[real:] = 0
        blocks = rows.reshape(last - first, block)
        np.bitwise_xor(blocks, scale_bits[first:last], out=blocks)
    return torch.from_numpy(words.reshape(-1).view(np.float32))[:n]

"""The codecs' names, block sizes and payload sizes: arithmetic only, without torch, so that
the settings and the command line check a codec and size an exchange without loading it.
The byte layouts themselves, and encoding and decoding, are ``diloco.algorithm.codecs``'s."""

from __future__ import annotations

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "int2", "sign1", "sign1w", "topk2")

#: Values per absmax scale block for int8/int4/int2 (one float32 scale each).
BLOCK_SIZE = 128

#: Values per scale block of the sign codecs: sign1's blocks are int4's, sign1w's wide.
WIDE_BLOCK_SIZE = 1024
SIGN_BLOCKS = {"sign1": BLOCK_SIZE, "sign1w": WIDE_BLOCK_SIZE}

#: topk2: values per chunk, and how many of them (the largest |x|) each chunk keeps.
TOPK_CHUNK = 1024
TOPK_K = 32

_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4}  # codes packed in one byte


class CodecError(ValueError):
    """Bad codec name, wrong payload length, bad shape or a payload this codec never produces."""


def check_codec(name: str) -> str:
    """Return ``name`` if it is one of :data:`CODECS`, else raise :class:`CodecError`."""
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; valid codecs are {', '.join(CODECS)}")
    return name


def encoded_nbytes(numel: int, codec: str) -> int:
    """Exact payload size in bytes for ``numel`` values in ``codec``."""
    check_codec(codec)
    if numel < 0:
        raise CodecError(f"numel must be >= 0, got {numel}")
    if codec == "fp32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    if codec == "topk2":
        chunks, kept = topk_counts(numel)
        return 8 * chunks + 2 * kept + (kept + 3) // 4
    if codec in SIGN_BLOCKS:
        return 4 * (-(-numel // SIGN_BLOCKS[codec])) + (numel + 7) // 8
    per_byte = _PER_BYTE[codec]
    return 4 * (-(-numel // BLOCK_SIZE)) + (numel + per_byte - 1) // per_byte


def topk_counts(n: int) -> tuple[int, int]:
    """(chunks, kept values) of ``n`` values in topk2. Pure."""
    chunks = -(-n // TOPK_CHUNK)
    if not chunks:
        return 0, 0
    last = n - (chunks - 1) * TOPK_CHUNK
    return chunks, (chunks - 1) * TOPK_K + min(TOPK_K, last)

"""The int and sign codecs give, byte for byte and bit for bit, what they gave before they
were made faster (``codec_reference``: the former code, written plainly): the same payloads
for every input, the same values or the same refusal for every payload."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_reference import LEVELS, decode_int, decode_sign, encode_int

from diloco.algorithm import codecs
from diloco.algorithm.codecs import BLOCK_SIZE, SIGN_BLOCKS, CodecError, decode, encode

F32_MAX = float(torch.finfo(torch.float32).max)
TINY = float(torch.finfo(torch.float32).tiny)
SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 4096, 4099]


def sizes(gen: np.random.Generator) -> list[int]:
    """Edge sizes and random ones (most with a partial last block)."""
    return SIZES + [int(s) for s in gen.integers(1, 6000, size=12)]


def values(n: int, gen: np.random.Generator) -> torch.Tensor:
    """``n`` float32 values of one of several kinds: ordinary, with zero blocks of mixed
    zero signs, huge (near float32's max), subnormal, exact ties of the quantization, or
    a few distinct values."""
    kind = int(gen.integers(0, 7))
    x = gen.standard_normal(n).astype(np.float32) * np.float32(10.0 ** gen.integers(-6, 6))
    if kind == 1:  # blocks of zeros of both signs, and single zeros
        zero = gen.random(n) < 0.7
        x[zero] = np.where(gen.random(int(zero.sum())) < 0.5, -0.0, 0.0)
    elif kind == 2:
        x = (gen.random(n).astype(np.float32) * 2 - 1) * np.float32(F32_MAX)
    elif kind == 3:  # subnormals, and blocks whose absmax is one
        bits = gen.integers(0, 2**23, size=n).astype(np.int32)  # (exponent 0: subnormal)
        x = bits.view(np.float32) * gen.choice(np.array([-1, 1], dtype=np.float32), size=n)
    elif kind == 4:  # exact halves and sevenths of each block's absmax: the rounding's ties
        steps = gen.integers(-14, 15, size=n).astype(np.float32)
        x = steps / np.float32(14) * np.float32(gen.choice([1.0, 3.0, 1e-30, 1e30]))
    elif kind == 5:
        x = gen.choice(np.array([-1.5, -0.0, 0.0, 2.25, 7.0], dtype=np.float32), size=n)
    elif kind == 6:  # ordinary values with runs of ±0
        for start in gen.integers(0, max(n, 1), size=3):
            x[start : start + 200] = gen.choice(np.array([0.0, -0.0], dtype=np.float32))
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def outcome(fn, *args):
    """What ``fn(*args)`` gives: its value, or its refusal (type and message)."""
    try:
        return fn(*args)
    except CodecError as exc:
        return type(exc), str(exc) if type(exc) is CodecError else ""


def assert_same_outcome(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("codec", sorted(LEVELS))
def test_int_encode_gives_the_former_bytes(codec, threads):
    gen = np.random.default_rng(threads * 100 + len(codec))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in sizes(gen):
            x = values(n, gen)
            before = x.clone()
            assert encode(x, codec) == encode_int(x, codec), n
            assert same_bits(x, before)  # (read in place, never written)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("codec", sorted(LEVELS))
def test_int_encode_of_other_layouts_and_dtypes_gives_the_former_bytes(codec):
    gen = np.random.default_rng(5)
    wide = values(3 * 640, gen).view(3, 640)
    for x in (wide, wide[:, ::2], wide.t(), wide.double() * 1.5, wide.to(torch.bfloat16)):
        before = x.clone()
        assert encode(x, codec) == encode_int(x, codec)
        assert torch.equal(x, before)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = values(1024, gen)
        x[300] = bad
        with pytest.raises(codecs.NonFiniteError):
            encode(x, codec)


def test_zero_blocks_keep_the_scale_sign_they_had():
    """A block of zeros sends its scale as +0 or -0, as it always did (whatever the zeros'
    signs and order, alone or among other blocks)."""
    gen = np.random.default_rng(11)
    for rows in (1, 2, 7, 64):
        signs = gen.random((rows, BLOCK_SIZE)) < gen.random((rows, 1))
        x = torch.from_numpy(np.where(signs, -0.0, 0.0).astype(np.float32)).view(-1)
        mixed = torch.cat([x, torch.randn(BLOCK_SIZE), x[: rows * BLOCK_SIZE - 5]])
        for t in (x, mixed):
            for codec in LEVELS:
                assert encode(t, codec) == encode_int(t, codec)


def test_zero_blocks_keep_their_scale_sign_in_a_tensor_reduced_by_two_threads():
    """Large enough for torch to split the blocks between threads (its grain is 32,768)."""
    gen = np.random.default_rng(12)
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(12)).view(-1, BLOCK_SIZE)
    rows = torch.from_numpy(gen.choice(x.shape[0], size=3000, replace=False))
    x[rows] = torch.from_numpy(np.where(gen.random((3000, BLOCK_SIZE)) < 0.5, -0.0, 0.0)).float()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for t in (x.view(-1), x.view(-1)[:-77]):
            assert encode(t, "int2") == encode_int(t, "int2")
    finally:
        torch.set_num_threads(previous)


def scales(count: int, levels: int, gen: np.random.Generator) -> np.ndarray:
    """Block scales as a payload may hold them: mostly valid, some zero or -0, subnormal, at
    the int codecs' largest valid scale and just above it, negative, NaN or Inf."""
    s = np.abs(gen.standard_normal(count)).astype(np.float32) * np.float32(gen.choice([1e-3, 1]))
    special = np.array(
        [0.0, -0.0, 1e-40, TINY, np.float32(F32_MAX / levels), F32_MAX, -1.0, np.nan, np.inf],
        dtype=np.float32,
    )
    pick = gen.random(count) < 0.02
    s[pick] = gen.choice(special, size=int(pick.sum()))
    return s


def payloads(codec: str, gen: np.random.Generator):
    """``(payload, n)``: real payloads of the encoder, and made-up ones, valid or not."""
    valid_int2 = np.array([b for b in range(256) if all((b >> s) & 3 != 2 for s in (0, 2, 4, 6))])
    for n in sizes(gen):
        x = values(n, gen)
        yield encode(x, codec), n
        nbytes = codecs.encoded_nbytes(n, codec)
        block = SIGN_BLOCKS.get(codec, BLOCK_SIZE)
        nb = -(-n // block)
        head = scales(nb, LEVELS.get(codec, 1), gen).astype("<f4").tobytes()
        body = gen.integers(0, 256, size=nbytes - len(head), dtype=np.uint8)
        if codec == "int2" and gen.random() < 0.7:  # mostly codes the encoder makes
            body = gen.choice(valid_int2, size=body.size).astype(np.uint8)
        if codec != "int8" and body.size and gen.random() < 0.6:  # mostly clear padding
            per_byte = {"int4": 2, "int2": 4}.get(codec, 8)
            used = (n % per_byte) * (8 // per_byte)
            if used:
                body[-1] &= (1 << used) - 1
        yield head + body.tobytes(), n


@pytest.mark.parametrize("codec", [*sorted(LEVELS), *sorted(SIGN_BLOCKS)])
def test_decode_gives_the_former_values_and_refusals(codec):
    gen = np.random.default_rng(len(codec) + 17)
    former = decode_sign if codec in SIGN_BLOCKS else decode_int
    refused = 0
    for _ in range(4):
        for data, n in payloads(codec, gen):
            want = outcome(former, data, n, codec)
            assert_same_outcome(outcome(decode, data, n, codec), want)
            refused += not isinstance(want, torch.Tensor)
    assert refused  # (the made-up payloads include refused ones)


def test_sign_decode_of_zero_and_negative_zero_scales():
    """A set sign bit under a zero scale decodes as -0.0, under a -0.0 scale as +0.0: what
    ±1 · scale gave."""
    for scale in (0.0, -0.0, 1e-45, 3.0):
        data = np.array([scale], dtype="<f4").tobytes() + bytes([0b10110010] * 16)
        assert same_bits(decode(data, 128, "sign1"), decode_sign(data, 128, "sign1"))


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_encode_decoded_is_encode_then_decode(codec):
    gen = np.random.default_rng(3)
    for n in sizes(gen):
        x = values(n, gen)
        if codec == "bf16":
            x = x.clamp(-1e38, 1e38)  # (bf16 rounds values near float32's max to Inf)
        data, got = codecs.encode_decoded(x.view(1, -1), codec)
        assert data == encode(x, codec)
        assert same_bits(got, decode(data, (1, n), codec))


@pytest.mark.parametrize("codec", sorted(SIGN_BLOCKS))
def test_sign_decode_in_several_chunks_gives_the_former_values(codec):
    """Payloads of a few of the decoder's chunks, ending with a partial chunk and block."""
    gen = np.random.default_rng(21)
    for n in (2 * codecs.DECODE_CHUNK_VALUES, 2 * codecs.DECODE_CHUNK_VALUES + 1029):
        x = values(n, gen)
        data = encode(x, codec)
        assert same_bits(decode(data, n, codec), decode_sign(data, n, codec))
        nb = -(-n // SIGN_BLOCKS[codec])
        valid = np.nan_to_num(scales(nb, 1, gen), nan=1.0, posinf=2.0).clip(-0.0, None)
        made_up = valid.astype("<f4").tobytes() + data[4 * nb :]
        assert same_bits(decode(made_up, n, codec), decode_sign(made_up, n, codec))

"""Wire codecs: layout golden bytes, exact sizes, error bounds, refusal of bad input/payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algorithm.codecs import (
    BLOCK_SIZE,
    CODECS,
    SIGN_BLOCKS,
    TOPK_CHUNK,
    TOPK_K,
    WIDE_BLOCK_SIZE,
    CodecError,
    NonFiniteError,
    check_codec,
    decode,
    encode,
    encoded_nbytes,
    roundtrip_error_bound,
)

LEVELS = {"int8": 127, "int4": 7, "int2": 1}
TINY = float(torch.finfo(torch.float32).tiny)
F32_MAX = float(torch.finfo(torch.float32).max)


def _elementwise_bound(x: torch.Tensor, codec: str) -> torch.Tensor:
    """Per-element bound from the module docstring, computed independently of the codec."""
    x = x.double().reshape(-1)
    if codec == "fp32":
        return torch.zeros_like(x)
    if codec == "topk2":  # one payload: at most its chunk's largest |x| (error feedback sends it)
        n = x.numel()
        pad = torch.zeros(-(-n // TOPK_CHUNK) * TOPK_CHUNK, dtype=torch.float64)
        pad[:n] = x.abs()
        absmax = pad.view(-1, TOPK_CHUNK).amax(1).repeat_interleave(TOPK_CHUNK)[:n]
        return absmax * (1 + 2.0**-20) + TINY
    if codec == "bf16":
        return x.abs() * 2.0**-8 + TINY
    n = x.numel()
    if codec in SIGN_BLOCKS:  # one payload: at most its block's largest |x|
        block = SIGN_BLOCKS[codec]
        pad = torch.zeros(-(-n // block) * block, dtype=torch.float64)
        pad[:n] = x.abs()
        absmax = pad.view(-1, block).amax(1).repeat_interleave(block)[:n]
        return absmax * (1 + 2.0**-20) + TINY
    pad = torch.zeros(-(-n // BLOCK_SIZE) * BLOCK_SIZE, dtype=torch.float64)
    pad[:n] = x.abs()
    absmax = pad.view(-1, BLOCK_SIZE).amax(1).repeat_interleave(BLOCK_SIZE)[:n]
    return absmax / LEVELS[codec] / 2 + absmax * 2.0**-20 + TINY


def _roundtrip(x: torch.Tensor, codec: str) -> torch.Tensor:
    data = encode(x, codec)
    assert len(data) == encoded_nbytes(x.numel(), codec)
    y = decode(data, tuple(x.shape), codec)
    assert y.dtype == torch.float32 and y.shape == x.shape
    return y


def _assert_within_bound(x: torch.Tensor, codec: str) -> None:
    y = _roundtrip(x, codec)
    err = (y.double() - x.double()).abs().reshape(-1)
    assert bool((err <= _elementwise_bound(x, codec)).all()), (codec, float(err.max()))
    if x.numel():
        assert float(err.max()) <= roundtrip_error_bound(x, codec)


# ---------------------------------------------------------------- names and sizes


def test_check_codec_accepts_known_and_lists_valid_names_otherwise():
    for c in CODECS:
        assert check_codec(c) == c
    for call in (
        lambda: check_codec("int3"),
        lambda: encode(torch.ones(3), "fp16"),
        lambda: decode(b"", 0, "INT4"),
        lambda: encoded_nbytes(3, "bf8"),
    ):
        with pytest.raises(CodecError, match="fp32, bf16, int8, int4"):
            call()


@pytest.mark.parametrize(
    ("n", "codec", "nbytes"),
    [
        (0, "fp32", 0),
        (0, "int4", 0),
        (0, "int8", 0),
        (3, "fp32", 12),
        (3, "bf16", 6),
        (1, "int8", 4 + 1),
        (1, "int4", 4 + 1),
        (BLOCK_SIZE, "int4", 4 + BLOCK_SIZE // 2),
        (BLOCK_SIZE + 1, "int4", 8 + BLOCK_SIZE // 2 + 1),
        (BLOCK_SIZE + 1, "int8", 8 + BLOCK_SIZE + 1),
        (1, "int2", 4 + 1),
        (BLOCK_SIZE + 1, "int2", 8 + BLOCK_SIZE // 4 + 1),
    ],
)
def test_exact_sizes(n, codec, nbytes):
    assert encoded_nbytes(n, codec) == nbytes
    assert len(encode(torch.randn(n), codec)) == nbytes


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1024, 200_000))
def test_payload_overhead_per_value(n):
    assert encoded_nbytes(n, "int4") / n <= 0.55
    assert encoded_nbytes(n, "int8") / n <= 1.05


# ---------------------------------------------------------------- golden layout


def test_golden_bytes_int4_low_nibble_first_twos_complement():
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.5, 2.4])
    data = encode(x, "int4")
    assert data[:4] == struct.pack("<f", 1.0)  # absmax 7 / 7
    assert data[4:].hex() == "97f14002"  # (7,-7) (1,-1) (0,4: half to even) (2, pad 0)
    assert decode(data, 7, "int4").tolist() == [7.0, -7.0, 1.0, -1.0, 0.0, 4.0, 2.0]


def test_golden_bytes_int2_lowest_bits_first_ternary():
    x = torch.tensor([2.0, -2.0, 0.9, 1.1, -1.1, 0.0, 1.0])
    data = encode(x, "int2")
    assert data[:4] == struct.pack("<f", 2.0)  # absmax 2 / 1
    # codes (1,-1,0,1) (-1,0,0: 1.0/2 rounds half to even, pad 0): 0b01_00_11_01, 0b00_00_00_11
    assert data[4:].hex() == "4d03"
    assert decode(data, 7, "int2").tolist() == [2.0, -2.0, 0.0, 2.0, -2.0, 0.0, 0.0]


def test_crafted_int2_padding_bits_refused():
    data = bytearray(encode(torch.randn(10), "int2"))
    data[-1] |= 0x10  # the third code of the last byte: after the 10th value
    with pytest.raises(CodecError, match="padding"):
        decode(bytes(data), 10, "int2")


def test_golden_bytes_int8_bf16_fp32():
    x = torch.tensor([127.0, -127.0, 0.0, 1.0])
    assert encode(x, "int8") == struct.pack("<f", 1.0) + bytes([127, 129, 0, 1])
    assert encode(torch.tensor([1.0, -2.0]), "bf16") == bytes.fromhex("803f00c0")
    assert encode(torch.tensor([1.0]), "fp32") == struct.pack("<f", 1.0)


def test_scales_come_first_one_per_block():
    x = torch.cat([torch.full((BLOCK_SIZE,), 2.0), torch.full((3,), -0.5)])
    data = encode(x, "int8")
    assert struct.unpack("<2f", data[:8]) == pytest.approx((2.0 / 127, 0.5 / 127))


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 700),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
    sparsity=st.sampled_from([0.0, 0.5, 0.99]),
)
def test_roundtrip_within_bound_random(codec, n, exponent, seed, sparsity):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0**exponent
    x[torch.rand(n, generator=g) < sparsity] = 0.0
    _assert_within_bound(x, codec)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 255, 257, 1001])
@pytest.mark.parametrize("value", [0.0, 1.0, -3.25, 1e-30, -1e30, 1e-40])
def test_roundtrip_constant_tiny_huge_and_odd_lengths(codec, n, value):
    _assert_within_bound(torch.full((n,), value), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_zero_is_exact_and_zero_blocks_have_zero_scale(codec):
    block = SIGN_BLOCKS.get(codec, BLOCK_SIZE)
    x = torch.zeros(3 * block + 5)
    x[block + 7] = 5.0  # only block 1 is non-zero
    x[block + 9] = 0.0
    y = _roundtrip(x, codec)
    if codec in SIGN_BLOCKS:  # one bit per value: only whole zero blocks stay zero
        assert bool((y[:block] == 0).all()) and bool((y[2 * block :] == 0).all())
        assert float(y[block + 7]) == pytest.approx(5.0 / block)
    else:
        assert bool((y[x == 0] == 0).all())
    if codec in (*LEVELS, *SIGN_BLOCKS):
        scales = struct.unpack("<4f", encode(x, codec)[:16])
        assert scales[0] == scales[2] == scales[3] == 0.0 and scales[1] > 0


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "sign1", "sign1w"])
def test_int_codecs_near_float32_max_decode_finite(codec):
    x = torch.tensor([F32_MAX, -F32_MAX, 1.0, 3e38])
    y = _roundtrip(x, codec)
    assert bool(torch.isfinite(y).all())
    _assert_within_bound(x, codec)


@pytest.mark.parametrize("codec", ["sign1", "sign1w"])
@pytest.mark.parametrize("n", [100, 127, 1023])
def test_sign_codecs_near_float32_max_in_a_partial_block_decode_finite(codec, n):
    # a mean of |x| / count summed over a block whose length is not a power of two can
    # round above float32's max: the scale is clamped, so what is sent can be decoded
    x = torch.full((n,), F32_MAX)
    x[::2] = -F32_MAX
    y = _roundtrip(x, codec)
    assert bool(torch.isfinite(y).all())
    _assert_within_bound(x, codec)


def test_bf16_is_relative_and_handles_huge():
    x = torch.tensor([1e30, -3e-30, 1.0 + 2.0**-9, 3e38])
    y = _roundtrip(x, "bf16")
    assert bool(((y - x).abs() <= x.abs() * 2.0**-8).all())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_and_non_contiguous_input(codec, dtype):
    base = torch.randn(40, 30, dtype=torch.float64)
    x = base.to(dtype).t()  # non-contiguous
    before = x.clone()
    _assert_within_bound(x.float(), codec)
    assert encode(x, codec) == encode(x.float().contiguous(), codec)
    assert torch.equal(x, before)  # input untouched


# ---------------------------------------------------------------- shapes, empty, determinism


@pytest.mark.parametrize("codec", CODECS)
def test_empty_tensor(codec):
    assert encode(torch.empty(0), codec) == b""
    assert decode(b"", (3, 0), codec).shape == (3, 0)
    assert decode(b"", 0, codec).dtype == torch.float32


@pytest.mark.parametrize("codec", CODECS)
def test_decode_shape_and_buffer_types(codec):
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    data = encode(x, codec)
    for buf in (data, bytearray(data), memoryview(data)):
        y = decode(buf, (2, 3, 5), codec)
        assert y.shape == (2, 3, 5) and y.dtype == torch.float32
    assert decode(data, 30, codec).shape == (30,)
    y = decode(data, (2, 3, 5), codec)
    first = y.clone()
    y += 1  # the result is writable and owned by the caller: the payload is not aliased
    assert torch.equal(decode(data, (2, 3, 5), codec), first)


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 600), seed=st.integers(0, 2**31 - 1))
def test_encode_is_deterministic(codec, n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    assert encode(x, codec) == encode(x.clone(), codec)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_refused(codec, bad):
    x = torch.randn(300)
    x[[5, 200]] = bad
    with pytest.raises(NonFiniteError, match=rf"{codec}.* 2 non-finite value"):
        encode(x, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_overflow_to_float32_refused(codec):
    with pytest.raises(NonFiniteError):
        encode(torch.tensor([1e39, 1.0], dtype=torch.float64), codec)


def test_bf16_overflow_refused():
    with pytest.raises(NonFiniteError, match="bfloat16"):
        encode(torch.tensor([3.4e38]), "bf16")


def test_non_float_tensor_refused():
    with pytest.raises(CodecError, match="floating-point"):
        encode(torch.arange(4), "int4")
    with pytest.raises(CodecError, match="floating-point"):
        encode(torch.arange(4), "fp32")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 129, 1000])
def test_wrong_length_refused(codec, n):
    data = encode(torch.randn(n), codec)
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(CodecError, match="expected"):
            decode(bad, n, codec)
    # topk2's size follows its chunks and kept values only: 129 and 131 values have one size
    other = {"topk2": n + TOPK_CHUNK, "int2": n + 4, "sign1": n + 8, "sign1w": n + 8}.get(
        codec, n + 2
    )
    with pytest.raises(CodecError):
        decode(data, other, codec)


def test_bad_shape_refused():
    with pytest.raises(CodecError, match="shape"):
        decode(b"", (-1,), "fp32")


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_crafted_non_finite_scale_refused(codec, scale):
    data = bytearray(encode(torch.randn(200), codec))
    data[4:8] = struct.pack("<f", scale)  # second block's scale
    with pytest.raises(NonFiniteError, match="scale"):
        decode(bytes(data), 200, codec)


@pytest.mark.parametrize(
    ("codec", "scale"),
    # (int2's largest code is 1: any finite scale decodes finite, only a negative one is bad)
    [
        (c, v)
        for c in ("int8", "int4", "int2")
        for v in (-1.0, F32_MAX)
        if (c, v) != ("int2", F32_MAX)
    ],
)
def test_crafted_out_of_range_scale_refused(codec, scale):
    data = bytearray(encode(torch.randn(10), codec))
    data[0:4] = struct.pack("<f", scale)
    with pytest.raises(CodecError, match="scale"):
        decode(bytes(data), 10, codec)


@pytest.mark.parametrize(
    ("codec", "byte"), [("int8", 0x80), ("int4", 0x08), ("int4", 0x80), ("int2", 0x02)]
)
def test_crafted_never_produced_code_refused(codec, byte):
    data = bytearray(encode(torch.randn(10), codec))
    data[-1] = byte
    with pytest.raises(CodecError, match="never produced"):
        decode(bytes(data), 10, codec)


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_crafted_non_finite_float_payload_refused(codec):
    data = bytearray(encode(torch.ones(4), codec))
    width = 4 if codec == "fp32" else 2
    data[width : 2 * width] = np.array([np.nan], "<f4").tobytes()[4 - width :]
    with pytest.raises(NonFiniteError, match="payload"):
        decode(bytes(data), 4, codec)


# ---------------------------------------------------------------- topk2 (sparse, 2-bit)


def _topk_expected(x: torch.Tensor) -> torch.Tensor:
    """topk2's decoding of ``x`` from its docstring, written independently of the codec (numpy,
    float64): per chunk the TOPK_K largest |x|, split at the midpoint of their range, each
    decoded as its sign times its group's mean magnitude."""
    v = x.double().numpy()
    out = np.zeros_like(v)
    for start in range(0, v.size, TOPK_CHUNK):
        chunk = v[start : start + TOPK_CHUNK]
        keep = np.argsort(-np.abs(chunk), kind="stable")[: min(TOPK_K, chunk.size)]
        mags = np.abs(chunk[keep])
        split = (mags.min() + mags.max()) / 2 if mags.min() > 0 else 0.0
        upper = (mags >= split) & (mags > 0)
        for group in (upper, ~upper):
            if group.any():
                out[start + keep[group]] = np.sign(chunk[keep[group]]) * mags[group].mean()
    return torch.from_numpy(out)


@pytest.mark.parametrize("n", [1, 31, 32, 33, TOPK_CHUNK, 2 * TOPK_CHUNK + 100])
def test_topk2_keeps_each_chunks_largest_values_as_sign_and_group_mean(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    y = _roundtrip(x, "topk2")
    assert torch.allclose(y.double(), _topk_expected(x), rtol=1e-6, atol=1e-7)
    chunks = -(-n // TOPK_CHUNK)
    kept = (chunks - 1) * TOPK_K + min(TOPK_K, n - (chunks - 1) * TOPK_CHUNK)
    assert int((y != 0).sum()) == kept


def test_topk2_zeros_stay_zero_in_a_chunk_with_few_non_zero_values():
    x = torch.zeros(TOPK_CHUNK)
    x[[3, 70, 500]] = torch.tensor([1.0, -2.0, 4.0])  # fewer non-zero values than TOPK_K
    y = _roundtrip(x, "topk2")
    assert torch.equal(y != 0, x != 0)
    assert torch.equal(torch.sign(y), torch.sign(x))


def test_topk2_sizes_and_its_bytes_per_value():
    assert encoded_nbytes(TOPK_CHUNK, "topk2") == 8 + 2 * TOPK_K + TOPK_K // 4
    n = 2 * TOPK_CHUNK + 5  # a last chunk of 5 keeps 5
    assert encoded_nbytes(n, "topk2") == 3 * 8 + 2 * (2 * TOPK_K + 5) + -(-(2 * TOPK_K + 5) // 4)
    big = 1_000_000
    assert encoded_nbytes(big, "topk2") / big < 0.08
    assert encoded_nbytes(big, "int4") / encoded_nbytes(big, "topk2") > 6.5


def assert_error_feedback_delivers(codec: str, n: int, rounds: int) -> None:
    """The use lossy codecs are made for: a sender keeps x − decode(encode(x)) and adds it to
    the next payload; over many payloads of the same vector the receiver's sum tracks the
    sender's (within 5% after ``rounds``) and nothing is lost on the way."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g)
    residual, received = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(rounds):
        sent = decode(encode(x + residual, codec), x.numel(), codec)
        residual = x + residual - sent
        received += sent
    assert torch.allclose(received + residual, rounds * x, rtol=1e-4, atol=1e-2)
    assert float((received - rounds * x).norm() / (rounds * x).norm()) < 0.05


def test_topk2_with_error_feedback_delivers_what_it_drops_later():
    assert_error_feedback_delivers("topk2", 3 * TOPK_CHUNK, rounds=300)


def _topk_payload(n: int = 2 * TOPK_CHUNK + 40) -> tuple[bytearray, int, int]:
    """(payload, byte offset of the uint16 offsets, byte offset of the codes)."""
    data = bytearray(encode(torch.randn(n, generator=torch.Generator().manual_seed(1)), "topk2"))
    chunks = -(-n // TOPK_CHUNK)
    kept = (chunks - 1) * TOPK_K + min(TOPK_K, n - (chunks - 1) * TOPK_CHUNK)
    return data, 8 * chunks, 8 * chunks + 2 * kept


def _offset(data: bytearray, at: int, i: int, value: int | None = None) -> int:
    if value is not None:
        data[at + 2 * i : at + 2 * i + 2] = struct.pack("<H", value)
    return struct.unpack("<H", bytes(data[at + 2 * i : at + 2 * i + 2]))[0]


@pytest.mark.parametrize(
    "damage",
    ["swap", "repeat", "beyond the chunk", "beyond the last chunk", "lo > hi", "negative", "pad"],
)
def test_topk2_crafted_payloads_are_refused(damage):
    n = 2 * TOPK_CHUNK + 40
    data, offsets, codes = _topk_payload(n)
    if damage == "swap":  # two offsets of chunk 0 out of order
        a, b = _offset(data, offsets, 4), _offset(data, offsets, 5)
        _offset(data, offsets, 4, b)
        _offset(data, offsets, 5, a)
    elif damage == "repeat":  # one value twice
        _offset(data, offsets, 5, _offset(data, offsets, 4))
    elif damage == "beyond the chunk":
        _offset(data, offsets, TOPK_K - 1, TOPK_CHUNK)
    elif damage == "beyond the last chunk":  # the last chunk holds 40 values
        _offset(data, offsets, 2 * TOPK_K + TOPK_K - 1, 40)
    elif damage == "lo > hi":
        lo, hi = struct.unpack("<2f", bytes(data[8:16]))
        data[8:16] = struct.pack("<2f", hi * 2, hi)
    elif damage == "negative":
        data[0:4] = struct.pack("<f", -1.0)
    else:  # 96 kept values fill the codes exactly; take a size that leaves unused bits
        n = 2 * TOPK_CHUNK + 30
        data, offsets, codes = _topk_payload(n)
        data[-1] |= 0xC0
    with pytest.raises(CodecError, match="topk2"):
        decode(bytes(data), n, "topk2")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk2_crafted_non_finite_scale_refused(bad):
    data, _, _ = _topk_payload()
    data[12:16] = struct.pack("<f", bad)
    with pytest.raises(NonFiniteError, match="scale"):
        decode(bytes(data), 2 * TOPK_CHUNK + 40, "topk2")


@pytest.mark.parametrize("low", [1.8e38, 0.99 * F32_MAX])
def test_topk2_values_near_float32_max_round_trip_as_specified(low):
    x = torch.linspace(low, F32_MAX, TOPK_CHUNK)  # sums and midpoints overflow in float32
    x[::2] *= -1
    y = _roundtrip(x, "topk2")
    assert int((y != 0).sum()) == TOPK_K and bool(torch.isfinite(y).all())
    assert torch.allclose(y.double(), _topk_expected(x), rtol=1e-6)


def test_topk2_keeps_the_lower_offsets_of_equal_magnitudes():
    x = torch.ones(2 * TOPK_CHUNK + 7)
    x[5::3] = -1.0
    y = _roundtrip(x, "topk2")
    assert torch.equal(y.double(), _topk_expected(x))


# ---------------------------------------------------------------------------------- sign1


def test_golden_bytes_sign1_lowest_bit_first_mean_magnitude_scale():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0, -2.0, 0.0, 0.0, 4.0, -4.0])  # one partial block
    data = encode(x, "sign1")
    assert struct.unpack("<f", data[:4])[0] == pytest.approx(16.0 / 9)  # mean |x|, 9 values
    assert data[4:] == bytes([0b0001_0010, 0b0000_0001])  # bits 1, 4 and 8 are negative
    s = 16.0 / 9
    assert decode(data, 9, "sign1").tolist() == pytest.approx([s, -s, s, s, -s, s, s, s, -s])
    assert encoded_nbytes(9, "sign1") == 4 + 2


@pytest.mark.parametrize("codec", ["sign1", "sign1w"])
@pytest.mark.parametrize("n", [1, 8, 127, 128, 129, 1000, 1024, 1025, 3000])
def test_sign1_is_each_blocks_mean_magnitude_with_each_values_sign(codec, n):
    size = SIGN_BLOCKS[codec]
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    y = _roundtrip(x, codec)
    for b in range(-(-n // size)):
        block = x[b * size : (b + 1) * size].double()
        expected = torch.where(block < 0, -1.0, 1.0).double() * block.abs().mean()
        assert torch.allclose(y[b * size : (b + 1) * size].double(), expected)


def test_sign1_bytes_per_value():
    big = 1_000_000
    assert encoded_nbytes(big, "sign1") == 4 * -(-big // BLOCK_SIZE) + big // 8
    assert encoded_nbytes(big, "sign1w") == 4 * -(-big // WIDE_BLOCK_SIZE) + big // 8
    assert encoded_nbytes(big, "int4") / encoded_nbytes(big, "sign1") > 3.3
    assert encoded_nbytes(big, "sign1") / encoded_nbytes(big, "sign1w") > 1.2


def test_sign1w_golden_bytes_one_scale_for_a_thousand_values():
    x = torch.ones(1025)
    x[1] = -3.0
    data = encode(x, "sign1w")
    assert len(data) == 2 * 4 + 129
    assert struct.unpack("<2f", data[:8]) == pytest.approx(((1023 + 3.0) / 1024, 1.0))
    assert data[8:] == bytes([0b0000_0010]) + bytes(128)


@pytest.mark.parametrize("codec", ["sign1", "sign1w"])
def test_sign1_with_error_feedback_delivers_what_it_rounds_later(codec):
    # (slower than topk2's: a large value waits until its block's residuals grow the scale)
    assert_error_feedback_delivers(codec, 3 * SIGN_BLOCKS[codec] + 7, rounds=1000)


@pytest.mark.parametrize("codec", ["sign1", "sign1w"])
@pytest.mark.parametrize("bad", ["negative scale", "nan scale", "padding bit"])
def test_sign1_crafted_payloads_are_refused(codec, bad):
    data = bytearray(encode(torch.randn(10), codec))
    if bad == "negative scale":
        data[0:4] = struct.pack("<f", -1.0)
    elif bad == "nan scale":
        data[0:4] = struct.pack("<f", float("nan"))
    else:
        data[-1] |= 0x80  # value 15 of 10
    with pytest.raises(CodecError, match=f"{codec}: .*(scale|padding)"):
        decode(bytes(data), 10, codec)


def _reference_sign_decode(data: bytes, n: int, block: int) -> torch.Tensor:
    """The sign codecs' decode as first written (bit by bit, a scale per value): the oracle
    the table-driven decode must match bit for bit."""
    nb = -(-n // block)
    scale = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32))
    packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 * nb).copy())
    negative = torch.stack([(packed >> k) & 1 for k in range(8)], dim=1).reshape(-1)
    per_value = torch.repeat_interleave(scale, block)[:n]
    return torch.where(negative[:n].bool(), -per_value, per_value)


def _reference_sign_bits(x: torch.Tensor, block: int) -> bytes:
    """The sign bits as first packed (one shift per bit position)."""
    n = x.numel()
    buf = torch.zeros(-(-n // block) * block)
    buf[:n] = x
    bits = (buf < 0).to(torch.uint8).view(-1, 8)
    packed = bits[:, 0].clone()
    for k in range(1, 8):
        packed |= bits[:, k] << k
    return packed[: (n + 7) // 8].numpy().tobytes()


@pytest.mark.parametrize("codec", ["sign1", "sign1w"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 1023, 1025, 5000, 70_001])
def test_the_sign_codecs_are_bit_exact_with_their_first_implementation(codec, n):
    block = SIGN_BLOCKS[codec]
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:: max(1, n // 5)] = -0.0  # (negative zeros carry their sign bit too)
    data = encode(x, codec)
    nb = -(-n // block)
    assert data[4 * nb :] == _reference_sign_bits(x, block)
    decoded = decode(data, n, codec)
    expected = _reference_sign_decode(data, n, block)
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 257, 5000])
def test_decoding_into_a_used_buffer_gives_the_bits_of_a_fresh_one(codec, n):
    """``decode(..., empty)``: the result is written into the buffer ``empty`` gives (a
    reused one holds whatever was there: NaNs here), every value, and is the same bits."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    x[::7] = 0.0
    data = encode(x, codec)
    given = []

    def used(k: int) -> torch.Tensor:
        given.append(torch.full((k + 3,), float("nan"))[:k])  # (a larger buffer's front)
        return given[-1]

    fresh, reused = decode(data, (n,), codec), decode(data, (n,), codec, used)
    assert torch.equal(fresh.view(torch.int32), reused.view(torch.int32))
    assert len(given) == 1 and reused.data_ptr() == given[0].data_ptr()

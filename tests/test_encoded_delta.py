"""An upload kept as it arrived reads, span by span and index by index, as the bits of its
decoded tensor; merged and checked encoded, it gives what the decoded tensors give
(``diloco.algorithm.encoded_delta``)."""

from __future__ import annotations

import pytest
import torch

from diloco.algorithm import codecs, merge_sizes, streaming
from diloco.algorithm.codec_sizes import CODECS
from diloco.algorithm.direction import consensus_cosines
from diloco.algorithm.encoded_delta import EncodedDelta, decode_span, values_at
from diloco.algorithm.fragments import balanced_fragments
from diloco.algorithm.merge import is_embedding_name, spans_by_tensor

ALIGN = codecs.ALIGN_VALUES
NUMEL = 5 * ALIGN + 77  # (a partial last block and chunk)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0.0 for +0.0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def a_delta(numel: int, seed: int) -> torch.Tensor:
    """Values of several sizes, with a block of zeros (a sign codec's zero scale: -0.0 and
    +0.0 both come back) and a negative zero."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[: 2 * codecs.BLOCK_SIZE] *= 1e-3
    x[3 * codecs.BLOCK_SIZE : 4 * codecs.BLOCK_SIZE] = 0.0
    x[4 * codecs.BLOCK_SIZE] = -0.0
    return x


@pytest.mark.parametrize("codec", CODECS)
def test_a_span_decodes_to_the_bits_of_the_whole_decode(codec):
    payload = codecs.encode(a_delta(NUMEL, 1), codec)
    whole = codecs.decode(payload, NUMEL, codec)
    spans = [(0, NUMEL), (0, 1), (ALIGN, 2 * ALIGN), (ALIGN - 3, ALIGN + 5), (17, 4 * ALIGN + 9),
             (NUMEL - 100, NUMEL), (NUMEL, NUMEL), (2 * ALIGN + 1, 2 * ALIGN + 1)]  # fmt: skip
    for a, b in spans:
        assert same_bits(decode_span(payload, NUMEL, codec, a, b), whole[a:b]), (a, b)
    with pytest.raises(ValueError):
        decode_span(payload, NUMEL, codec, 10, NUMEL + 1)


@pytest.mark.parametrize("codec", CODECS)
def test_values_at_indices_are_the_bits_of_the_whole_decode(codec):
    payload = codecs.encode(a_delta(NUMEL, 2), codec)
    whole = codecs.decode(payload, NUMEL, codec)
    indices = torch.cat([torch.randint(NUMEL, (3000,), generator=torch.Generator().manual_seed(3)),
                         torch.tensor([0, NUMEL - 1, 4 * codecs.BLOCK_SIZE, 3 * codecs.BLOCK_SIZE])])  # fmt: skip
    assert same_bits(values_at(payload, NUMEL, codec, indices), whole[indices])


@pytest.mark.parametrize(
    "codecs_of_parts", [("sign1",), ("sign1", "int4"), ("int8", "bf16", "topk2")]
)
def test_a_sum_of_uploads_reads_as_their_decodes_summed_in_order(codecs_of_parts):
    parts = [(c, codecs.encode(a_delta(NUMEL, 10 + i), c)) for i, c in enumerate(codecs_of_parts)]
    want = None
    for c, payload in parts:
        decoded = codecs.decode(payload, NUMEL, c)
        want = decoded if want is None else want + decoded
    first, *rest = (EncodedDelta([p], NUMEL) for p in parts)
    delta = first
    for later in rest:
        delta = delta.plus(later)
    assert delta.parts == tuple(parts) and first.parts == (parts[0],)  # (immutable)
    assert delta.shape == (NUMEL,) and delta.numel() == NUMEL
    assert delta.nbytes == sum(len(p) for _, p in parts)
    assert same_bits(delta.decoded(), want)
    assert same_bits(delta.read(ALIGN - 5, 3 * ALIGN + 2), want[ALIGN - 5 : 3 * ALIGN + 2])
    idx = torch.arange(0, NUMEL, 7)
    assert same_bits(delta.at(idx), want[idx])
    assert delta.norm() == pytest.approx(float(want.norm()), rel=1e-6)


def test_a_payload_of_the_wrong_length_is_refused_when_kept_and_a_bad_one_when_its_norm_is_read():
    payload = bytearray(codecs.encode(a_delta(NUMEL, 4), "sign1"))
    with pytest.raises(codecs.CodecError, match="bytes, expected"):
        EncodedDelta([("sign1", bytes(payload[:-1]))], NUMEL)
    with pytest.raises(codecs.CodecError):
        EncodedDelta([("nope", bytes(payload))], NUMEL)
    with pytest.raises(ValueError):
        EncodedDelta([], NUMEL)
    bad = {
        "nan scale": (4 * 7, bytes.fromhex("0000c07f")),  # (block 7's scale)
        "negative scale": (4 * 7, bytes.fromhex("000080bf")),  # (-1.0)
        "padding bits": (len(payload) - 1, b"\xff"),
    }
    for what, (at, replacement) in bad.items():
        broken = bytes(payload[:at] + replacement + payload[at + len(replacement) :])
        with pytest.raises(codecs.CodecError) as refused:
            codecs.decode(broken, NUMEL, "sign1")
        assert what.split()[0] in str(refused.value).lower() or what == "nan scale", what
        with pytest.raises(type(refused.value), match=str(refused.value)[:30]):
            EncodedDelta([("sign1", broken)], NUMEL).norm()  # (read from its scales)
        with pytest.raises(type(refused.value)):  # (two uploads: read a chunk at a time)
            EncodedDelta([("sign1", bytes(payload)), ("sign1", broken)], NUMEL).norm()
    int4 = bytearray(codecs.encode(a_delta(NUMEL, 5), "int4"))
    int4[-1] = 0x88  # (two codes -8: never produced)
    with pytest.raises(codecs.CodecError, match="never produced"):
        EncodedDelta([("int4", bytes(int4))], NUMEL).norm()


@pytest.mark.parametrize("codec", CODECS)
def test_a_sign_payloads_norm_is_read_from_its_scales(codec):
    x = a_delta(NUMEL, 6)
    payload = codecs.encode(x, codec)
    norm = codecs.payload_norm(payload, NUMEL, codec)
    if codec not in ("sign1", "sign1w"):
        assert norm is None
        return
    assert norm == pytest.approx(float(codecs.decode(payload, NUMEL, codec).norm()), rel=1e-5)
    with pytest.raises(codecs.CodecError, match="bytes, expected"):
        codecs.payload_norm(payload[:-1], NUMEL, codec)


def layout_of_odd_tensors():
    """Tensors of odd sizes (one an embedding, one cut in two spans of a fragment)."""
    shapes = {"emb.weight": (301, 17), "a.weight": (1000, 9), "b.weight": (4099,), "c.bias": (7,)}
    named = [(n, torch.empty(s, device="meta")) for n, s in shapes.items()]
    return balanced_fragments(named, 3)


@pytest.mark.parametrize("whole_span", [merge_sizes.WHOLE_SPAN_VALUES, 1000])
@pytest.mark.parametrize("contributors", [1, 3])
def test_a_merge_of_encoded_deltas_is_the_merge_of_their_decodes(
    contributors, whole_span, monkeypatch
):
    """Each tensor's spans decoded whole, or (beyond ``WHOLE_SPAN_VALUES``: here 1,000)
    whole for the norm and a chunk at a time for the sums: the same bits either way."""
    monkeypatch.setattr(merge_sizes, "WHOLE_SPAN_VALUES", whole_span)
    layout = layout_of_odd_tensors()
    for i, fragment in enumerate(layout.fragments):
        n = fragment.numel
        encoded = []
        for k in range(contributors):
            parts = [("sign1", codecs.encode(a_delta(n, 100 * i + k), "sign1"))]
            if k == 1:  # (a learner's late upload summed with its answer)
                parts.append(("int4", codecs.encode(a_delta(n, 100 * i + 50), "int4")))
            encoded.append(EncodedDelta(parts, n))
        decoded = [e.decoded() for e in encoded]
        weights = [1.0 + 0.5 * k for k in range(contributors)]
        for share in (1.0, 0.37):
            want = streaming.merge_into(torch.empty(n), decoded, weights, share, fragment,
                                        is_embedding_name, chunk=2 * ALIGN)  # fmt: skip
            scratch_sizes: list[int] = []

            def scratch(k, asked=scratch_sizes):
                asked.append(k)
                return torch.full((k,), float("nan"))

            got = streaming.merge_into(torch.full((n,), float("nan")), encoded, weights, share,
                                       fragment, is_embedding_name, chunk=2 * ALIGN,
                                       scratch=scratch)  # fmt: skip
            assert same_bits(got, want)
            largest = max(b - a for spans in spans_by_tensor(fragment).values() for a, b in spans)
            assert max(scratch_sizes, default=0) <= largest  # (one tensor's span at a time)


@pytest.mark.parametrize("numel", [1000, 200_000])  # (whole; on a sample: > DIRECTION_WHOLE)
def test_the_direction_check_reads_encoded_deltas_as_their_decodes(numel):
    encoded = [EncodedDelta([("sign1", codecs.encode(a_delta(numel, s), "sign1"))], numel)
               for s in range(4)]  # fmt: skip
    decoded = [e.decoded() for e in encoded]
    got = consensus_cosines(encoded, torch.Generator().manual_seed(5))
    assert got == consensus_cosines(decoded, torch.Generator().manual_seed(5))

"""The commit's arithmetic chunk by chunk (diloco.algorithm.streaming) gives, bit for bit,
what the whole-tensor merge, outer step and down codec give."""

from __future__ import annotations

import pytest
import torch
from codec_reference import decode_int, encode_int

from diloco.algorithm import codecs, streaming
from diloco.algorithm.fragments import balanced_fragments
from diloco.algorithm.merge import is_embedding_name, merge_contributions
from diloco.algorithm.outer import NesterovOuter
from diloco.syncer import replay

CHUNK = 2 * codecs.ALIGN_VALUES
"""Small chunks, so that small tensors are cut in several (and in a partial last one)."""


def reference_down_step(params, wire, codec):
    """The whole-tensor down step: encode Θ − W, then W + decode."""
    delta = codecs.encode(params - wire, codec)
    return delta, wire + codecs.decode(delta, params.numel(), codec)


def layout_of_odd_tensors():
    """Tensors of odd sizes (one an embedding), cut into 3 fragments."""
    shapes = {"emb.weight": (301, 17), "a.weight": (1000, 9), "b.weight": (4099,), "c.bias": (7,)}
    named = [(n, torch.empty(s, device="meta")) for n, s in shapes.items()]
    return balanced_fragments(named, 3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("contributors", [1, 3])
def test_merge_into_is_bit_exact(threads, contributors):
    layout = layout_of_odd_tensors()
    gen = torch.Generator().manual_seed(7 + contributors)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fragment in layout.fragments:
            deltas = [torch.randn(fragment.numel, generator=gen) for _ in range(contributors)]
            weights = [float(w) for w in torch.rand(contributors, generator=gen) + 0.1]
            for share in (1.0, 0.37):
                want = merge_contributions(deltas, weights, fragment)
                want = want * share if share != 1.0 else want
                out = torch.full((fragment.numel,), float("nan"))
                got = streaming.merge_into(
                    out, deltas, weights, share, fragment, is_embedding_name, chunk=CHUNK
                )
                assert got is out
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(previous)


def test_merge_into_falls_back_to_the_mean_as_rda_does():
    v = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    want = merge_contributions([v, -v], [1.0, 1.0])
    got = streaming.merge_into(torch.empty(5000), [v, -v], [1.0, 1.0], 1.0, None, bool)
    assert torch.equal(got, want)


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("numel", [0, 1, 1023, 3 * CHUNK + 517])
def test_down_step_is_bit_exact(codec, numel):
    gen = torch.Generator().manual_seed(numel)
    params = torch.randn(numel, generator=gen)
    wire = params + torch.randn(numel, generator=gen) * 1e-2
    before = (params.clone(), wire.clone())
    want_bytes, want_wire = reference_down_step(params, wire, codec)
    got_bytes, got_wire = streaming.down_step(params, wire, codec, chunk=CHUNK)
    assert got_bytes == want_bytes
    assert torch.equal(got_wire, want_wire)
    assert torch.equal(params, before[0]) and torch.equal(wire, before[1])


def test_down_step_refuses_a_chunk_that_cuts_blocks():
    with pytest.raises(ValueError, match="multiple"):
        streaming.down_step(torch.zeros(10), torch.zeros(10), "int2", chunk=1000)


def test_a_commit_chunked_is_the_whole_tensor_commit():
    """Merge, outer step and down step of a few commits in a row: Θ, momentum, W_p and the
    broadcast bytes of the chunked path (what ``replay.redo`` and the live commit run) equal
    the whole-tensor path's."""
    layout = layout_of_odd_tensors()
    fragment = layout.fragments[0]
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(fragment.numel, generator=gen)
    theta_ref, theta = start.clone(), start.clone()
    wire_ref, wire = start.clone(), start.clone()
    outer_ref, outer = NesterovOuter(lr=0.6, momentum=0.7), NesterovOuter(lr=0.6, momentum=0.7)
    for _ in range(4):
        deltas = [torch.randn(fragment.numel, generator=gen) * 1e-2 for _ in range(3)]
        weights, share = [1.0, 2.0, 0.5], 0.8
        merged_ref = merge_contributions(deltas, weights, fragment) * share
        outer_ref.step(0, theta_ref, merged_ref)
        bytes_ref, wire_ref = reference_down_step(theta_ref, wire_ref, "int2")
        merged = replay.merged_delta(deltas, weights, share, fragment, is_embedding_name)
        outer.step(0, theta, merged)
        sent, wire = replay.down_step(theta, wire, "int2")
        assert torch.equal(theta, theta_ref)
        assert torch.equal(outer.buffer(0), outer_ref.buffer(0))
        assert torch.equal(wire, wire_ref)
        assert sent == bytes_ref


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` takes -0.0 for +0.0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def former_down_step(params, wire, codec, chunk):
    """The down step as it was made before ``codecs.encode_decoded``: each chunk encoded by
    the former int encoder, then decoded again by the former decoder."""
    parts, after = [[], []], torch.empty(params.numel())
    for a in range(0, params.numel(), chunk):
        b = min(params.numel(), a + chunk)
        payload = encode_int(params[a:b] - wire[a:b], codec)
        after[a:b] = wire[a:b] + decode_int(payload, b - a, codec)
        scales = codecs.payload_sections(b - a, codec)[0]
        parts[0].append(payload[:scales])
        parts[1].append(payload[scales:])
    return b"".join(parts[0] + parts[1]), after


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_down_step_gives_the_former_bytes_and_bits_where_nothing_moved(codec):
    """Θ = W over whole blocks and ragged runs (zero deltas: blocks of +0), -0.0 in both."""
    gen = torch.Generator().manual_seed(5)
    n = 5 * CHUNK + 300
    wire = torch.randn(n, generator=gen)
    params = wire + torch.randn(n, generator=gen) * 1e-3
    params[1000:5000] = wire[1000:5000]
    params[7001:7301] = wire[7001:7301]
    wire[9000:9500], params[9000:9500] = -0.0, 0.0
    params[12000:12400] = -0.0
    got_bytes, got_wire = streaming.down_step(params, wire, codec, chunk=CHUNK)
    want_bytes, want_wire = former_down_step(params, wire, codec, CHUNK)
    assert got_bytes == want_bytes
    assert same_bits(got_wire, want_wire)


@pytest.mark.parametrize("share", [1.0, 0.37])
def test_merge_into_is_bit_exact_with_a_share_when_directions_cancel(share):
    layout = layout_of_odd_tensors()
    gen = torch.Generator().manual_seed(9)
    for fragment in layout.fragments:
        v = torch.randn(fragment.numel, generator=gen)
        v[:50] = -0.0
        for deltas in ([v, -v], [v, v * 2, torch.zeros_like(v)]):
            want = merge_contributions(deltas, [1.0, 1.0, 1.0][: len(deltas)], fragment)
            want = want * share if share != 1.0 else want
            got = streaming.merge_into(
                torch.empty(fragment.numel),
                deltas,
                [1.0, 1.0, 1.0][: len(deltas)],
                share,
                fragment,
                is_embedding_name,
                chunk=CHUNK,
            )
            assert same_bits(got, want)

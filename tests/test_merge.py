"""Merge math: worked test vectors, RDA properties, embedding rule, per-tensor merge."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algorithm import (
    is_embedding_name,
    merge_contributions,
    rda,
    token_weight,
    weighted_mean,
)


def test_worked_vector_orthogonal_equal_weights():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    assert float(rda([a, b], [1, 1]).norm()) == pytest.approx(2.0, abs=1e-6)
    assert float(weighted_mean([a, b], [1, 1]).norm()) == pytest.approx(1.41421356, abs=1e-6)


def test_worked_vector_weights_3_to_1():
    out = rda([torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])], [3, 1])
    assert out.tolist() == pytest.approx([1.8973666, 0.6324555], abs=1e-6)


def test_worked_token_weight():
    assert token_weight(tokens=10, steps=2) == 50
    assert token_weight(tokens=10, steps=0) == 0
    with pytest.raises(ValueError):
        token_weight(-1, 1)


vec = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(vec, st.floats(0.1, 10)), min_size=1, max_size=5))
def test_rda_norm_is_weighted_mean_of_norms(items):
    vs = [torch.tensor(v) for v, _ in items]
    ws = [w for _, w in items]
    out = rda(vs, ws)
    direction = sum(w * v / v.norm() for v, w in zip(vs, ws, strict=True) if v.norm() > 0)
    if isinstance(direction, int) or direction.norm() / sum(ws) < 1e-3:
        return  # near-cancelling directions use the documented fallback
    expected = sum(w * float(v.norm()) for v, w in zip(vs, ws, strict=True)) / sum(ws)
    assert float(out.norm()) == pytest.approx(expected, rel=1e-4, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(vec, st.floats(0.1, 10)), min_size=2, max_size=4))
def test_rda_permutation_invariant(items):
    base = rda([torch.tensor(v) for v, _ in items], [w for _, w in items])
    for perm in itertools.permutations(items):
        out = rda([torch.tensor(v) for v, _ in perm], [w for _, w in perm])
        assert torch.allclose(out, base, rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(vec, st.integers(1, 5), st.floats(0.1, 10))
def test_rda_identical_inputs_return_input(v, n, w):
    t = torch.tensor(v)
    assert torch.allclose(rda([t] * n, [w] * n), t, rtol=1e-5, atol=1e-5)


def test_rda_zero_vectors():
    z = torch.zeros(3)
    assert torch.equal(rda([z, z], [1, 2]), z)
    # A zero vector adds no direction but pulls the radius down by its weight.
    out = rda([torch.tensor([3.0, 0, 0]), z], [1, 1])
    assert out.tolist() == pytest.approx([1.5, 0, 0])


def test_rda_cancelling_directions_fall_back_to_mean():
    out = rda([torch.tensor([1.0, 0.0]), torch.tensor([-3.0, 0.0])], [1, 1])
    assert out.tolist() == pytest.approx([-1.0, 0.0])


def test_rda_does_not_modify_inputs():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    rda([a, b], [1, 1])
    assert a.tolist() == [2.0, 0.0] and b.tolist() == [0.0, 2.0]


@pytest.mark.parametrize(
    "vectors,weights",
    [
        ([], []),
        ([torch.zeros(2)], [1, 2]),
        ([torch.zeros(2), torch.zeros(3)], [1, 1]),
        ([torch.ones(2)], [0.0]),
        ([torch.ones(2)], [-1.0]),
    ],
)
def test_merge_rejects_bad_input(vectors, weights):
    with pytest.raises(ValueError):
        rda(vectors, weights)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("tok_emb.weight", True),
        ("pos_emb.weight", True),
        ("model.embed_tokens.weight", True),
        ("transformer.wte.weight", True),
        ("lm_head.weight", True),
        ("head.weight", True),
        ("blocks.0.attn.qkv.weight", False),
        ("blocks.0.ln1.bias", False),
        ("tok_emb.bias", False),
        ("blocks.0.mlp.fc.weight", False),
    ],
)
def test_embedding_rule(name, expected):
    assert is_embedding_name(name) is expected


@dataclass
class _Piece:
    name: str
    offset: int
    numel: int


@dataclass
class _Fragment:
    pieces: tuple


def test_merge_contributions_per_tensor():
    # Fragment: an ordinary tensor "w" (2 values) then an embedding "tok_emb.weight" (2 values).
    frag = _Fragment((_Piece("w", 0, 2), _Piece("tok_emb.weight", 2, 2)))
    d1 = torch.tensor([2.0, 0.0, 2.0, 0.0])
    d2 = torch.tensor([0.0, 2.0, 0.0, 2.0])
    out = merge_contributions([d1, d2], [1, 1], frag)
    assert float(out[:2].norm()) == pytest.approx(2.0)  # RDA
    assert out[2:].tolist() == pytest.approx([1.0, 1.0])  # weighted mean
    custom = merge_contributions([d1, d2], [1, 1], frag, is_embedding=lambda n: True)
    assert custom.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_merge_contributions_joins_row_pieces_of_one_tensor():
    # Two row pieces of "w" in one fragment: RDA over the whole tensor, not per piece.
    frag = _Fragment((_Piece("w", 0, 1), _Piece("b", 1, 1), _Piece("w", 2, 1)))
    d1 = torch.tensor([2.0, 1.0, 0.0])
    d2 = torch.tensor([0.0, 1.0, 2.0])
    out = merge_contributions([d1, d2], [1, 1], frag)
    assert float(torch.stack([out[0], out[2]]).norm()) == pytest.approx(2.0)
    assert float(out[1]) == pytest.approx(1.0)


def test_merge_contributions_checks_coverage():
    with pytest.raises(ValueError, match="cover"):
        merge_contributions([torch.zeros(3)], [1], _Fragment((_Piece("w", 0, 2),)))


def test_cap_weights_bounds_one_claim_by_the_rounds_lower_median():
    from diloco.algorithm.merge import cap_weights

    assert cap_weights([1.0, 100.0], 3.0) == [1.0, 3.0]  # the larger gets at most 3/4
    assert cap_weights([4.0, 5.0, 6.0, 100.0], 3.0) == [4.0, 5.0, 6.0, 15.0]
    assert cap_weights([2.0, 3.0], 3.0) == [2.0, 3.0]  # honest spread: untouched
    assert cap_weights([7.0], 3.0) == [7.0]
    assert cap_weights([1.0, 100.0], 0.0) == [1.0, 100.0]  # off
    assert cap_weights([0.0, 0.0, 5.0], 3.0) == [0.0, 0.0, 5.0]  # no positive median: as is
    with pytest.raises(ValueError):
        cap_weights([-1.0, 1.0], 3.0)

"""Balanced fragmentation, layout hash and compatibility, gather/scatter, schedule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algorithm.fragments import (
    FragmentLayout,
    LayoutMismatch,
    balanced_fragments,
    due_fragments,
    fragment_offset,
)


def small_gpt_like():
    torch.manual_seed(0)
    return torch.nn.ParameterDict(
        {
            "tok_emb": torch.nn.Parameter(torch.randn(256, 128)),
            "pos_emb": torch.nn.Parameter(torch.randn(128, 128)),
            **{f"b{i}_attn": torch.nn.Parameter(torch.randn(384, 128)) for i in range(4)},
            **{f"b{i}_proj": torch.nn.Parameter(torch.randn(128, 128)) for i in range(4)},
            **{f"b{i}_mlp": torch.nn.Parameter(torch.randn(512, 128)) for i in range(4)},
            **{f"b{i}_ln": torch.nn.Parameter(torch.randn(128)) for i in range(4)},
            "scalar": torch.nn.Parameter(torch.tensor(1.5)),
        }
    )


def test_every_value_is_in_exactly_one_fragment():
    model = small_gpt_like()
    layout = balanced_fragments(model.named_parameters(), 24)
    covered = {n: torch.zeros(max(1, t.shape[0] if t.dim() else 1)) for n, t in model.items()}
    for f in layout.fragments:
        assert f.numel == sum(pc.numel for pc in f.pieces)
        for pc in f.pieces:
            covered[pc.name][pc.row_start : pc.row_stop] += 1
    for n, c in covered.items():
        assert torch.all(c == 1), n
    assert layout.numel == sum(t.numel() for t in model.values())


def test_split_layout_is_balanced_and_whole_tensor_packing_is_not():
    model = small_gpt_like()
    split = balanced_fragments(model.named_parameters(), 16)
    whole = balanced_fragments(model.named_parameters(), 16, split_large=False)
    mean = split.numel * 4 / 16
    widest_row = 128 * 4
    assert max(f.nbytes for f in split.fragments) <= mean + widest_row
    assert max(f.nbytes for f in whole.fragments) / mean > 1.5


def test_layout_is_deterministic_and_hash_depends_on_model_and_p():
    a = balanced_fragments(small_gpt_like().named_parameters(), 8)
    b = balanced_fragments(small_gpt_like().named_parameters(), 8)
    c = balanced_fragments(small_gpt_like().named_parameters(), 9)
    assert a.hash == b.hash and a.to_dict() == b.to_dict()
    assert a.hash != c.hash


def test_dict_roundtrip_and_tamper_detection():
    layout = balanced_fragments(small_gpt_like().named_parameters(), 6)
    doc = layout.to_dict()
    again = FragmentLayout.from_dict(doc)
    assert again.hash == layout.hash
    doc["fragments"][0][0][2] -= 1
    with pytest.raises(LayoutMismatch):
        FragmentLayout.from_dict(doc)


def test_gather_scatter_roundtrip_writes_in_place():
    model = small_gpt_like()
    layout = balanced_fragments(model.named_parameters(), 7)
    named = dict(model.named_parameters())
    before = {n: t.detach().clone() for n, t in named.items()}
    vecs = [layout.gather(p, named) for p in range(7)]
    for p, v in enumerate(vecs):
        assert v.dtype == torch.float32 and v.numel() == layout.fragments[p].numel
        layout.scatter(p, v * 2, named)
    for n, t in named.items():
        assert torch.equal(t.detach(), before[n] * 2), n
    with pytest.raises(ValueError, match="values"):
        layout.scatter(0, torch.zeros(3), named)


def test_check_compatible_names_the_first_mismatching_tensor():
    layout = balanced_fragments(small_gpt_like().named_parameters(), 4)
    ok = list(layout.tensors)
    layout.check_compatible(ok)
    bad = list(ok)
    bad[3] = (bad[3][0], (1, 2), bad[3][2])
    with pytest.raises(LayoutMismatch, match=bad[3][0]):
        layout.check_compatible(bad)
    with pytest.raises(LayoutMismatch, match="missing"):
        layout.check_compatible(ok[:-1])
    with pytest.raises(LayoutMismatch, match="extra"):
        layout.check_compatible([*ok, ("new", (1,), "float32")])
    dtype = list(ok)
    dtype[0] = (dtype[0][0], dtype[0][1], "bfloat16")
    with pytest.raises(LayoutMismatch, match="dtype"):
        layout.check_compatible(dtype)


def test_more_fragments_than_tensors_splits_rows_further():
    layout = balanced_fragments({"w": torch.zeros(10, 4), "b": torch.zeros(2)}, 6)
    assert all(f.numel > 0 for f in layout.fragments)


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer fragments"):
        balanced_fragments({"w": torch.zeros(3, 4)}, 5)
    with pytest.raises(ValueError, match="fewer fragments"):
        balanced_fragments({"w": torch.zeros(3, 4)}, 2, split_large=False)
    with pytest.raises(ValueError):
        balanced_fragments({"w": torch.zeros(3, 4)}, 0)


def test_schedule_paper_default_sends_one_fragment_per_step():
    H = P = 24
    assert [fragment_offset(p, H, P) for p in range(P)] == list(range(24))
    seen = []
    for step in range(1, 3 * H + 1):
        due = due_fragments(step, H, P)
        assert len(due) == 1
        seen += due
    assert sorted(seen) == sorted(list(range(P)) * 3)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 50), st.integers(1, 30))
def test_schedule_every_fragment_once_per_period(H, P):
    counts = [0] * P
    for step in range(1, H + 1):
        for p in due_fragments(step, H, P):
            counts[p] += 1
    assert counts == [1] * P


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple), min_size=1, max_size=8
    ),
    st.integers(1, 6),
)
def test_random_models_cover_exactly(shapes, P):
    named = {f"t{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    try:
        layout = balanced_fragments(named, P)
    except ValueError as exc:
        assert "fewer fragments" in str(exc)
        return
    assert layout.numel == sum(t.numel() for t in named.values())
    for t in named.values():
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1)
    vecs = [layout.gather(p, named) for p in range(P)]
    for t in named.values():
        t.zero_()
    for p, v in enumerate(vecs):
        layout.scatter(p, v, named)
    for t in named.values():
        assert torch.equal(t.reshape(-1), torch.arange(t.numel(), dtype=torch.float32) + 1)

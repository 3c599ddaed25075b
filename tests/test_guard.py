"""The norm guard: a pure decision, and its use by the syncer state machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco.algorithm import balanced_fragments
from diloco.algorithm.guard import DEFAULT_K, NormHistory, check_norm
from diloco.syncer.config import SyncerConfig
from diloco.syncer.state import Refused, SyncerState


def test_warm_up_uses_the_fragments_parameter_norm():
    assert check_norm(9.9, [], 1.0, k=10).accept
    v = check_norm(10.1, [], 1.0, k=10)
    assert not v.accept and v.limit == 10.0 and "warm-up" in v.reason
    # An all-zero fragment has no reference yet: nothing is refused by norm.
    assert check_norm(1e6, [], 0.0, k=10).accept


def test_median_of_history_replaces_warm_up_once_there_is_enough():
    history = [1.0] * 7 + [1000.0]  # one earlier outlier cannot move a median
    v = check_norm(20.0, history, 1e6, k=10, min_history=8)
    assert not v.accept and v.limit == pytest.approx(10.0) and "median" in v.reason
    assert check_norm(9.0, history, 1e6, k=10, min_history=8).accept
    # With fewer than min_history norms the smaller of median and parameter norm rules.
    assert not check_norm(20.0, history[:7], 1e6, k=10, min_history=8).accept
    assert check_norm(20.0, [5.0], 3.0, k=10, min_history=8).accept  # 20 <= 10 x min(5, 3)
    v = check_norm(31.0, [1000.0], 3.0, k=10, min_history=8)  # a bad first norm cannot loosen
    assert not v.accept and v.limit == 30.0


def test_non_finite_norms_are_refused_even_when_disabled_and_k0_disables():
    for bad in (float("nan"), float("inf"), -1.0):
        assert not check_norm(bad, [], 1.0, k=0).accept
    assert check_norm(1e30, [1.0] * 10, 1.0, k=0).accept
    assert DEFAULT_K == 10.0


def test_history_keeps_a_window_per_fragment():
    h = NormHistory(2, window=3)
    for x in (1, 2, 3, 4):
        h.record(0, x)
    assert h.of(0) == (2.0, 3.0, 4.0) and h.of(1) == ()


def make_state(**cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    layout = balanced_fragments(model.named_parameters(), 1)
    params = [layout.gather(0, dict(model.named_parameters()))]
    events = []
    state = SyncerState(layout, params, SyncerConfig(**cfg), emit=events.append)
    for lid in ("good", "bad"):
        state.join(
            lid,
            tensors=layout.tensors,
            layout_hash=layout.hash,
            num_fragments=1,
            observer=False,
            now=0.0,
        )
    return state, layout


def submit(state, lid, delta, now):
    return state.submit(
        lid,
        state.learners[lid].session,
        fragment=0,
        base_version=state.versions[0],
        steps=4,
        tokens=40,
        delta=delta,
        step_time_s=0.1,
        nbytes=4,
        now=now,
    )


def test_state_refuses_a_huge_contribution_and_keeps_its_state():
    state, layout = make_state(norm_guard_k=10, norm_guard_min_history=3)
    n = layout.fragments[0].numel
    gen = torch.Generator().manual_seed(1)
    for i in range(5):  # honest history: norms ~0.01 * sqrt(n)
        submit(state, "good", 0.01 * torch.randn(n, generator=gen), now=float(i))
        state.poll(float(i) + 10)
    before = state.digest()
    with pytest.raises(Refused) as info:
        submit(state, "bad", 1000 * 0.01 * torch.randn(n, generator=gen), now=20.0)
    assert info.value.code == "OUT_OF_RANGE" and "median" in info.value.message
    assert state.digest() == before
    # Same size as the honest ones (a sign flip): accepted, the guard only looks at norms.
    submit(state, "bad", -0.01 * torch.randn(n, generator=gen), now=21.0)
    assert state.digest() != before


def test_without_the_guard_the_huge_contribution_gets_in():
    state, layout = make_state(norm_guard_k=0)
    n = layout.fragments[0].numel
    submit(state, "bad", 1e3 * torch.ones(n), now=1.0)
    commits, _ = state.poll(100.0)
    assert commits and float(state.params[0].abs().max()) > 100

"""The norm guard: a pure decision, and its use by the syncer state machine."""

from __future__ import annotations

import pytest
import torch
from kit import join_state, syncer_state, tiny_model

from diloco.algorithm.guard import (
    DEFAULT_K,
    DEFAULT_PARAM_RATIO,
    DEFAULT_ZERO_RMS,
    NormHistory,
    check_norm,
)
from diloco.syncer.config import SyncerConfig
from diloco.syncer.state import Refused
from diloco.wire.protocol import ProtocolConfig


def test_without_history_only_the_fragments_own_norm_bounds_a_delta():
    assert check_norm(9.9, 1, None, 1.0, k=20, param_ratio=10).accept
    v = check_norm(10.1, 24, None, 1.0, k=20, param_ratio=10)
    assert not v.accept and "own norm" in v.reason
    # An all-zero fragment without history: an RMS per value bounds it (1 by default).
    assert not check_norm(1e6, 1, None, 0.0, numel=100).accept
    assert check_norm(9.9, 1, None, 0.0, numel=100).accept


def test_per_step_norm_is_compared_with_the_reference():
    assert check_norm(0.1 * 24 * 19, 24, 0.1, 1e6, k=20).accept  # 19x per step
    v = check_norm(0.1 * 24 * 21, 24, 0.1, 1e6, k=20)
    assert not v.accept and "median 0.1" in v.reason and "over 24 steps" in v.reason
    # The same norm over more steps is an ordinary contribution of a longer absence.
    assert check_norm(0.1 * 24 * 21, 48, 0.1, 1e6, k=20).accept
    # Without a reference (too little history) only the own-norm check applies.
    assert check_norm(1000.0, 1, None, 1e6, k=20).accept


def test_the_reference_is_over_learners_not_uploads():
    h = NormHistory(1, window=32)
    for _ in range(5):
        h.record(0, 0.1, steps=1, learner="honest")
    assert h.reference(0, min_history=6) is None and h.reference(0, min_history=5) == 0.1
    # One learner floods the fragment with tiny deltas and with zeros: it has one vote (its
    # own median), the upper median keeps the honest value, and zeros are not remembered.
    for _ in range(100):
        h.record(0, 1e-9, steps=1, learner="flood")
        h.record(0, 0.0, steps=1, learner="zeros")
    assert h.reference(0) == 0.1 and "zeros" not in h.of(0)
    h.record(0, 0.2, steps=1, learner="second")
    assert h.reference(0) == 0.1  # the middle of the three learners' medians (1e-9, 0.1, 0.2)


def test_own_norm_check_also_caps_a_learner_that_inflates_its_step_count():
    assert not check_norm(50.0, 10**6, 1.0, 1.0, param_ratio=10).accept


def test_non_finite_norms_are_refused_even_when_disabled_and_k0_disables():
    for bad in (float("nan"), float("inf"), -1.0):
        assert not check_norm(bad, 1, None, 1.0, k=0).accept
    assert check_norm(1e30, 1, 1.0, 1.0, k=0).accept
    assert (DEFAULT_K, DEFAULT_PARAM_RATIO) == (20.0, 10.0)


def test_history_keeps_a_window_of_per_step_norms_per_fragment_and_learner():
    h = NormHistory(2, window=3)
    for x in (1, 2, 3, 4):
        h.record(0, 2 * x, steps=2, learner="a")
    assert h.of(0) == {"a": (2.0, 3.0, 4.0)} and h.of(1) == {}
    h.forget("a")
    assert h.of(0) == {} and h.reference(0, min_history=1) is None


def make_state(joined_at=0.0, **cfg):
    model = tiny_model(0, (16, 16, 4), tanh=False)
    # rounds open at arrival (the learners' schedule): the fragment bound is not shrunk for
    # short deltas there, so these tests see the median rule and the plain bound
    cfg = {"schedule": "learner", **cfg}
    state, layout, _ = syncer_state(model, SyncerConfig(**cfg), num_fragments=1)
    for lid in ("good", "bad"):
        join_state(state, lid, joined_at)
    return state, layout


def submit(state, lid, delta, now, *, steps=4, step_time_s=0.1):
    """An upload of fragment 0 by ``lid`` of ``steps`` steps (10 tokens each)."""
    return state.submit(
        lid,
        state.learners[lid].session,
        fragment=0,
        base_version=state.versions[0],
        steps=steps,
        tokens=10 * steps,
        delta=delta,
        step_time_s=step_time_s,
        nbytes=4 * delta.numel(),
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
        submit(state, "bad", 50 * 0.01 * torch.randn(n, generator=gen), now=20.0)
    assert info.value.code == "OUT_OF_RANGE" and "median" in info.value.message, info.value
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


def test_the_fragment_bound_follows_the_steps_a_delta_covers():
    from diloco.algorithm.guard import check_norm

    # 10 x ||theta|| at H steps, in proportion to the steps a delta covers, at least 1/4 of it
    assert check_norm(9.0, 24, None, 1.0, sync_every=24).accept
    assert not check_norm(9.0, 6, None, 1.0, sync_every=24).accept
    assert check_norm(30.0, 72, None, 1.0, sync_every=24).accept  # many steps, a larger bound
    assert not check_norm(30.1, 72, None, 1.0, sync_every=24).accept
    # ... up to the ceiling max_ratio (32), whatever the steps: 100 x at 240 steps no longer
    assert check_norm(31.9, 240, None, 1.0, sync_every=24).accept
    assert not check_norm(90.0, 240, None, 1.0, sync_every=24).accept
    assert check_norm(2.4, 6, None, 1.0, sync_every=24).accept
    assert check_norm(2.4, 1, None, 1.0, sync_every=24).accept  # the floor: 1/4 of the bound
    assert check_norm(9.0, 6, None, 1.0).accept  # without H: the plain bound


def test_no_claimed_step_count_lifts_a_delta_past_the_ceiling_or_the_fleets_sizes():
    v = check_norm(33.0, 1 << 24, None, 1.0, sync_every=24)
    assert not v.accept and "32 x the fragment's own norm" in v.reason
    # With history, the size of the fragment's recent contributions bounds it (k = 20)
    v = check_norm(9.0, 1 << 24, None, 1.0, size_reference=0.1, sync_every=24)
    assert not v.accept and "whatever the steps" in v.reason
    assert check_norm(1.9, 1 << 24, None, 1.0, size_reference=0.1, sync_every=24).accept
    # An upload is judged with what the learner's contribution already holds in the round.
    v = check_norm(1.9, 24, None, 1.0, size_reference=0.1, held=0.2)
    assert not v.accept and "0.2 already in the round" in v.reason
    v = check_norm(0.5, 1, None, 1.0, held=9.6, sync_every=24)  # 1/4 x 10 x 1.0 bound
    assert not v.accept and "own norm" in v.reason


def test_honest_deltas_at_the_measured_maxima_are_accepted():
    # tiny recipe, 3 learners (2 slowed 3x): a first delta of 8.73 x its fragment's norm
    # over 151 steps, before the fragment has any history; accepted whatever steps it claims
    for steps in (151, 1 << 24):
        assert check_norm(8.73, steps, None, 1.0, sync_every=24).accept
    # tiny recipe, 2 learners: 3.64 x the largest median of the recent ones, over 259 steps
    assert check_norm(3.64, 259, 0.01, 1.0, size_reference=1.0, sync_every=24).accept


def test_the_size_reference_is_the_largest_median_over_learners():
    h = NormHistory(1, window=32)
    for x in (1.0, 2.0, 3.0):
        h.record(0, x, steps=1, learner="slow")
    assert h.size_reference(0, min_history=4) is None and h.size_reference(0) == 2.0
    for _ in range(5):  # a faster learner brings more steps per round: larger deltas
        h.record(0, 8.0, steps=4, learner="fast")
        h.record(0, 0.0, steps=4, learner="zeros")
    assert h.size_reference(0) == 8.0 and h.reference(0) == 2.0  # per step: (2.0, 2.0)
    h.forget("fast")
    assert h.size_reference(0) == 2.0


def test_a_huge_delta_claiming_2_24_steps_from_a_learner_that_just_joined_is_refused():
    # The syncer's clock at 10 ms steps: a few seconds after its join the time bound on
    # claimed steps (plausible_steps) allows ~1,200, so the step-scaled checks allowed it.
    state, layout = make_state(
        joined_at=100.0, schedule="syncer", protocol=ProtocolConfig(sync_every=24)
    )
    n = layout.fragments[0].numel
    gen = torch.Generator().manual_seed(3)
    theta = float(state.params[0].norm())

    def upload(lid, delta, steps, now):
        return submit(state, lid, delta, now, steps=steps, step_time_s=0.01)

    for i in range(4):  # the honest learner's history: ~0.07 x the fragment's norm
        assert upload("good", 0.01 * torch.randn(n, generator=gen), 24, 100.5 + 0.5 * i).accept
    before = state.digest()
    huge = torch.randn(n, generator=gen)
    huge *= 9.0 * theta / huge.norm()
    with pytest.raises(Refused) as info:
        upload("bad", huge, 1 << 24, 103.0)
    assert info.value.code == "OUT_OF_RANGE" and "whatever the steps" in info.value.message
    assert state.digest() == before


def test_a_corrupt_delta_that_slipped_in_once_does_not_open_the_door_to_the_next():
    # Before a fragment has history only its own norm bounds a delta, so a short corrupt
    # delta (x1000 of a 1-step one) can slip in. Its norm then joined the history: the
    # upper median of its and the honest learners' medians was its own as long as it had
    # one honest learner beside it, and every later corrupt delta of the fragment passed.
    state, layout = make_state(norm_guard_min_history=3)
    join_state(state, "good2", 0.0)
    n = layout.fragments[0].numel
    gen = torch.Generator().manual_seed(5)
    theta = float(state.params[0].norm())
    first = torch.randn(n, generator=gen)
    first *= 5.0 * theta / first.norm()  # under 10 x the fragment's own norm: no history yet
    assert submit(state, "bad", first, now=1.0).accept
    state.poll(50.0)
    for i, lid in enumerate(("good", "good2", "good")):  # honest: ~0.005 x the fragment's
        honest = torch.randn(n, generator=gen)
        assert submit(state, lid, honest * 0.005 * theta / honest.norm(), now=60.0 + i).accept
        state.poll(100.0 + i)
    before = state.digest()
    again = torch.randn(n, generator=gen)
    with pytest.raises(Refused) as info:
        submit(state, "bad", again * 5.0 * theta / again.norm(), now=200.0)
    assert info.value.code == "OUT_OF_RANGE" and "median" in info.value.message, info.value
    assert state.digest() == before
    # The honest learner is still judged by the others' history, and accepted.
    honest = torch.randn(n, generator=gen)
    assert submit(state, "good", honest * 0.006 * theta / honest.norm(), now=201.0).accept


def test_a_learner_is_judged_by_two_or_more_other_learners_once_they_have_history():
    h = NormHistory(1, window=32)
    for _ in range(2):
        h.record(0, 0.1, steps=1, learner="honest")
        h.record(0, 500.0, steps=1, learner="corrupt")
        h.record(0, 0.2, steps=1, learner="slow")
    assert h.reference(0) == 0.2  # the middle of (0.1, 0.2, 500)
    assert h.reference(0, judged="corrupt") == 0.2  # its two others: upper median of 0.1, 0.2
    assert h.reference(0, judged="honest") == 500.0  # others (0.2, 500): the upper one
    assert h.reference(0, judged="slow") == 500.0  # (an honest one is never judged lower)
    h2 = NormHistory(1, window=32)
    for _ in range(3):
        h2.record(0, 0.1, steps=1, learner="honest")
    h2.record(0, 500.0, steps=1, learner="corrupt")
    assert h2.reference(0, judged="corrupt") == 500.0  # one other only: as before


def test_short_first_deltas_of_a_long_period_do_not_lock_the_fragment_out():
    # H = 96 on the syncer's clock (bench_quality, 2026-11-27): each learner's first delta
    # of an early fragment covered 4 steps of the lr warm-up. Those tiny sizes became the
    # size reference, every later 96-step delta was more than 20 x it and refused, and
    # refused deltas never enter the history: fragments 0-2 never merged again.
    state, layout = make_state(schedule="syncer", protocol=ProtocolConfig(sync_every=96))
    join_state(state, "third", 0.0)
    n = layout.fragments[0].numel
    gen = torch.Generator().manual_seed(7)
    theta = float(state.params[0].norm())

    def upload(lid, size, steps, now):
        delta = torch.randn(n, generator=gen)
        return submit(state, lid, delta * size * theta / delta.norm(), now, steps=steps)

    for i, lid in enumerate(("good", "bad", "third")):  # 4 warm-up steps each
        assert upload(lid, 0.001, 4, 0.5 + 0.1 * i).accept
    state.poll(20.0)
    assert state.versions[0] == 1  # merged: the next deltas start a new round
    for i, lid in enumerate(("good", "bad", "third")):  # a whole period: 50 x the first
        assert upload(lid, 0.05, 96, 30.0 + 0.1 * i).accept


def test_a_fragment_whose_norm_is_zero_bounds_a_delta_by_its_number_of_values():
    """Found by review (issue 46): while ``‖Θ_p‖ = 0`` (a LoRA-style fragment at its
    initialization) and before the fragment had 3 accepted norms, nothing bounded a delta: one
    of norm 1e30 was accepted. The bound is an RMS per value, ``zero_rms · sqrt(numel)``."""
    numel = 4096
    bound = DEFAULT_ZERO_RMS * numel**0.5
    v = check_norm(1e30, 24, None, 0.0, numel=numel, sync_every=24)
    assert not v.accept and "norm is 0" in v.reason
    assert not check_norm(1.01 * bound, 1 << 24, None, 0.0, numel=numel).accept
    # with what the learner's contribution already holds in the round
    assert not check_norm(0.5 * bound, 24, None, 0.0, numel=numel, held=0.6 * bound).accept
    # an honest first delta (RMS 0.28 per value, the largest measured) is accepted
    assert check_norm(0.28 * numel**0.5, 500, None, 0.0, numel=numel, sync_every=24).accept
    assert check_norm(0.99 * bound, 1, None, 0.0, numel=numel).accept
    # ... and once ‖Θ_p‖ > 0, however small, the fragment's own norm bounds it instead
    assert not check_norm(0.28 * numel**0.5, 24, None, 1e-3, numel=numel).accept
    # k = 0 still disables the guard
    assert check_norm(1e30, 1, None, 0.0, numel=numel, k=0).accept


def test_the_syncer_refuses_a_huge_first_delta_of_a_zero_fragment_and_takes_an_honest_one():
    """A real ``SyncerState`` whose fragment starts at zero (a zero-initialised ``Linear``,
    as a LoRA adapter's B matrix): a first delta of norm 1e18 is refused with nothing
    changed; the first delta of an honest learner that trained it is accepted."""
    model = tiny_model(0, (16, 16, 4), tanh=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state, layout, _ = syncer_state(model, SyncerConfig(schedule="learner"), num_fragments=1)
    assert state.params[0].norm() == 0
    for lid in ("good", "bad"):
        join_state(state, lid, 0.0)
    n = layout.fragments[0].numel
    before = state.digest()
    with pytest.raises(Refused) as info:
        submit(state, "bad", torch.full((n,), 1e18 / n**0.5), now=1.0)
    assert info.value.code == "OUT_OF_RANGE" and "norm is 0" in info.value.message
    assert state.digest() == before
    # honest: the zero-initialised model trained 300 AdamW steps at lr 1e-3
    trained = tiny_model(0, (16, 16, 4), tanh=False)
    with torch.no_grad():
        for p in trained.parameters():
            p.zero_()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(16, 4, generator=gen)
    for _ in range(300):
        x = torch.randn(32, 16, generator=gen)
        loss = ((trained(x) - x @ target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    named = dict(trained.named_parameters())
    delta = layout.gather(0, named).detach().reshape(-1)  # Θ_p = 0: the delta is θ_p
    assert 0 < float(delta.norm()) < DEFAULT_ZERO_RMS * n**0.5
    assert submit(state, "good", delta, now=2.0, steps=300).accept


def paced_state(*, sync_every: int, seed: int):
    """A state on the syncer's clock (H = ``sync_every``) whose learners "good" and "bad"
    were measured stepping every 100 ms from t = 100 to 105, ticked at 105; and
    ``sized(ratio)``: a random delta of fragment 0 of norm ``ratio x ||theta_0||``."""
    state, layout = make_state(
        joined_at=100.0,
        schedule="syncer",
        protocol=ProtocolConfig(sync_every=sync_every),
        gamma=0.0,
    )
    n = layout.fragments[0].numel
    gen = torch.Generator().manual_seed(seed)
    theta = float(state.params[0].norm())

    def sized(ratio):
        delta = torch.randn(n, generator=gen)
        return delta * ratio * theta / delta.norm()

    for k in range(6):
        for lid in ("good", "bad"):
            state.heartbeat(
                lid, state.learners[lid].session, now=100.0 + k, step=10 * k, steps_per_s=10.0
            )
    state.tick(105.0)
    return state, sized


def test_claimed_steps_are_bounded_by_the_pace_the_syncer_measured():
    """Issue 46, defect 10: a 9 x ||theta|| delta is refused when it claims 8 steps and was
    accepted when the same bytes claimed 2^24: the guard took the steps from the claim, up to
    a slack of H steps whatever the time, at a pace the learners claimed. Now a delta is
    credited with at most the steps the learner's measured pace (MAX_SPEEDUP x it) allows
    since the version its previous accepted delta of the fragment was taken against (or
    since its join)."""
    state, sized = paced_state(sync_every=24, seed=11)
    assert submit(state, "good", sized(0.5), 105.0, steps=24).accept
    (commit,) = state.poll(105.0)[0]  # version 1 at t = 105.0
    assert submit(state, "bad", sized(0.05), 105.05, steps=1).accept  # against version 1
    before = state.digest()
    for steps in (8, 1 << 24):  # 0.1 s after its base was committed: a few steps at most
        with pytest.raises(Refused) as info:
            submit(state, "bad", sized(9.0), 105.1, steps=steps)
        assert info.value.code == "OUT_OF_RANGE" and "own norm" in info.value.message
    assert state.digest() == before
    # A learner that has just joined is credited with the steps since its join.
    join_state(state, "newcomer", 105.0)
    with pytest.raises(Refused):
        submit(state, "newcomer", sized(9.0), 105.1, steps=1 << 24)
    # Honest deltas with honest claims are accepted: a short one now, a whole period later.
    assert submit(state, "newcomer", sized(0.05), 105.1, steps=1).accept
    assert submit(state, "bad", sized(1.0), 107.5, steps=24).accept


def test_a_second_increment_is_judged_with_the_steps_of_the_first():
    """A learner's late upload and its answer to the round are summed into one contribution,
    and the guard judges the sum's size. On the old code the sum was judged over the second
    increment's steps alone: an honest 16-step delta followed by a 1-step one in the same
    round was refused (``delta norm 3.5 over 1 steps exceeds 2.5 x the fragment's own
    norm``), an honest learner's progress thrown away (seen in a clean multi-process run)."""
    state, sized = paced_state(sync_every=16, seed=5)
    assert submit(state, "good", sized(3.0), 105.0, steps=16).accept  # within 10 x 16/16
    assert submit(state, "good", sized(0.5), 105.05, steps=1).accept  # summed: 17 steps
    (contribution,) = state.rounds[0].contributions.values()
    assert (contribution.increments, contribution.steps) == (2, 17)
    # The sum is still bounded: a second increment that makes it too large is refused.
    with pytest.raises(Refused) as info:
        submit(state, "good", sized(9.0), 105.1, steps=1)
    assert info.value.code == "OUT_OF_RANGE" and "already in the round" in info.value.message

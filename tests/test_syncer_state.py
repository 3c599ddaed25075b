"""The syncer's state machine with a fake clock and no sockets."""

from __future__ import annotations

import pytest
import torch
from kit import join_state, syncer_state, tiny_model

from diloco.algorithm import token_weight
from diloco.syncer.config import SyncerConfig
from diloco.syncer.state import Refused


def make_state(P=2, **cfg):
    # Synthetic deltas here are far larger than the parameters: the norm guard (tested in
    # test_guard.py) is off unless a test turns it on.
    # Outer lr 1 and no momentum (the merged delta replaces the fragment) keep the expected
    # values simple;
    # the outer step itself is tested in test_outer.py.
    # These tests drive rounds on the learners' schedule (a round opens at its first
    # arrival); the syncer's clock is tested in test_syncer_clock.py.
    cfg = {
        "norm_guard_k": 0.0,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "schedule": "learner",
        **cfg,
    }
    return syncer_state(tiny_model(0, (4, 4, 2), tanh=False), SyncerConfig(**cfg), num_fragments=P)


def join(state, lid, layout, now=0.0, observer=False):
    return join_state(state, lid, now, observer=observer)


def submit(state, lid, session, fragment, delta, now, base=0, steps=2, tokens=10):
    return state.submit(
        lid,
        session,
        fragment=fragment,
        base_version=base,
        steps=steps,
        tokens=tokens,
        delta=delta,
        step_time_s=1.0,
        nbytes=delta.numel(),
        now=now,
    )


def test_round_closes_early_when_every_live_learner_contributed():
    state, layout, events = make_state(quorum=1)
    n = layout.fragments[0].numel
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 1.0), now=1.0)
    commits, wake = state.poll(1.0)
    # quorum 1 reached; grace = clip(1*(2*1 - 0 - 0), 0, 1) = 1 s because step estimate is 1 s
    assert commits == [] and wake == pytest.approx(2.0)
    submit(state, "b", sb, 0, torch.full((n,), 3.0), now=1.5)
    commits, _ = state.poll(1.5)
    assert [c.fragment for c in commits] == [0]
    assert state.versions == [1, 0]
    # equal weights, parallel deltas: RDA = mean = 2; outer lr 1, μ 0: Θ ← Θ − 2
    assert torch.allclose(state.params[0], before - 2.0)
    record = commits[0].record
    assert record["participants"] == ["a", "b"] and record["tokens"] == 20
    assert "every live learner" in record["reason"]


def test_grace_window_then_close_with_quorum():
    state, layout, _ = make_state(quorum=1)
    n = layout.fragments[1].numel
    sa, _ = join(state, "a", layout), join(state, "b", layout)
    submit(state, "a", sa, 1, torch.ones(n), now=1.0)
    assert state.poll(1.5)[0] == []
    commits, _ = state.poll(2.01)
    assert [c.fragment for c in commits] == [1] and commits[0].record["participants"] == ["a"]


def test_token_weights_summed_increments_and_the_weight_cap():
    state, layout, _ = make_state(quorum=2, gamma=0.0)
    n = layout.fragments[0].numel
    sa, sb, _ = join(state, "a", layout), join(state, "b", layout), join(state, "c", layout)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 100.0), now=1.0)  # 10 tokens, 2 steps
    submit(state, "a", sa, 0, torch.full((n,), 1.0), now=1.1, tokens=30, steps=3)  # added
    submit(state, "b", sb, 0, torch.full((n,), 2.0), now=1.2, tokens=10, steps=1)
    commits, _ = state.poll(1.2)
    record = commits[0].record
    assert record["steps"] == [5, 1] and record["tokens_by_learner"] == {"a": 40, "b": 10}
    assert record["increments"] == [2, 1]
    # a: 40²/5 = 320, capped at 3 x the lower median weight (b's 100); b: 10²/1 = 100
    assert record["weights"] == [300.0, token_weight(10, 1)]
    # parallel deltas 101 and 2 with weights 300 and 100: RDA = (300*101 + 100*2)/400;
    # "c" is live but not in the round and has never contributed: it does not count in the
    # round's share (an id that only joins dilutes nothing), so the share is 1
    assert record["share"] == 1.0
    assert torch.allclose(state.params[0], before - (300 * 101 + 100 * 2) / 400)


def test_a_claim_above_the_declared_tokens_per_step_is_refused():
    state, layout, _ = make_state()
    session = join_state(state, "a", tokens_per_step=4)
    n = layout.fragments[0].numel
    before = state.digest()
    with pytest.raises(Refused, match="declared"):
        submit(state, "a", session, 0, torch.ones(n), now=1.0, steps=2, tokens=9)
    assert state.digest() == before
    submit(state, "a", session, 0, torch.ones(n), now=1.0, steps=2, tokens=8)


def test_a_round_steps_by_its_share_of_the_live_learners_tokens():
    state, layout, events = make_state(quorum=1, gamma=0.0, lease_s=5.0)
    n = layout.fragments[0].numel
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    submit(state, "b", sb, 1, torch.ones(layout.fragments[1].numel), now=0.5, tokens=30, steps=3)
    state.poll(0.5)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 2.0), now=1.0, tokens=10)
    (commit,) = state.poll(1.0)[0]
    # "b" is live, last carried 30 tokens: this round holds 10 of 40 -> a quarter of the step
    assert commit.record["share"] == pytest.approx(0.25)
    assert torch.allclose(state.params[0], before - 0.5)
    # once "b" is no longer live, a round of "a" alone is the whole cycle: full step
    state.heartbeat("a", sa, now=6.0)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 2.0), now=7.0, base=1, tokens=10)
    (commit,) = state.poll(7.0)[0]
    assert commit.record["share"] == 1.0
    assert torch.allclose(state.params[0], before - 2.0)


@pytest.mark.parametrize("cfg", [{"outer_scale": "none"}, {"wait_for_all": 1}])
def test_round_share_is_off_without_scaling_and_in_synchronous_rounds(cfg):
    state, layout, _ = make_state(quorum=1, gamma=0.0, **cfg)
    n = layout.fragments[0].numel
    sa, _ = join(state, "a", layout), join(state, "b", layout)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 2.0), now=1.0)
    (commit,) = state.poll(1.0)[0]
    assert commit.record["share"] == 1.0
    assert torch.allclose(state.params[0], before - 2.0)


def test_stale_contribution_discounted_or_refused():
    state, layout, events = make_state(quorum=1, gamma=0.0, max_staleness=1)
    n = layout.fragments[0].numel
    sa = join(state, "a", layout)
    for t in range(2):
        submit(state, "a", sa, 0, torch.ones(n), now=float(t), base=t)
        assert state.poll(float(t))[0]
    adm = submit(state, "a", sa, 0, torch.ones(n), now=3.0, base=1)
    assert adm.accept and adm.discount == pytest.approx(0.5)
    state.poll(3.0)
    adm = submit(state, "a", sa, 0, torch.ones(n), now=4.0, base=1)
    assert not adm.accept and adm.resync
    assert events[-1]["event"] == "stale"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fragment": 5}, "not served"),
        ({"delta_len": 3}, "values"),
        ({"steps": 0}, "steps"),
        ({"tokens": 0}, "tokens"),
        ({"base": 7}, "ahead"),
        ({"nan": True}, "non-finite"),
        ({"session": "bogus"}, "unknown session"),
    ],
)
def test_invalid_submissions_change_nothing(kwargs, match):
    state, layout, _ = make_state()
    sa = join(state, "a", layout)
    fragment = kwargs.get("fragment", 0)
    n = kwargs.get("delta_len", layout.fragments[0].numel)
    delta = torch.ones(n)
    if kwargs.get("nan"):
        delta[0] = float("nan")
    snapshot = [t.clone() for t in state.params], list(state.versions)
    with pytest.raises(Refused, match=match):
        state.submit(
            "a",
            kwargs.get("session", sa),
            fragment=fragment,
            base_version=kwargs.get("base", 0),
            steps=kwargs.get("steps", 1),
            tokens=kwargs.get("tokens", 1),
            delta=delta,
            step_time_s=0.1,
            nbytes=1,
            now=1.0,
        )
    assert state.rounds == {} and state.versions == snapshot[1]
    assert all(torch.equal(a, b) for a, b in zip(state.params, snapshot[0], strict=True))


def test_join_refuses_another_model_naming_the_tensor():
    state, layout, _ = make_state()
    tensors = list(layout.tensors)
    name, shape, dtype = tensors[1]
    tensors[1] = (name, (99,), dtype)
    with pytest.raises(Refused, match=name.replace(".", r"\.")):
        state.join(
            "x",
            tensors=tensors,
            layout_hash="h",
            num_fragments=layout.num_fragments,
            observer=False,
            now=0,
        )


def test_lease_expiry_and_leave():
    state, layout, events = make_state(lease_s=2.0, heartbeat_s=0.5)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    assert state.live(1.0) == {"a", "b"}
    state.heartbeat("a", sa, now=2.5)
    state.poll(3.0)
    assert state.live(3.0) == {"a"}
    assert any(e["event"] == "expire" and e["learner"] == "b" for e in events)
    state.leave("a", sa, now=3.1)
    assert state.live(3.2) == set()
    state.leave("b", "old-session", now=3.3)  # unknown session: ignored
    assert sum(e["event"] == "leave" for e in events) == 1
    assert sb


def test_a_clean_leave_after_the_stream_closed_still_says_left():
    """Issue 36, friction 8: of two identical clean exits, the one whose subscription closed
    before its Leave arrived stayed "stream closed" (and synchronous mode kept waiting for
    it). The Leave of the same session now says "left", without a second leave record."""
    state, layout, events = make_state()
    sa = join(state, "a", layout)
    state.leave("a", sa, now=1.0, reason="stream closed")
    state.leave("a", sa, now=1.1, reason="left")
    assert state.learners["a"].state == "left"
    assert [e["reason"] for e in events if e["event"] == "leave"] == ["stream closed"]
    state.leave("a", "another-session", now=1.2, reason="left")  # not its session: ignored
    assert state.learners["a"].state == "left"
    # ... and one whose lease ran out says so, not the state it last reported
    sb = join(state, "b", layout, now=2.0)
    state.heartbeat("b", sb, now=2.0, state="training")
    state.poll(2.0 + state.config.lease_s + 1)
    assert not state.learners["b"].live and state.learners["b"].state == "lease expired"
    # ... and one that heartbeats after its stream closed is not "training" while not live
    sc = join(state, "c", layout, now=20.0)
    state.leave("c", sc, now=20.5, reason="stream closed")
    state.heartbeat("c", sc, now=21.0, state="training")
    assert "c" not in state.live(21.0) and state.learners["c"].state == "no subscription"
    state.leave("c", sc, now=21.5, reason="left")
    state.heartbeat("c", sc, now=21.6, state="training")  # a late one: it left
    assert state.learners["c"].state == "left"


def test_observer_is_never_live_and_cannot_contribute():
    state, layout, _ = make_state()
    so = join(state, "eval", layout, observer=True)
    assert state.live(0.5) == set()
    with pytest.raises(Refused, match="observers"):
        submit(state, "eval", so, 0, torch.ones(layout.fragments[0].numel), now=1.0)


def test_synchronous_mode_waits_for_everyone():
    state, layout, _ = make_state(wait_for_all=2)
    n = layout.fragments[0].numel
    sa, _ = join(state, "a", layout), join(state, "b", layout)
    state.leave("b", _, now=0.5, reason="stream closed")  # b died: a sync round waits for it
    submit(state, "a", sa, 0, torch.ones(n), now=1.0)
    assert state.poll(100.0)[0] == []
    sb = join(state, "b", layout, now=101.0)  # b is back and contributes: the round closes
    submit(state, "b", sb, 0, torch.ones(n), now=102.0)
    assert [c.fragment for c in state.poll(102.0)[0]] == [0]


def test_synchronous_mode_stops_waiting_for_a_learner_that_finished():
    state, layout, _ = make_state(wait_for_all=2)
    n = layout.fragments[0].numel
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    submit(state, "a", sa, 0, torch.ones(n), now=0.5)
    submit(state, "b", sb, 0, torch.ones(n), now=0.5)
    assert [c.fragment for c in state.poll(0.5)[0]] == [0]
    submit(state, "a", sa, 1, torch.ones(n), now=1.0)
    assert state.poll(50.0)[0] == []
    # Ids that join and leave without ever contributing did not finish anything: they do
    # not lower the number of contributions the round waits for.
    for i in range(5):
        state.leave(f"x{i}", join(state, f"x{i}", layout, now=51.0), now=52.0)
    assert state.poll(52.0)[0] == []
    state.leave("b", sb, now=60.0)  # a clean leave: b did all its steps
    assert [c.fragment for c in state.poll(60.0)[0]] == [1]


@pytest.mark.parametrize(
    "cfg, expected",
    [
        ({}, (300 * 1.0 + 100 * 2.0) / 400),  # RDA of parallel deltas, token weights 300:100
        ({"weighting": "uniform"}, (1.0 + 2.0) / 2),
        ({"merge_rule": "mean", "weight_cap": 0.0}, (900 * 1.0 + 100 * 2.0) / 1000),
    ],
)
def test_the_merge_and_weighting_ablations(cfg, expected):
    state, layout, _ = make_state(quorum=2, gamma=0.0, outer_scale="none", **cfg)
    n = layout.fragments[0].numel
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    before = state.params[0].clone()
    submit(state, "a", sa, 0, torch.full((n,), 1.0), now=1.0, tokens=30, steps=1)
    submit(state, "b", sb, 0, torch.full((n,), 2.0), now=1.0, tokens=10, steps=1)
    (commit,) = state.poll(1.0)[0]
    assert torch.allclose(state.params[0], before - expected)
    with pytest.raises(ValueError, match="merge_rule"):
        SyncerConfig(merge_rule="median")


def test_an_upload_accepted_while_its_fragment_is_merged_names_the_version_that_merges_it():
    """Issue 32, defect 2: ``close_rounds`` takes a round under the lock, the merge runs
    outside it and ``apply`` bumps the version later. An upload accepted in between lands in
    the next round; its answer must name the version that round starts from (so the learner
    expects it in the commit after that one), not the version before the merge."""
    state, layout, _ = make_state(quorum=1)
    n = layout.fragments[0].numel
    sa = join(state, "a", layout)
    submit(state, "a", sa, 0, torch.full((n,), 1.0), now=1.0)
    (closing,), _ = state.close_rounds(1.0)  # merging, outside the lock
    admission = submit(state, "a", sa, 0, torch.full((n,), 2.0), now=1.1, steps=3)
    state.apply(closing, closing.merge(), 1.2)
    assert state.versions[0] == 1
    (commit,), _ = state.poll(1.3)  # the round that holds it
    assert commit.record["participants"] == ["a"] and commit.record["steps"] == [3]
    assert admission.version + 1 == commit.version == 2


def test_an_upload_during_a_dropped_rounds_close_is_admitted_at_the_kept_version():
    """Found by review: a round whose contributions the direction check all left out keeps
    the version; an upload accepted while it was closing was answered as admitted one
    version later than the commit that then merged it."""
    state, layout, _ = make_state(quorum=1)
    n = layout.fragments[0].numel
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    state.learners["a"].verdicts.extend([True] * 4)  # a suspect: left out of small rounds
    submit(state, "a", sa, 0, torch.full((n,), 1.0), now=1.0)
    state.leave("b", sb, now=1.0)  # (so that a's round closes at once)
    (closing,), _ = state.close_rounds(1.0)
    assert not closing.contributions  # dropped
    sb = join(state, "b", layout, now=1.05)
    admission = submit(state, "b", sb, 0, torch.full((n,), 2.0), now=1.1)
    commit = state.apply(closing, closing.merge(), 1.2)
    assert not commit.changed and state.versions[0] == 0
    state.leave("a", sa, now=1.3)
    (commit,), _ = state.poll(1.3)
    assert commit.record["participants"] == ["b"]
    assert admission.version + 1 == commit.version == 1


def test_taking_the_wire_image_makes_the_guard_measure_the_new_value():
    """Down feedback off: Θ_p takes the wire image after the outer step; the norm guard's
    ‖Θ_p‖ (cached per version) must be that of the new value, not of the unrounded one."""
    state, _, _ = make_state()
    before = state.model.norm(0)
    wire = state.params[0] * 3
    state.model.take_wire_image(0, wire)
    assert torch.equal(state.params[0], wire)
    assert state.model.norm(0) == pytest.approx(3 * before)


def test_outer_lr_schedule_steps_by_the_fragments_version():
    # decay over 2 versions to 0.25 × lr: the steps of versions 1, 2, 3 use 1.0, 0.625, 0.25
    state, layout, _ = make_state(P=1, quorum=1, outer_lr_decay=2, outer_lr_final=0.25)
    n = layout.fragments[0].numel
    sa = join(state, "a", layout)
    used = []
    for version in range(3):
        before = state.params[0].clone()
        submit(state, "a", sa, 0, torch.ones(n), now=1.0 + version, base=version)
        commits, _ = state.poll(1.0 + version)
        assert [c.version for c in commits] == [version + 1]
        used.append(commits[0].record["outer_lr"])
        assert torch.allclose(state.params[0], before - used[-1])
    assert used == pytest.approx([1.0, 0.625, 0.25])


@pytest.mark.parametrize("cfg", [{"outer_lr_decay": -1}, {"outer_lr_final": 0.0}])
def test_outer_lr_schedule_refuses_bad_settings(cfg):
    with pytest.raises(ValueError, match="outer-lr"):
        SyncerConfig(**cfg)

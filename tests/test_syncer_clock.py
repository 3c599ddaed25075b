"""Rounds on the syncer's clock (``schedule="syncer"``), with a fake clock and no sockets.

The contract (docs/algorithm.md, "The syncer's clock"): ticks open each fragment's
round in turn, one every ``H·ξ_step/P`` seconds, and ask the live learners; a round closes
when every asked learner answered (or at quorum plus the grace window); an answer that finds
no open round waits for the fragment's next tick and is summed with that learner's answer.
"""

from __future__ import annotations

import pytest
import torch
from kit import join_state, syncer_state, tiny_model

from diloco.algorithm.guard import MAX_SPEEDUP
from diloco.algorithm.rounds import (
    MAKE_UP_TICKS,
    RoundClock,
    fleet_step_time,
    next_tick,
    tick_period,
)
from diloco.config import from_dict
from diloco.config.run import RunConfig
from diloco.syncer.config import SyncerConfig
from diloco.syncer.pace import StepPace, believed_step_s
from diloco.syncer.state import Refused
from diloco.wire.protocol import ProtocolConfig


def make_state(P=2, sync_every=None, **cfg):
    """A syncer's state on its clock, H = ``sync_every`` (default P)."""
    protocol = ProtocolConfig(sync_every=sync_every or P)
    config = SyncerConfig(**{"norm_guard_k": 0.0, "lease_s": 100.0, "protocol": protocol, **cfg})
    return syncer_state(tiny_model(0, (4, 4, 2), tanh=False), config, num_fragments=P)


def join(state, lid, layout, now=0.0, steps_per_s=10.0):
    session = join_state(state, lid, now)
    state.heartbeat(lid, session, now=now, steps_per_s=steps_per_s)
    return session


def answer(
    state, lid, session, fragment, now, steps=2, tokens=20, value=1.0, final=False, names=()
):
    n = state.layout.fragments[fragment].numel
    return state.submit(
        lid,
        session,
        fragment=fragment,
        base_version=state.versions[fragment],
        steps=steps,
        tokens=tokens,
        delta=torch.full((n,), value),
        step_time_s=0.1,
        nbytes=n,
        now=now,
        final=final,
        final_fragments=names,
    )


def test_the_pace_and_the_turns_of_the_clock():
    assert fleet_step_time([None, 0.2, 0.4, 100.0]) == 0.4  # median: one outlier cannot
    assert fleet_step_time([None, 0.0]) is None
    assert tick_period(0.1, sync_every=24, fragments=24) == pytest.approx(0.1)
    assert tick_period(0.1, sync_every=48, fragments=12) == pytest.approx(0.4)
    assert tick_period(1e-9, sync_every=1, fragments=24) == 1e-3  # clipped
    assert tick_period(None, sync_every=24, fragments=24) is None
    t = next_tick(5.0, due_at=None, period=0.5, cursor=0, served=[0, 1, 2], open_fragments=[0])
    assert (t.fragment, t.next_at, t.cursor) == (1, 5.5, 2)  # 0 is still open: skipped
    t = next_tick(5.2, due_at=5.5, period=0.5, cursor=2, served=[0, 1, 2], open_fragments=[])
    assert t.fragment is None and t.next_at == 5.5
    # a late tick: the two before now on the period's beat come at once (MAKE_UP_TICKS),
    # then the period runs from there; the five more it passed over are not made up
    assert MAKE_UP_TICKS == 2
    t = next_tick(9.0, due_at=5.5, period=0.5, cursor=2, served=[0, 1, 2], open_fragments=[])
    assert (t.fragment, t.next_at, t.cursor) == (2, 8.5, 0)
    t = next_tick(9.01, due_at=8.5, period=0.5, cursor=0, served=[0, 1, 2], open_fragments=[])
    assert (t.fragment, t.next_at) == (0, 9.0)
    t = next_tick(9.02, due_at=9.0, period=0.5, cursor=1, served=[0, 1, 2], open_fragments=[])
    assert (t.fragment, t.next_at) == (1, 9.5)
    # late by 1.4 periods (a commit held the clock): the one passed over, on the beat
    t = next_tick(6.2, due_at=5.5, period=0.5, cursor=2, served=[0, 1, 2], open_fragments=[])
    assert t.next_at == 6.0
    t = next_tick(6.21, due_at=6.0, period=0.5, cursor=0, served=[0, 1, 2], open_fragments=[])
    assert t.next_at == 6.5
    t = next_tick(5.9, due_at=5.5, period=0.5, cursor=2, served=[0, 1, 2], open_fragments=[])
    assert (t.fragment, t.next_at) == (2, 6.0)  # late by less than a period: on its beat
    with pytest.raises(ValueError):
        tick_period(0.1, sync_every=0, fragments=1)


def test_no_round_opens_before_the_fleet_has_a_step_time():
    state, layout, _ = make_state()
    join_state(state, "a")
    assert state.tick(0.0) == (None, None)


def test_ticks_ask_every_live_learner_and_the_round_closes_when_all_answered():
    state, layout, events = make_state(P=2, sync_every=4)
    sa, sb = join(state, "a", layout), join(state, "b", layout)  # 10 steps/s each
    request, next_at = state.tick(1.0)
    assert request.fragment == 0 and request.asked == {"a", "b"} and request.version == 0
    assert next_at == pytest.approx(1.0 + 0.1 * 4 / 2)  # H·ξ_step/P
    assert state.tick(1.1) == (None, pytest.approx(1.2))
    answer(state, "a", sa, 0, now=1.05)
    commits, _ = state.poll(1.05)
    assert commits == []  # b was asked too: the grace window starts at quorum
    answer(state, "b", sb, 0, now=1.08)
    (commit,) = state.poll(1.08)[0]
    assert commit.record["participants"] == ["a", "b"] and commit.record["asked"] == 2
    request, _ = state.tick(1.2)
    assert request.fragment == 1 and request.version == 0


def test_an_answer_that_misses_its_round_waits_for_the_next_tick_and_is_summed():
    state, layout, _ = make_state(P=2, sync_every=4, gamma=0.0)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    state.tick(1.0)  # fragment 0
    answer(state, "a", sa, 0, now=1.05)
    assert [c.fragment for c in state.poll(1.05)[0]] == [0]  # quorum 1, no grace: closed
    answer(state, "b", sb, 0, now=1.06, steps=3, tokens=30)  # late: no open round of 0
    assert state.poll(5.0)[0] == []  # waits for the clock, however long
    state.tick(5.0)  # fragment 1's turn
    request, _ = state.tick(5.3)
    assert request.fragment == 0
    answer(state, "b", sb, 0, now=5.35, steps=2, tokens=20)
    answer(state, "a", sa, 0, now=5.36)
    (commit,) = state.poll(5.36)[0]
    # b's late answer and its answer to this round went in as one contribution
    assert commit.record["participants"] == ["a", "b"]
    assert commit.record["steps"] == [2, 5] and commit.record["increments"] == [1, 2]
    assert commit.record["tokens_by_learner"] == {"a": 20, "b": 50}


def test_a_round_nobody_answers_is_asked_again_on_its_next_turn():
    state, layout, _ = make_state(P=2, sync_every=4)
    join(state, "a", layout)
    assert state.tick(1.0)[0].fragment == 0
    assert state.tick(1.2)[0].fragment == 1
    request, _ = state.tick(1.4)
    assert request.fragment == 0  # no answer to the first request: asked again


def test_a_late_tick_makes_up_one_tick_and_no_more_even_when_the_pace_rises():
    """A tick a period or more (and under two) late makes up the one it passed over, at
    once, and only that one: not a second when the pace rises meanwhile (the earlier due
    time of the faster pace lies in the past), and the made-up tick does not ask again a
    round opened just before."""
    state, layout, _ = make_state(P=2, sync_every=4)  # 10 steps/s: a tick every 0.2 s
    session = join(state, "a", layout)
    request, next_at = state.tick(1.0)
    assert request.fragment == 0 and next_at == pytest.approx(1.2)
    request, next_at = state.tick(1.5)  # due at 1.2: a period and a half late
    assert request is not None and next_at == pytest.approx(1.4)  # (the one passed over)
    state.heartbeat("a", session, now=1.5, steps_per_s=40.0)  # a tick every 0.05 s now
    fired = 0
    t = 1.5
    while t <= 1.5:
        request, t = state.tick(1.5)
        fired += request is not None
    assert fired == 1 and t == pytest.approx(1.55)  # the one made up, then the new pace

    state, layout, _ = make_state(P=1, sync_every=1)  # one fragment: a tick every 0.1 s
    join(state, "a", layout)
    assert state.tick(1.0)[0].fragment == 0
    request, next_at = state.tick(1.25)  # unanswered on its next turn: asked again, late
    assert request.fragment == 0 and next_at == pytest.approx(1.2)
    request, next_at = state.tick(1.25)  # the made-up tick: that round was asked just now
    assert request is None and next_at == pytest.approx(1.3)


def test_the_clock_counts_the_due_ticks_it_did_not_make():
    """``RoundClock.lost``: beats a stall passed over beyond the make-up, a due tick that found
    every fragment's round open, and an owed tick's time when the pace rose; none while no
    learner is live (nothing is due then)."""
    clock, served = RoundClock(), [0, 1, 2]
    assert clock.tick(1.0, 0.5, served, [], live=True).fragment == 0
    assert clock.tick(1.5, 0.5, served, [], live=True).lost == 0  # on its beat
    t = clock.tick(4.0, 0.5, served, [], live=True)  # due at 2.0: 2.5 and 3.0 passed over
    assert t.fragment is not None and t.next_at == 3.5 and clock.lost == 2.0
    clock.tick(4.0, 0.5, served, [], live=True)  # 3.5, made up
    assert clock.due_at == 4.0 and clock.lost == 2.0
    clock.tick(4.0, 0.5, served, [], live=True)  # 4.0, on its beat: three ticks at once
    assert clock.due_at == 4.5 and clock.lost == 2.0
    t = clock.tick(4.5, 0.5, served, served, live=True)  # due, but every round still open
    assert t.fragment is None and t.next_at == 5.0 and clock.lost == 3.0
    t = clock.tick(20.0, 0.5, served, [], live=False)  # nobody live: nothing was due
    assert t.fragment is None and clock.lost == 3.0
    clock = RoundClock()
    clock.tick(1.0, 0.5, served, [], live=True)
    t = clock.tick(1.75, 0.25, served, [], live=True)  # owed since 1.5, and the pace rose
    assert t.fragment is not None and t.next_at == 2.0 and clock.lost == 1.0
    clock.tick(2.003, 0.2, served, [], live=True)  # 3 ms late as the pace rises: none lost
    assert clock.lost == 1.0


def test_a_syncer_whose_clock_stalled_says_how_many_due_ticks_it_lost():
    state, layout, _ = make_state(P=2, sync_every=4)  # 10 steps/s: a tick every 0.2 s
    join(state, "a", layout)
    assert state.tick(1.0)[0] is not None and state.clock.lost == 0
    request, _ = state.tick(2.0)  # due at 1.2: 1.4, 1.6 passed over, 1.8 made up at once
    assert request is not None and state.clock.lost == pytest.approx(2.0)


def test_a_final_answer_answers_the_next_round_and_nothing_waits_forever_without_learners():
    state, layout, _ = make_state(P=2, sync_every=4)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    answer(state, "a", sa, 0, now=1.0, final=True)  # a stops: its last progress waits ...
    assert state.poll(1.0)[0] == []
    state.tick(1.1)  # ... for fragment 0's tick, where it counts as a's answer
    answer(state, "b", sb, 0, now=1.15)
    (commit,) = state.poll(1.15)[0]
    assert commit.record["participants"] == ["a", "b"]
    assert commit.record["reason"].startswith("every live learner")
    answer(state, "b", sb, 1, now=1.2)  # waits for the clock ...
    assert state.poll(1.2)[0] == []
    state.leave("a", sa, now=1.3)
    state.leave("b", sb, now=1.3)  # ... but nobody is left to be asked: merged
    assert [c.fragment for c in state.poll(1.4)[0]] == [1]


def test_a_stopping_learner_is_not_asked_so_its_late_answer_is_not_held():
    # seen in a two-shard run: b's answer to fragment 0 came just after the round closed
    # (late: it waits for the next round, where it does not answer), then b stopped and
    # flushed fragment 1 as final; the clock kept asking b for fragment 0, b answered nothing
    # more, and its late answer waited until b left (its close could not drain in time)
    state, layout, _ = make_state(P=2, sync_every=4, gamma=0.0)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    state.tick(1.0)  # fragment 0
    answer(state, "a", sa, 0, now=1.05)
    assert [c.fragment for c in state.poll(1.05)[0]] == [0]
    answer(state, "b", sb, 0, now=1.06)  # late
    answer(state, "b", sb, 1, now=1.07, final=True)  # b is stopping
    assert state.live(1.07) == {"a"}  # b will answer no more requests: not asked
    state.leave("a", sa, now=1.08)
    request, _ = state.tick(1.2)  # fragment 1's turn: nobody live to ask ...
    assert request is None
    merged = sorted(c.fragment for c in state.poll(1.2)[0])
    assert merged == [0, 1]  # ... so b's late and final answers are merged at once
    sb2 = join(state, "b", layout, now=2.0)  # a learner that comes back is asked again
    assert sb2 and state.live(2.0) == {"b"}


def test_an_absent_learner_counts_in_the_share_by_its_measured_throughput():
    state, layout, _ = make_state(P=2, sync_every=4, gamma=0.0)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    state.heartbeat("b", sb, now=1.0, steps_per_s=10.0, tokens=300)  # 300 tokens/s since 0
    answer(state, "b", sb, 1, now=1.0)  # b contributes (to fragment 1): its share counts
    state.closing.last_commit_at[0] = 1.5
    state.tick(2.0)
    answer(state, "a", sa, 0, now=2.0, tokens=100)
    (commit,) = state.poll(2.0)[0]
    # b trained ~300 tokens/s x 0.5 s since fragment 0's last commit: 100 of 250 tokens
    assert commit.record["share"] == pytest.approx(100 / 250)


def test_a_round_holding_a_quorum_of_early_contributions_closes_within_one_cycle():
    """Issue 32, defect 14: three contributions sent before the tick asked for them, from
    learners that then stay silent (live, heartbeating, never answering), used to hold the
    round open for as long as they lived: only answers counted towards quorum. A round that
    holds a quorum now closes at the latest one clock cycle after it was first opened."""
    state, layout, _ = make_state(quorum=3)
    sessions = {lid: join(state, lid, layout) for lid in ("a", "b", "c")}
    for lid, session in sessions.items():
        answer(state, lid, session, fragment=0, now=0.05)  # before any tick: early
    cycle = tick_period(0.1, sync_every=2, fragments=2) * 2  # H·ξ_step = 0.2 s
    committed_at = None
    now = 0.1
    while now < 60.0 and committed_at is None:
        for lid, session in sessions.items():
            state.heartbeat(lid, session, now=now, steps_per_s=10.0)
        state.tick(now)
        commits, _ = state.poll(now)
        if any(c.fragment == 0 and c.changed for c in commits):
            committed_at = now
        now += 0.05
    assert committed_at is not None, "the round holding a quorum never closed"
    assert committed_at <= 0.1 + cycle + 0.1  # first opened at 0.1, one cycle, one poll


def test_an_h_schedule_ticks_faster_for_its_early_cycles_then_at_h():
    state, layout, _ = make_state(P=2, sync_every=8, early_sync_every=2, early_cycles=2)
    s = join(state, "a", layout)
    assert state.sync_every() == 2
    request, next_at = state.tick(0.0)
    assert next_at == pytest.approx(0.1)  # 2 steps of 0.1 s over 2 fragments (8 would be 0.4)
    now = 0.0
    while min(state.versions) < 2:  # two cycles: each fragment merged twice
        assert now < 100.0, state.versions
        if request is not None:
            answer(state, "a", s, request.fragment, now)
            state.poll(now)
        now += 1.0
        request, _ = state.tick(now)
    assert state.sync_every() == 8
    # the guard's sizes covered periods of 2 steps: a delta of 8 is not judged by them
    assert state.norms.size_reference(0, 1) is None and state.norms.size_reference(1, 1) is None
    with pytest.raises(ValueError, match="must be below --sync-every"):
        SyncerConfig(early_sync_every=24, early_cycles=2)
    with pytest.raises(ValueError, match="needs --mode decoupled"):
        from_dict(RunConfig, {"mode": "sync", "syncer": {"early_sync_every": 8, "early_cycles": 2}})
    with pytest.raises(ValueError, match="go together"):
        SyncerConfig(early_sync_every=4)
    with pytest.raises(ValueError, match="needs the syncer's clock"):
        SyncerConfig(early_sync_every=4, early_cycles=2, schedule="learner")


def test_a_fleet_that_stops_together_merges_one_round_per_fragment_over_slow_links():
    # seen over a 300 kbit/s link with --comms lowest: every learner flushed all its
    # fragments at the end; their finals arrived one by one and, nobody being live any more,
    # each closed a round of its own: up to 4 full outer steps (and 4 momentum steps) per
    # fragment instead of one, and the final model was far worse than the one before
    state, layout, _ = make_state(P=2, sync_every=4)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    answer(state, "a", sa, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "b", sb, 0, now=1.01, final=True, names=[0, 1])  # nobody is live now
    (commit,) = state.poll(1.01)[0]
    assert commit.fragment == 0 and commit.record["participants"] == ["a", "b"]
    answer(state, "a", sa, 1, now=1.02, final=True)  # b's final of 1 is on its way ...
    commits, wake = state.poll(1.02)
    assert commits == [] and wake is not None  # ... so fragment 1's round waits for it
    assert state.finals_due(1, 1.02) == {"b": pytest.approx(wake)}
    answer(state, "b", sb, 1, now=1.5, final=True)
    (commit,) = state.poll(1.5)[0]
    assert commit.fragment == 1 and commit.record["participants"] == ["a", "b"]
    assert state.versions == [1, 1]


def test_a_flush_is_not_waited_for_once_its_learner_is_gone_or_silent():
    state, layout, _ = make_state(P=2, sync_every=4, lease_s=2.0)
    sa, sb, sc = (join(state, lid, layout) for lid in "abc")
    answer(state, "a", sa, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "b", sb, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "c", sc, 0, now=1.0, final=True, names=[0])
    state.poll(1.0)
    answer(state, "a", sa, 1, now=1.1, final=True)
    assert state.poll(1.1)[0] == []  # b named fragment 1, c did not
    state.leave("b", sb, now=1.2)  # b left without sending it: not waited for
    (commit,) = state.poll(1.2)[0]
    assert commit.fragment == 1 and commit.record["participants"] == ["a"]
    # a flush whose learner heartbeats no more is waited for until its lease runs out
    state2, layout2, _ = make_state(P=2, sync_every=4, lease_s=2.0)
    sa, sb = join(state2, "a", layout2), join(state2, "b", layout2)
    answer(state2, "a", sa, 1, now=1.0, final=True, names=[0, 1])
    answer(state2, "b", sb, 1, now=1.0, final=True, names=[1])
    state2.poll(1.0)
    answer(state2, "b", sb, 0, now=1.0, final=True)  # (b had not named 0: nothing waits)
    assert state2.poll(1.5)[0] == []  # a's final of 0 is due until its lease ends at 3.0
    (commit,) = state2.poll(3.01)[0]
    assert commit.fragment == 0 and commit.record["participants"] == ["b"]


@pytest.mark.parametrize("final, names", [(False, [0]), (True, [0, 0]), (True, [2]), (True, [-1])])
def test_bad_final_fragments_are_refused_and_change_nothing(final, names):
    state, layout, _ = make_state(P=2, sync_every=4)
    sa = join(state, "a", layout)
    with pytest.raises(Refused, match="final_fragments"):
        answer(state, "a", sa, 0, now=1.0, final=final, names=names)
    assert state.rounds.get(0) is None or not state.rounds[0].contributions
    assert not state.learners["a"].stopping and not state.learners["a"].finals_due


def test_what_settles_a_due_final_and_what_does_not():
    state, layout, _ = make_state(P=2, sync_every=4)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    answer(state, "a", sa, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "b", sb, 0, now=1.0, final=True, names=[0, 1])
    state.poll(1.0)
    # a non-final upload of 1 (a resend from before the flush) does not settle a's final ...
    answer(state, "a", sa, 1, now=1.1)
    assert state.poll(1.1)[0] == [] and set(state.finals_due(1, 1.1)) == {"a", "b"}
    # ... a final the syncer refuses will not come again: nothing waits for it
    n = layout.fragments[1].numel
    with pytest.raises(Refused):
        state.submit("b", sb, fragment=1, base_version=7, steps=2, tokens=20,
                     delta=torch.ones(n), step_time_s=0.1, nbytes=n, now=1.2, final=True)  # fmt: skip
    assert set(state.finals_due(1, 1.2)) == {"a"}
    answer(state, "a", sa, 1, now=1.3, final=True, names=[1])
    (commit,) = state.poll(1.3)[0]
    assert commit.fragment == 1 and commit.record["participants"] == ["a"]


def test_a_stopping_syncer_and_the_learners_schedule_do_not_wait_for_finals():
    state, layout, _ = make_state(P=2, sync_every=4)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    answer(state, "a", sa, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "b", sb, 1, now=1.0, final=True, names=[0, 1])
    assert state.poll(1.0)[0] == []  # each round waits for the other's final ...
    commits, _ = state.poll(1.0, wait_for_finals=False)  # ... but not at the syncer's stop
    assert sorted(c.fragment for c in commits) == [0, 1]
    state, layout, _ = make_state(P=2, sync_every=4, schedule="learner", gamma=0.0)
    sa, sb = join(state, "a", layout), join(state, "b", layout)
    answer(state, "a", sa, 0, now=1.0, final=True, names=[0, 1])
    answer(state, "b", sb, 1, now=1.0, final=True, names=[0, 1])
    assert sorted(c.fragment for c in state.poll(1.0)[0]) == [0, 1]


def test_a_claim_of_a_fast_pace_does_not_flood_the_clock():
    """Issue 46, defect 6: one learner claiming 1e9 steps/s (heartbeats and uploads) while
    its step counter advances at 10 steps/s, like the honest learner's, set the tick period
    to 1 ms (1,001 ticks a second instead of 10). Claims are clamped to a band around the
    pace the syncer measures (``MAX_SPEEDUP``), so the clock keeps within it."""
    state, layout, _ = make_state(P=2, sync_every=2)
    honest_step_s = 0.1
    honest_period = tick_period(honest_step_s, sync_every=2, fragments=2)
    sa, sb = join_state(state, "a"), None
    for second in range(12):
        now = float(second)
        state.heartbeat("a", sa, now=now, step=10 * second, steps_per_s=1 / honest_step_s)
        if second == 4:
            sb = join_state(state, "b", now)
        if sb is None:
            continue
        state.heartbeat("b", sb, now=now, step=10 * second, steps_per_s=1e9)
        n = layout.fragments[0].numel
        state.submit("b", sb, fragment=0, base_version=state.versions[0], steps=1,
                     tokens=10, delta=torch.zeros(n), step_time_s=1e-9, nbytes=n, now=now)  # fmt: skip
        assert state.fleet_step_s(now) >= honest_step_s / MAX_SPEEDUP
        ticks, t = 0, now
        while t < now + 1.0:  # the clock's ticks over the next second
            request, t = state.tick(t)
            ticks += request is not None
            state.poll(t)
        assert ticks <= MAX_SPEEDUP / honest_period + 1, (second, ticks)


def test_the_pace_the_syncer_measures_and_the_claims_it_believes():
    pace = StepPace()
    for second in range(4):  # 10 steps a second, heartbeats a second apart
        pace.observe(float(second), 10 * second)
    assert pace.step_s == pytest.approx(0.1)
    pace.observe(4.0, 10**9)  # one counter that jumps: one sample of nine
    pace.observe(5.0, 10**9 + 10)
    assert pace.step_s == pytest.approx(0.1)
    pace.observe(5.1, 10**9 + 20)  # a flood of messages closes no interval
    pace.observe(6.0, 10**9 + 20)
    assert pace.step_s == pytest.approx(0.1) and len(pace.samples) == 6
    fresh = StepPace()
    for now in (0.0, 1.0, 2.0):
        fresh.observe(now, int(10 * now))
    assert fresh.step_s is None  # two intervals: not measured yet
    assert believed_step_s(1e-9, 0.1, None) == pytest.approx(0.1 / MAX_SPEEDUP)
    assert believed_step_s(3599.0, None, 0.1) == pytest.approx(0.1 * MAX_SPEEDUP)

"""Round decisions and staleness admission: pure functions, no clock, no sockets."""

from __future__ import annotations

import pytest

from diloco.algorithm.rounds import (
    Ema,
    Estimates,
    OpenRound,
    admit_contribution,
    decide_round,
    grace_window,
)

EST = Estimates(step_s=1.0, quorum_s=0.2, sync_s=0.3)  # grace = clip(1*(2*1-0.2-0.3), 0, 1) = 1.0


def decide(now, contributors, live, quorum=2, estimates=EST, quorum_at=None):
    r = OpenRound(frozenset(contributors), opened_at=0.0, quorum_at=quorum_at)
    return decide_round(now, r, set(live), quorum=quorum, gamma=1.0, tau=2, estimates=estimates)


def test_grace_window_formula_and_clipping():
    assert grace_window(EST, gamma=1.0, tau=2) == pytest.approx(1.0)  # capped at one step
    assert grace_window(EST, gamma=0.5, tau=1) == pytest.approx(0.25)
    assert grace_window(Estimates(1.0, 5.0, 0.0), gamma=1.0, tau=2) == 0.0  # clipped at 0
    assert grace_window(Estimates(), gamma=1.0, tau=2) == 0.0  # no estimate yet
    assert grace_window(Estimates(step_s=2.0), gamma=0.25, tau=2) == pytest.approx(1.0)


def test_empty_round_waits():
    d = decide_round(5.0, None, {"a"}, quorum=1, gamma=1, tau=2, estimates=EST)
    assert not d.close and d.wait_until is None


def test_below_quorum_waits_for_arrivals():
    d = decide(10.0, {"a"}, {"a", "b", "c"})
    assert not d.close and d.wait_until is None and "quorum (1/2)" in d.reason


def test_quorum_then_grace():
    d = decide(3.0, {"a", "b"}, {"a", "b", "c"}, quorum_at=3.0)
    assert not d.close and d.wait_until == pytest.approx(4.0)
    d = decide(4.0, {"a", "b"}, {"a", "b", "c"}, quorum_at=3.0)
    assert d.close and "grace" in d.reason


def test_quorum_without_estimates_closes_at_once():
    d = decide(3.0, {"a", "b"}, {"a", "b", "c"}, estimates=Estimates(), quorum_at=3.0)
    assert d.close


def test_early_close_when_every_live_learner_contributed():
    d = decide(3.0, {"a", "b", "c"}, {"a", "b", "c"}, quorum=2, quorum_at=3.0)
    assert d.close and "every live learner" in d.reason


def test_fewer_live_than_quorum_closes_with_live_ones():
    # K=3 but only a and b are live and both contributed: training does not stall.
    d = decide(3.0, {"a", "b"}, {"a", "b"}, quorum=3)
    assert d.close
    # ... but while one live learner is missing, the round waits.
    assert not decide(3.0, {"a"}, {"a", "b"}, quorum=3).close


def test_contributions_of_dead_learners_count():
    d = decide(3.0, {"a", "x"}, {"a", "b", "c"}, quorum=2, quorum_at=1.0)
    assert d.close  # quorum 2 reached at t=1, grace 1 s elapsed


def test_no_live_learner_closes():
    assert decide(3.0, {"x"}, set(), quorum=2).close


def test_bad_quorum():
    with pytest.raises(ValueError):
        decide(0.0, {"a"}, {"a"}, quorum=0)


@pytest.mark.parametrize(
    "base,current,accept,discount,resync",
    [
        (5, 5, True, 1.0, False),
        (4, 5, True, 0.5, False),
        (3, 5, True, 1 / 3, False),
        (2, 5, False, 0.0, True),
        (6, 5, False, 0.0, False),
        (-1, 5, False, 0.0, False),
    ],
)
def test_admission(base, current, accept, discount, resync):
    a = admit_contribution(base_version=base, current_version=current, max_staleness=2)
    assert (a.accept, a.resync) == (accept, resync)
    assert a.discount == pytest.approx(discount)


def test_ema():
    e = Ema(0.5)
    assert e.value is None
    assert e.update(2.0) == 2.0
    assert e.update(4.0) == 3.0
    with pytest.raises(ValueError):
        Ema(1.0)

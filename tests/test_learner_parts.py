"""The learner's parts: the ``Learner`` holds them (no mixins), each is given what it needs,
and every ``now`` they decide with comes from the learner's one clock."""

from __future__ import annotations

import doctest
import importlib
import threading
import time

import pytest
import torch

import diloco
from diloco.learner.learner import Learner
from diloco.learner.pacing import Pace, Pacer
from diloco.learner.stopping import drain_timeout
from diloco.learner.waiting import holds_joined, late_fragments


class SteppedClock:
    """A clock that moves ``by`` seconds every time it is read (from any thread)."""

    def __init__(self, by: float) -> None:
        self.by, self.reads = by, 0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        with self.lock:
            self.reads += 1
            return (self.reads - 1) * self.by


def make_learner(clock):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    # No syncer listens on port 1: the link just retries in the background.
    return diloco.Learner(
        model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me", clock=clock
    )


def test_the_learner_holds_its_parts_and_inherits_none():
    assert Learner.__bases__ == (object,)


@pytest.mark.parametrize(
    "module", ["diloco.learner.settling", "diloco.learner.stopping", "diloco.learner.waiting"]
)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_wait_for_global_gives_up_when_the_learners_clock_says_so():
    clock = SteppedClock(by=100.0)  # each read: 100 s later
    learner = make_learner(clock)
    assert learner.link.clock is clock  # (its link's deadlines too)
    try:
        began = time.monotonic()
        assert learner.wait_for_global(60.0, required=False) is False
        with pytest.raises(TimeoutError):
            learner.wait_for_global(60.0)
        assert time.monotonic() - began < 30.0  # the learner's 120 s passed, not ours
    finally:
        learner.close(flush=False)


def test_the_step_time_is_measured_on_the_learners_clock():
    learner = make_learner(SteppedClock(by=0.5))
    try:
        for _ in range(3):
            learner.step(tokens=1)
        assert learner.pacer.step_time == pytest.approx(0.5)
        assert learner.listener.heartbeat_info()["steps_per_s"] == pytest.approx(2.0)
    finally:
        learner.close(flush=False)


def test_a_closed_learner_refuses_to_step():
    learner = make_learner(SteppedClock(by=1.0))
    learner.stopper.close(flush=False)
    assert learner.stopper.closed and learner.progress.state == "closed"
    with pytest.raises(RuntimeError, match="after close"):
        learner.step(tokens=1)


def test_pure_decisions():
    assert holds_joined([2, 5], [2, 4]) and not holds_joined([2, 3], [2, 4])
    assert not holds_joined([2], None)
    assert late_fragments({0: (3, 0), 1: (9, 0)}, 10, 5) == [0]
    assert drain_timeout(5.0, "syncer", 1000, 1.0) == 30.0  # capped (MAX_DRAIN_S)
    assert drain_timeout(0.0, "syncer", 100, 1.0) == 0.0  # off stays off
    pacer = Pacer(Pace(max_stretch=2, lag_steps=1.0), step_time_decay=0.0, num_fragments=1)
    pacer.stepped(0.0)
    pacer.stepped(1.0)
    assert pacer.step_time == 1.0
    assert pacer.defer(0, backlog_s=5.0) and pacer.behind
    assert not pacer.defer(0, backlog_s=5.0)  # stretched once already: sent
    assert not pacer.behind

"""``diloco run``'s last wait before it scores the final model (``launch.run.wait_for_settled``):
until the syncer's ``Status.waiting`` is 0, and never longer than a wait that cannot end."""

from __future__ import annotations

import time

import pytest

from diloco.launch import run
from diloco.wire import diloco_pb2 as pb


class Replies:
    """Stands in for ``StatusClient``: answers the given replies in order, the last one
    again once they run out (``None``: the syncer does not answer)."""

    def __init__(self, *replies) -> None:
        self.replies = list(replies)
        self.calls = 0

    def fetch(self):
        self.calls += 1
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


def status(waiting: int, *, live: bool = False, failure: str = "") -> pb.StatusReply:
    learners = [pb.LearnerStatus(learner_id="a", live=live)]
    return pb.StatusReply(waiting=waiting, learners=learners, failure=failure)


def test_it_waits_until_nothing_admitted_is_left_to_commit():
    client = Replies(None, status(3), status(1), status(0))
    got = run.wait_for_settled(client, timeout=10)
    assert got.waiting == 0 and client.calls == 4


def test_a_count_that_stands_still_with_nobody_live_ends_the_wait(monkeypatch):
    monkeypatch.setattr(run, "SETTLED_STILL_S", 0.5)
    t0 = time.monotonic()
    got = run.wait_for_settled(Replies(status(2)), timeout=10)
    assert got.waiting == 2 and 0.5 <= time.monotonic() - t0 < 3


def test_while_a_learner_is_live_only_the_timeout_ends_the_wait(monkeypatch):
    monkeypatch.setattr(run, "SETTLED_STILL_S", 0.2)
    t0 = time.monotonic()
    got = run.wait_for_settled(Replies(status(2, live=True)), timeout=1.0)
    assert got.waiting == 2 and time.monotonic() - t0 >= 1.0


@pytest.mark.parametrize(
    "replies", [(status(2, failure="disk full"),), (status(2), None)], ids=["failed", "gone"]
)
def test_a_syncer_that_failed_or_went_away_is_not_waited_for(replies):
    t0 = time.monotonic()
    got = run.wait_for_settled(Replies(*replies), timeout=10)
    assert got.waiting == 2 and time.monotonic() - t0 < 1.0


def test_a_syncer_that_never_answers_gives_none_at_the_timeout():
    assert run.wait_for_settled(Replies(None), timeout=0.5) is None

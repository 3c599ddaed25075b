"""Upload pacing: a learner on a slow link defers requests, loses nothing, says so.

The pure rules first, then a real syncer (gRPC on loopback, the syncer's clock) with two
learners, one of them behind a TCP relay throttled to a few kB/s: it must defer requests,
report ``link behind`` in its heartbeat state, and still have every trained step merged
exactly once (or held as its documented unsent tail), like the learner on the fast link.
"""

from __future__ import annotations

import logging
import threading

import pytest
from fleet import STEPS, P, make_model, merged_steps, start_syncer, start_training
from kit import wait_until

from diloco.launch.relay import Relay
from diloco.learner.learner import Learner
from diloco.learner.pacing import (
    DOWNLINK_BEHIND_VERSIONS,
    Pace,
    UploadMeter,
    backlog_seconds,
    versions_missing,
)
from diloco.syncer.store import read_tape
from diloco.wire.protocol import ProtocolConfig


def test_the_meter_weighs_uploads_by_their_bytes():
    meter = UploadMeter(decay=1.0)
    assert meter.rate_Bps is None
    meter.record(1_000_000, 1.0)
    meter.record(10, 0.5)  # a tiny upload is mostly round trip: it barely moves the rate
    assert meter.rate_Bps == pytest.approx(1_000_010 / 1.5)
    meter.record(0, 1.0)  # nothing sent: ignored
    assert meter.rate_Bps == pytest.approx(1_000_010 / 1.5)


def test_an_upload_in_flight_counts_for_as_long_as_it_flies():
    now = [0.0]
    meter = UploadMeter(decay=1.0, clock=lambda: now[0])
    meter.began(1000)
    now[0] = 0.5
    assert meter.rate_Bps == pytest.approx(2000)  # at most what it could have done so far
    now[0] = 10.0
    assert meter.rate_Bps == pytest.approx(100)  # a link that delivers nothing: falling
    meter.ended(delivered=False)  # a failed upload measures nothing
    assert meter.rate_Bps is None
    meter.began(1000)
    now[0] = 11.0
    meter.ended(delivered=True)
    assert meter.rate_Bps == pytest.approx(1000)


def test_versions_missing_counts_the_syncers_versions_beyond_what_is_held():
    assert versions_missing(7, 7) == 0
    assert versions_missing(7, 4) == 3
    assert versions_missing(3, 5) == 0  # it holds a newer one already (the reply was old)
    assert versions_missing(7, -1) is None  # waiting for a keyframe: nothing to say


def test_backlog_is_unknown_until_a_rate_is_measured():
    assert backlog_seconds(10_000, None) == 0.0
    assert backlog_seconds(10_000, 5_000.0) == 2.0
    assert backlog_seconds(0, 5_000.0) == 0.0


def test_defer_only_while_behind_and_never_past_the_stretch():
    pace = Pace(max_stretch=3, lag_steps=4.0)
    assert not pace.defer(0.3, 0.1, 0)  # 3 steps of backlog: keeps up
    assert pace.defer(0.5, 0.1, 0)  # 5 steps: behind
    assert pace.defer(0.5, 0.1, 1)
    assert not pace.defer(0.5, 0.1, 2)  # the third request in a row is answered: period <= 3H
    assert not pace.defer(5.0, None, 0)  # no step time yet: nothing known, nothing deferred
    assert not Pace(max_stretch=1).defer(100.0, 0.01, 0)  # off
    with pytest.raises(ValueError):
        Pace(max_stretch=0)
    with pytest.raises(ValueError):
        Pace(lag_steps=0.0)


@pytest.mark.timeout(60)
def test_downloads_have_a_connection_of_their_own(tmp_path):
    # on a slow link the subscription's bytes fill its connection's buffers for seconds: an
    # upload's reply queued behind them would make the learner's link look slower than it is
    server = start_syncer(tmp_path)
    relay = Relay(server.address)
    learner = None
    try:
        learner = Learner(make_model(1), syncer=relay.address, num_fragments=P, learner_id="l0")
        assert learner.wait_for_global(timeout=20)  # joined and subscribed
        assert relay.connections == 2
    finally:
        if learner is not None:
            learner.close(flush=False)
        server.stop()
        relay.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_learner_on_a_slow_link_defers_and_every_step_still_lands_once(tmp_path, caplog):
    # a request every other step: the learner on the fast link keeps up with room to spare
    caplog.set_level(logging.INFO, logger="diloco.learner")
    # int4 up, int8 down (the former default): the throttle below is sized for their ~2 kB
    # uploads and their downloads (the default's sign1 uploads are 3.4x smaller, and the fast
    # learner's measured rate stays under the bound)
    server = start_syncer(
        tmp_path, norm_guard_k=0.0, protocol=ProtocolConfig(sync_every=8), up_codec="int4",
        down_codec="int8",
    )  # fmt: skip
    fast = Relay(server.address, name="fast")
    slow = Relay(server.address, name="slow")
    states: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # what the syncer hears from the slow learner
        while not stop.wait(0.05):
            info = server.state.learners.get("l1")
            if info is not None:
                states.add(info.state)

    watcher = threading.Thread(target=watch)
    learners = []
    try:
        slow.throttle(6_000)  # bytes/s each way: one ~2 kB upload takes a third of a second
        watcher.start()
        learners, threads = start_training([fast.address, slow.address], pace=0.04)
        for t in threads:
            t.join(timeout=60)
        # the rates measured on the links as they were while training (the flush below runs
        # unthrottled and would raise the slow link's average)
        rates = [lr.stats["up_rate_Bps"] for lr in learners]
        slow.throttle(0)
        for lr in learners:
            lr.close(flush=True)
        wait_until(
            lambda: not any(r.contributions for r in server.state.rounds.values()),
            20,
            "every open round to be settled",
            interval=0.05,
        )
    finally:
        stop.set()
        server.stop()
        fast.close()
        slow.close()
        if watcher.is_alive():
            watcher.join(timeout=5)
    on_fast, on_slow = (lr.stats for lr in learners)
    assert on_slow["deferred"] > 0 and on_fast["deferred"] == 0, (on_slow, on_fast)
    assert rates[1] < 20_000 < (rates[0] or 0), (rates, on_slow, on_fast)
    assert any("link behind" in s for s in states), states
    said = [r.getMessage() for r in caplog.records if "fall behind" in r.getMessage()]
    assert said and all(m.startswith("learner l1: its uploads fall behind") for m in said)
    # its downlink cannot carry the fast learner's merges either: it says so too
    assert any("downlink behind" in s for s in states), states
    assert on_slow["down_lag"] >= 0 and on_fast["down_lag"] < DOWNLINK_BEHIND_VERSIONS, on_fast
    rounds = [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "round"]
    for i, lr in enumerate(learners):
        assert lr.local_step == STEPS
        for p in range(P):
            merged = merged_steps(rounds, f"l{i}", p)
            assert merged + lr.unsent()[p] == STEPS, (i, p, merged, lr.unsent())
    # the slow one contributed
    assert any(merged_steps(rounds, "l1", p) for p in range(P)), f"{on_slow} {lr.unsent()}"

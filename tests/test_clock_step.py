"""A wall-clock step (NTP, a VM resumed after a pause) changes no decision of the syncer.

The contract (docs/algorithm.md, "Syncer failures: what a learner may assume"): every
decision (ticks, rounds, leases, deadlines) runs on a monotonic clock
(``diloco.runtime.clock.monotonic``); wall time is only written on the tape. Here a real
syncer's process sees ``time.time`` jump back an hour while it serves.
"""

from __future__ import annotations

import sys
import threading
import time as _time

import pytest
from kit import Peer, local_syncer, tiny_model, wait_until

from diloco.syncer.config import SyncerConfig
from diloco.syncer.store import read_tape
from diloco.wire import diloco_pb2 as pb
from diloco.wire.protocol import ProtocolConfig

STEP_BACK_S = 3600.0


class SteppedTime:
    """The ``time`` module as diloco's code sees it after a wall-clock step: ``time()`` an
    hour earlier, everything else (``monotonic``, ``sleep``) as it is."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return _time.time() - self.offset_s

    def __getattr__(self, name):
        return getattr(_time, name)


def step_wall_clock_back(monkeypatch) -> None:
    """From now on every diloco module reads ``time.time`` an hour earlier; gRPC's own
    deadlines (and this test's waits) keep the real clock."""
    stepped = SteppedTime(STEP_BACK_S)
    for name, module in list(sys.modules.items()):
        if name.startswith("diloco") and getattr(module, "time", None) is _time:
            monkeypatch.setattr(module, "time", stepped)


def serve(tmp_path, **overrides):
    config = SyncerConfig(
        **{"protocol": ProtocolConfig(num_fragments=4, sync_every=4), "lease_s": 2.0, **overrides}
    )
    model = tiny_model(0, (16, 16, 4), tanh=False)
    return local_syncer(model, config, tape_path=tmp_path / "events.jsonl")


def ticks(tmp_path) -> int:
    return sum(1 for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "tick")


@pytest.mark.timeout(60)
def test_the_clock_keeps_ticking_after_the_wall_clock_steps_back(tmp_path, monkeypatch):
    server = serve(tmp_path)
    alice = Peer(server, "alice")
    beating = threading.Event()
    try:
        alice.join()

        def heartbeats():  # a live learner at 10 steps/s: the clock ticks every 0.1 s
            while not beating.wait(0.2):
                alice.heartbeat(steps_per_s=10.0)

        threading.Thread(target=heartbeats, daemon=True).start()
        wait_until(lambda: ticks(tmp_path) >= 3, 20, "the clock's first ticks")
        step_wall_clock_back(monkeypatch)
        before = ticks(tmp_path)
        wait_until(lambda: ticks(tmp_path) >= before + 5, 20, "ticks after the clock step")
        taped = [r["t"] for r in read_tape(tmp_path / "events.jsonl")][-3:]
        assert all(
            t < _time.time() - STEP_BACK_S + 60 for t in taped
        )  # the tape follows the wall clock
    finally:
        beating.set()
        alice.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_silent_learner_still_loses_its_lease_after_the_wall_clock_steps_back(
    tmp_path, monkeypatch
):
    server = serve(tmp_path)
    alice = Peer(server, "alice")
    try:
        alice.join()
        alice.heartbeat(steps_per_s=10.0)

        def alice_live() -> bool:
            reply = alice.stub.Status(pb.StatusRequest(), timeout=5)
            return any(ls.live for ls in reply.learners if ls.learner_id == "alice")

        assert alice_live()
        step_wall_clock_back(monkeypatch)
        # Alice says nothing more: her 2 s lease runs out, whatever the wall clock says.
        wait_until(lambda: not alice_live(), 20, "alice's lease to run out")
    finally:
        alice.close()
        server.stop()

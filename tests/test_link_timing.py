"""The link's clocks against a real syncer: a learner whose syncer restarts again and again
reconnects at once.

Real gRPC on loopback (an in-process ``SyncerServer``), a real TCP relay to throttle the link.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from diloco.algorithm import balanced_fragments
from diloco.launch.relay import Relay
from diloco.learner.learner import Learner
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer


def make_model(numel: int = 300_000) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(numel // 500, 500, bias=False)


def start_syncer(model: nn.Module, bind: str = "127.0.0.1:0") -> SyncerServer:
    """A syncer of ``model`` in one fragment (the learner starts from the same values)."""
    layout = balanced_fragments(model.named_parameters(), 1)
    named = dict(model.named_parameters())
    config = SyncerConfig(sync_every=4, lease_s=5.0, heartbeat_s=0.2, norm_guard_k=0.0)
    return SyncerServer(layout, [layout.gather(0, named)], config, bind=bind).start()


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(90)
def test_a_learner_reconnects_at_once_after_each_of_several_syncer_restarts():
    """The reconnect backoff starts over once a join succeeded: a learner whose syncer dies
    after a successful rejoin retries within ~0.1 s, not after the backoff grown while the
    syncer was down before (it slept through short syncer lifetimes, away 13 s). The syncer
    dies as a killed process does, its connections cut (a stopped in-process server ends the
    subscription cleanly instead), and a new one starts on the same port."""
    model = make_model(5_000)
    server = start_syncer(model)
    relay = Relay(server.address)
    learner = Learner(model, syncer=relay.address, fragments=1, learner_id="l0")
    delays = []
    try:
        assert learner.wait_for_global(timeout=20)
        connected = learner.link.connected
        for _ in range(4):
            relay.partition(math.inf)  # killed: connections cut, none accepted
            server.stop(grace=0)
            assert wait_until(lambda: not connected.is_set(), 5)
            time.sleep(0.45)  # down: the learner's retries back off (0.1, 0.2, 0.4 s)
            server = start_syncer(model, bind=server.address)
            relay.heal()
            restarted = time.monotonic()
            assert wait_until(connected.is_set, 15)
            delays.append(time.monotonic() - restarted)
        assert max(delays) < 1.0, delays
    finally:
        learner.close(flush=False)
        relay.close()
        server.stop(grace=0)

"""The link's clocks against a real syncer: an upload's deadline follows its size and the
measured link, and a learner whose syncer restarts again and again reconnects at once.

Real gRPC on loopback (an in-process ``SyncerServer``), a real TCP relay to throttle the link.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from kit import local_syncer, wait_until
from torch import nn

from diloco.launch.relay import Relay
from diloco.learner.learner import Learner
from diloco.learner.pacing import UPLOAD_RATE_SHARE, upload_deadline_s
from diloco.syncer.config import SyncerConfig
from diloco.syncer.limits import FIRST_CHUNK_S, MIN_UPLOAD_BPS
from diloco.syncer.server import SyncerServer
from diloco.wire.protocol import ProtocolConfig


def make_model(numel: int = 300_000) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(numel // 500, 500, bias=False)


def start_syncer(model: nn.Module, bind: str = "127.0.0.1:0") -> SyncerServer:
    """A syncer of ``model`` in one fragment (the learner starts from the same values)."""
    config = SyncerConfig(
        protocol=ProtocolConfig(sync_every=4, num_fragments=1),
        lease_s=5.0,
        heartbeat_s=0.2,
        norm_guard_k=0.0,
    )
    return local_syncer(model, config, bind=bind)


def test_the_upload_deadline_follows_the_size_and_the_measured_rate():
    assert upload_deadline_s(1000, None, 30.0) == 30.0  # small: the base deadline
    big = 22_000_000  # a 1B-parameter model's int4 fragment at P = 24
    assert upload_deadline_s(big, None, 30.0) == FIRST_CHUNK_S + big / MIN_UPLOAD_BPS
    rate = 625_000.0  # 5 Mbit/s measured
    assert upload_deadline_s(big, rate, 30.0) == pytest.approx(big / (UPLOAD_RATE_SHARE * rate))
    # never longer than the syncer lets an upload run (it cancels it then)
    assert upload_deadline_s(big, 100.0, 30.0) == FIRST_CHUNK_S + big / MIN_UPLOAD_BPS


@pytest.mark.timeout(90)
def test_an_upload_slower_than_the_base_deadline_is_accepted():
    """A ~160 kB int4 upload on a 64 kB/s link takes ~2.5 s, the base deadline is 1 s: the
    upload's own deadline (its size at the measured rate; before any measure, the syncer's
    deadline for it) lets it finish, first without a measure, then with one."""
    model = make_model()
    server = start_syncer(model)
    relay = Relay(server.address)
    learner = None
    try:
        learner = Learner(
            model,
            syncer=relay.address,
            num_fragments=1,
            learner_id="slow",
            link_options={"rpc_timeout_s": 1.0},
        )
        assert learner.wait_for_global(timeout=20)
        relay.throttle(64_000)
        link = learner.link
        for n in (1, 2):
            with torch.no_grad():
                model.weight.add_(0.01)
            learner.step(tokens=8)
            assert learner._queue(0)
            assert wait_until(
                lambda n=n: link.stats.uploads_sent + link.stats.uploads_failed >= n, 30
            )
            assert (link.stats.uploads_sent, link.stats.uploads_failed) == (n, 0), link.stats
        assert link.meter.rate_Bps < 100_000  # the second upload had a measure: the link's
    finally:
        if learner is not None:
            learner.close(flush=False)
        relay.close()
        server.stop(grace=0)


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
    learner = Learner(model, syncer=relay.address, num_fragments=1, learner_id="l0")
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

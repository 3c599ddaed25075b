"""What one peer may hold of the syncer's streams, over real gRPC on loopback.

A learner's newer subscription replaces its older one at once, also when the older one is
stuck on a dead connection (a preempted VM back elsewhere); calls without a learner's own
token are capped per TCP connection and per remote address, so one peer holding silent
uploads cannot lock the others out (``diloco.syncer.limits``, docs/security.md).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from kit import OWN_CONNECTION, Peer, local_syncer, tiny_model, wait_until

from diloco.launch.relay import Relay
from diloco.syncer.config import SyncerConfig
from diloco.syncer.limits import UPLOADS_PER_CONNECTION
from diloco.syncer.server import SyncerServer
from diloco.wire import auth, keepalive

P = 2
SECRET = "stream-limits-secret-0123456789"


def make_server(tmp_path, width: int = 16, **kwargs) -> SyncerServer:
    model = tiny_model(0, (width, width, 8), tanh=False)
    config = SyncerConfig(up_codec="fp32", schedule="learner", quorum=1)
    return local_syncer(
        model, config, num_fragments=P, tape_path=tmp_path / "events.jsonl", **kwargs
    )


def own_peer(server: SyncerServer, learner_id: str, token: str, address=None) -> Peer:
    """One learner id speaking the wire protocol on a TCP connection of its own."""
    return Peer(server, learner_id, token=token, address=address, options=OWN_CONNECTION)


def streams_of(server: SyncerServer, learner_id: str) -> int:
    """Subscribe handlers of ``learner_id`` still running on the syncer's pool."""
    with server.service.lock:
        return sum(s.learner_id == learner_id for s in server.service._subscribers)


# ------------------------------------------------------------------------ resubscribing
@pytest.mark.timeout(90)
def test_a_learner_resubscribes_while_its_old_stream_hangs_on_a_dead_connection(tmp_path):
    # 2 fragments of 2M values: their keyframes (16 MB) are far more than the HTTP/2
    # windows, so the old stream's handler blocks in a send once its link freezes.
    server = make_server(tmp_path, width=2048, token=SECRET, learner_tokens=True)
    token = auth.learner_token(SECRET, "alice")
    relay = Relay(server.address, name="frozen")
    old = own_peer(server, "alice", token, address=relay.address)
    new = own_peer(server, "alice", token)
    try:
        old.join()
        stream = old.subscribe()
        next(stream)  # the stream is up and sending keyframes
        relay.delay(600, 600)  # then the VM vanishes: not a byte either way, no FIN, no RST
        time.sleep(1.0)
        assert streams_of(server, "alice") == 1
        # The VM is back elsewhere: it joins again and subscribes from a fresh connection.
        new.join()
        t0 = time.monotonic()
        fresh = new.subscribe()
        next(fresh)  # admitted (it was refused RESOURCE_EXHAUSTED: the old stream held the cap)
        assert time.monotonic() - t0 < 5.0
        assert server.service.limits.open("subscribe") == 1
        # The old stream's handler, stuck in a send on the dead connection, is ended.
        wait_until(lambda: streams_of(server, "alice") == 1, 10, "the old stream to end")
        assert server.state.learners["alice"].connected
        fresh.cancel()
    finally:
        relay.close()
        old.close(), new.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_learner_cannot_hold_more_subscriptions_than_its_cap(tmp_path):
    server = make_server(tmp_path, token=SECRET, learner_tokens=True, max_learners=8)
    mallory = own_peer(server, "mallory", auth.learner_token(SECRET, "mallory"))
    try:
        mallory.join()
        streams = []
        for _ in range(12):
            streams.append(mallory.subscribe())
            next(streams[-1])  # each newer one is admitted ...
            assert server.service.limits.open("subscribe") == 1  # ... in the older one's place
        # Every older stream is ended by the syncer; only the newest is served.
        for stream in streams[:-1]:
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code() == grpc.StatusCode.CANCELLED
        wait_until(lambda: streams_of(server, "mallory") == 1, 10, "the older streams to end")
        streams[-1].cancel()
        wait_until(lambda: server.service.limits.open("subscribe") == 0, 10, "the last to end")
    finally:
        mallory.close()
        server.stop()


# ---------------------------------------------------------------- callers without an id
@pytest.mark.timeout(60)
def test_one_connection_of_silent_uploads_cannot_lock_out_the_others(tmp_path):
    server = make_server(tmp_path, token=SECRET)  # the shared token: no learner identity
    server.service.first_chunk_s = 30.0
    mallory = own_peer(server, "mallory", SECRET)
    alice = own_peer(server, "alice", SECRET)
    release = threading.Event()
    try:
        mallory.join()
        calls = mallory.silent_uploads(150, release)  # 64 would fill the syncer's cap
        wait_until(
            lambda: server.service.limits.open("upload") >= UPLOADS_PER_CONNECTION,
            10,
            "the silent uploads to be held",
        )
        time.sleep(0.5)
        assert server.service.limits.open("upload") == UPLOADS_PER_CONNECTION
        alice.join()
        assert alice.upload().accepted  # was RESOURCE_EXHAUSTED: 64 streams open, the cap
        refused = [c for c in calls if c.done() and c.exception() is not None]
        assert len(refused) == 150 - UPLOADS_PER_CONNECTION
        assert {c.exception().code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        release.set()
        mallory.close(), alice.close()
        server.stop()


@pytest.mark.timeout(60)
def test_one_address_of_silent_uploads_cannot_lock_out_the_others(tmp_path):
    server = make_server(tmp_path, token=SECRET)
    server.service.first_chunk_s = 30.0
    address_cap = server.service.limits.per_scope["address"]["upload"]
    assert address_cap < server.service.limits.caps["upload"]
    relay = Relay(server.address, name="other-host", source="127.0.0.2")
    mallory = [own_peer(server, "mallory", SECRET, address=relay.address) for _ in range(20)]
    neighbours = [own_peer(server, f"neighbour-{i}", SECRET) for i in range(3)]
    release = threading.Event()
    try:
        mallory[0].join()
        calls = []  # 20 connections from 127.0.0.2, as many silent uploads as each may hold
        for m in mallory:
            m.session = mallory[0].session
            calls += m.silent_uploads(UPLOADS_PER_CONNECTION, release)
        wait_until(
            lambda: server.service.limits.open("upload") >= address_cap,
            10,
            "the silent uploads to be held",
        )
        time.sleep(0.5)
        assert server.service.limits.open("upload") == address_cap
        # Learners on another host (here 127.0.0.1, several of them) are served.
        for peer in neighbours:
            peer.join()
            assert peer.upload().accepted  # was RESOURCE_EXHAUSTED: 64 streams open, the cap
        assert sum(c.done() for c in calls) == len(calls) - address_cap
    finally:
        release.set()
        for c in (*mallory, *neighbours):
            c.close()
        relay.close()
        server.stop()


# ---------------------------------------------------------------------------- keepalive
def test_the_keepalive_pings_of_a_learner_are_welcome_at_the_syncer():
    client, server = dict(keepalive.client_options()), dict(keepalive.server_options())
    interval = client["grpc.keepalive_time_ms"]
    # The server accepts pings at the client's pace (else it answers GOAWAY too_many_pings).
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < interval
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert (
        server["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    )
    # A dead peer is found within a minute, far sooner than TCP's ~15 min (gRPC waits for a
    # keepalive ping's answer as long as for any ping's: the ping timeout).
    for options in (client, server):
        wait = max(options["grpc.keepalive_timeout_ms"], options["grpc.http2.ping_timeout_ms"])
        assert options["grpc.keepalive_time_ms"] + wait <= 60_000

"""The partition relay: forwards bytes, cuts connections, refuses while partitioned, heals."""

import math
import socket
import threading
import time

import pytest

from diloco.launch.relay import Relay


@pytest.fixture
def echo_server():
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()
    thread.join(2)


def connect(address):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def roundtrip(sock, payload=b"x" * 3_000_000):
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    return got == payload


def test_relay_forwards_partitions_and_heals(echo_server):
    relay = Relay(echo_server)
    try:
        a = connect(relay.address)
        assert roundtrip(a)
        relay.partition(math.inf)  # until heal()
        assert a.recv(10) == b""  # the open connection is cut
        b = connect(relay.address)  # the port still accepts, then drops the connection
        assert b.recv(10) == b""
        relay.heal()
        c = connect(relay.address)
        assert roundtrip(c)
        relay.partition(0.3)
        time.sleep(0.4)  # partitions end by themselves
        d = connect(relay.address)
        assert roundtrip(d, b"hello")
    finally:
        relay.close()


def timed_roundtrip(sock, payload=b"ping"):
    t0 = time.monotonic()
    assert roundtrip(sock, payload)
    return time.monotonic() - t0


def test_relay_delay_adds_latency_both_ways_and_ends(echo_server):
    relay = Relay(echo_server)
    try:
        a = connect(relay.address)
        assert timed_roundtrip(a) < 0.1
        relay.delay(1.0, 0.2)
        assert timed_roundtrip(a) >= 0.4  # 0.2 s on the way in and 0.2 s on the way back
        assert roundtrip(a)  # large payloads still arrive intact and in order
        time.sleep(1.0)  # delays end by themselves
        assert timed_roundtrip(a) < 0.1
        relay.delay(30, 0.2)
        relay.heal()
        assert timed_roundtrip(a) < 0.1
        with pytest.raises(ValueError):
            relay.delay(1, -0.1)
    finally:
        relay.close()


def test_relay_drop_cuts_open_connections_but_accepts_new_ones(echo_server):
    relay = Relay(echo_server)
    try:
        a = connect(relay.address)
        assert roundtrip(a)
        relay.drop()
        assert a.recv(10) == b""
        b = connect(relay.address)
        assert roundtrip(b)
    finally:
        relay.close()


def test_a_throttled_relay_is_one_link_its_connections_share(echo_server):
    relay = Relay(echo_server)
    try:
        relay.throttle(100_000)  # bytes/s each way
        a, b = connect(relay.address), connect(relay.address)
        block = b"y" * 20_000
        t0 = time.monotonic()
        assert roundtrip(a, block)  # 0.2 s up, 0.2 s down: even a lone block takes its time
        alone = time.monotonic() - t0
        t0 = time.monotonic()
        both = [threading.Thread(target=roundtrip, args=(s, block)) for s in (a, b)]
        for t in both:
            t.start()
        for t in both:
            t.join(10)
        shared = time.monotonic() - t0
        relay.throttle(0)
        t0 = time.monotonic()
        assert roundtrip(a, block)
        free = time.monotonic() - t0
    finally:
        relay.close()
    assert 0.38 <= alone < 1.0, alone
    # two connections share it: b's block waits for a's on each way (0.6 s; 0.4 s if each
    # connection had a link of its own)
    assert 0.55 <= shared < 2.0, shared
    assert free < 0.2, free


def test_lost_replies_are_told_by_the_grpc_method_not_the_size(tmp_path):
    """Issue 46: the relay told an upload from other calls by its request's size (512 bytes
    or more), so the default exchange's sign1 uploads of a small fragment never had their
    reply lost. It now reads the call's method from the HTTP/2 headers: every answer to an
    upload (here of 36 bytes) is lost, no heartbeat's or join's answer is, and the syncer
    handled each upload whose answer was lost."""
    import grpc
    import torch
    from kit import Peer, local_syncer, tiny_model

    from diloco.syncer.config import SyncerConfig

    config = SyncerConfig(up_codec="fp32", schedule="learner", norm_guard_k=0.0)
    server = local_syncer(tiny_model(0, (2, 4, 1), tanh=False), config, num_fragments=2)
    relay = Relay(server.address)
    relay.lose_replies(1.0)
    peer = Peer(server, "a")
    peer.channel.close()
    peer.channel = grpc.insecure_channel(relay.address)
    from diloco.wire import diloco_pb2_grpc as pb_grpc

    peer.stub = pb_grpc.SyncerStub(peer.channel)
    try:
        peer.join()
        assert peer.heartbeat()
        n = server.layout.fragments[0].numel
        with pytest.raises(grpc.RpcError):
            peer.upload(0, 1e-3 * torch.ones(n))
        assert n * 4 < 512 and relay.replies_lost == 1
        from kit import wait_until

        wait_until(lambda: server.state.versions[0] == 1, 60, "the upload's commit")

        def heartbeat_answered() -> bool:
            try:
                return peer.heartbeat()
            except grpc.RpcError as err:  # (the first call may meet the connection the
                if err.code() != grpc.StatusCode.UNAVAILABLE:  # relay cut: "Stream removed")
                    raise
                return False

        wait_until(heartbeat_answered, 30, "a heartbeat answered on a new connection")
        assert relay.replies_lost == 1  # (no heartbeat's answer was lost)
    finally:
        peer.close()
        relay.close()
        server.stop()


def test_flow_control_on_an_upload_stream_is_not_its_answer():
    """The server's WINDOW_UPDATE on an upload's stream (sent while the request still
    arrives) was taken for the upload's answer: the relay cut the connection mid-request and
    the syncer refused the upload as cancelled (a flaky ``lose_replies`` test)."""
    import hpack

    from diloco.launch.grpc_calls import PREFACE, UPLOAD, CallWatch

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return (
            len(payload).to_bytes(3, "big")
            + bytes([kind, flags])
            + stream.to_bytes(4, "big")
            + payload
        )

    watch = CallWatch()
    block = hpack.Encoder().encode([(":method", "POST"), (":path", UPLOAD)])
    watch.client_sent(PREFACE + frame(0x1, 0x4, 1, block))
    assert watch.first_answers(frame(0x8, 0, 1, (1024).to_bytes(4, "big"))) == set()
    assert watch.first_answers(
        frame(0x1, 0x4, 1, hpack.Encoder().encode([(":status", "200")]))
    ) == {1}

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

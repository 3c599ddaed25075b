"""Measure a link of a :class:`diloco.wan.fabric.Fabric`: its rate and its round trip, with real
TCP between real processes in the namespaces (what the tests and ``benchmarks/bench_wan.py``
use to check that a shaped link holds what it was told).

:func:`measure_rate` streams bytes from one end to the other for a few seconds and returns
the receiver's goodput in bits per second (TCP payload; the link's rate counts Ethernet
frames, so the payload rate is about 3% lower at a 1500-byte MTU). :func:`measure_rtt` times
small TCP echoes and returns the median round trip.
"""

from __future__ import annotations

import subprocess
import sys

_SINK = """
import socket, sys, time
srv = socket.create_server(("0.0.0.0", 0)); print(srv.getsockname()[1], flush=True)
srv.settimeout(30); conn, _ = srv.accept(); conn.settimeout(30)
mode = conn.recv(1)
if mode == b"e":
    while (b := conn.recv(64)):
        conn.sendall(b)
else:
    total, first, last = 0, None, None
    while (b := conn.recv(1 << 20)):
        now = time.monotonic(); first = first or now; last = now; total += len(b)
    print(total, (last or 0) - (first or 0), flush=True)
"""

_SOURCE = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=30); s.sendall(b"s")
block = b"x" * (1 << 16); end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(block)
s.close()
"""


def _start_sink(prefix: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError("the probe's sink did not start")
    return proc, int(line)


def measure_rate(fabric, i: int, *, up: bool = True, seconds: float = 3.0) -> float:
    """Goodput of learner ``i``'s link in bits/s: ``up`` from the learner to the hub, else
    down. The first half second (TCP's slow start, the bucket's burst) is included."""
    sink_at, source_at = (
        (fabric.hub_prefix(), fabric.exec_prefix(i))
        if up
        else (fabric.exec_prefix(i), fabric.hub_prefix())
    )
    host = fabric.hub_address(i) if up else fabric.learner_address(i)
    sink, port = _start_sink(sink_at)
    try:
        subprocess.run(
            [*source_at, sys.executable, "-c", _SOURCE, host, str(port), str(seconds)],
            timeout=seconds + 60,
            check=True,
        )
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    total, span = out.split()
    return int(total) * 8 / max(float(span), 1e-9)


_ECHO_CLIENT = """
import socket, statistics, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=30)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); s.sendall(b"e")
times = []
for _ in range(count):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); times.append(time.perf_counter() - t)
print(statistics.median(times[1:]))
"""


def measure_rtt(fabric, i: int, *, count: int = 11) -> float:
    """Median round trip (s) of ``count`` one-byte TCP echoes between learner ``i`` and the hub."""
    sink, port = _start_sink(fabric.hub_prefix())
    try:
        done = subprocess.run(
            [
                *fabric.exec_prefix(i),
                sys.executable,
                "-c",
                _ECHO_CLIENT,
                fabric.hub_address(i),
                str(port),
                str(count),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        sink.kill()
        sink.wait()
    return float(done.stdout.strip())

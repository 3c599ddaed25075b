"""The delay line of a wide-area link: a user-space wire between two interfaces.

This kernel has no ``netem``, so a link's round trip is added here. The bridge reads every
frame that arrives on interface A (raw ``AF_PACKET`` socket) and writes it to interface B
``delay`` seconds later, and the same from B to A; frames keep their order and are never
dropped or changed. Each frame carries its ``virtio_net_hdr`` (``PACKET_VNET_HDR``), so TCP
segmentation offload and checksum offload pass through intact (a 64 KiB TCP super-frame is
one frame here, which keeps a Python loop far from its packet-rate limit). The rate is not
set here: the kernel's ``tbf`` shapes each link on the way in (see :mod:`diloco.wan.fabric`).

``python -m diloco.cli.wan_bridge A B --delay-ms D`` runs one until SIGTERM, or its parent exits.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import threading
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
FRAME_BYTES = 1 << 18
"""Receive buffer per frame: a GSO super-frame is at most 64 KiB plus headers."""
SOCKET_BUFFER = 16 << 20


def open_port(ifname: str) -> socket.socket:
    """A raw socket on ``ifname`` that reads and writes whole frames with their vnet header."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    for opt in (33, 32):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE (root: beyond rmem_max)
        s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    s.bind((ifname, 0))
    s.settimeout(0.2)
    return s


class DelayLine:
    """One direction: frames received on ``src`` are sent on ``dst`` ``delay`` s later."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float, stop) -> None:
        self.src, self.dst, self.delay, self.stop = src, dst, delay, stop
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.frames = self.bytes = 0

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._receive, daemon=True),
            threading.Thread(target=self._send, daemon=True),
        ]
        for t in threads:
            t.start()
        return threads

    def _receive(self) -> None:
        while not self.stop.is_set():
            try:
                frame, address = self.src.recvfrom(FRAME_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return
            if address[2] == PACKET_OUTGOING:  # what we (or the stack) sent on this port
                continue
            with self.ready:
                self.queue.append((time.monotonic() + self.delay, frame))
                self.ready.notify()

    def _send(self) -> None:
        while not self.stop.is_set():
            with self.ready:
                if not self.queue:
                    self.ready.wait(0.2)
                    continue
                due, frame = self.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self.ready:
                self.queue.popleft()
            try:
                self.dst.send(frame)
            except OSError:  # the link is being torn down
                if self.stop.is_set():
                    return
            self.frames += 1
            self.bytes += len(frame)


def run_bridge(a: str, b: str, delay_s: float) -> int:
    """Bridge interfaces ``a`` and ``b`` with ``delay_s`` each way until SIGTERM or the
    parent exits; prints ``ready`` once both ports are open."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    port_a, port_b = open_port(a), open_port(b)
    for line in (
        DelayLine(port_a, port_b, delay_s, stop),
        DelayLine(port_b, port_a, delay_s, stop),
    ):
        line.start()
    parent = os.getppid()
    print("ready", flush=True)
    while not stop.wait(0.5):
        if os.getppid() != parent:
            stop.set()
    return 0

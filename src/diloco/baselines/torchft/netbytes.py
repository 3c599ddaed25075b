"""Bytes a process has put on (and taken off) the network, read from the kernel's TCP counters.

A peer we do not control (torchft: gloo in C++, its manager and lighthouse clients in Rust)
cannot be instrumented at its transport from Python, but every TCP socket of a process is a
file descriptor of that process, and Linux keeps per-socket counters (``TCP_INFO``:
``tcpi_bytes_acked`` = payload bytes sent and acknowledged by the peer, ``tcpi_bytes_received``
= payload bytes received). :class:`SocketBytes` samples them for every TCP socket of the
calling process and remembers the last value seen per socket (by inode), so a socket that
closes keeps what it had at the last sample.

Caveats (documented, measured rather than modelled): bytes a socket moved between its last
sample and its close are missed (sample after every sync to keep that small); the SYN counts
as one acknowledged byte per connection; UDP and Unix sockets are not counted. Linux only
(elsewhere :meth:`SocketBytes.sample` returns zeros).
"""

from __future__ import annotations

import os
import socket
import struct

# Offsets in ``struct tcp_info`` (linux/tcp.h): tcpi_bytes_acked, tcpi_bytes_received (u64).
_ACKED_OFFSET = 120
_INFO_LEN = 136


def _tcp_counters(fd: int) -> tuple[int, int] | None:
    """``(sent, received)`` payload bytes of TCP socket ``fd``, or None if it is not one."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    finally:
        sock.close()  # closes our duplicate only
    if len(info) < _INFO_LEN:
        return None
    return struct.unpack_from("QQ", info, _ACKED_OFFSET)


class SocketBytes:
    """Running totals of TCP payload bytes sent and received by this process.

    Contract: :meth:`sample` is cheap (one ``getsockopt`` per open socket), never raises, and
    returns monotonically non-decreasing ``(sent, received)`` totals over every TCP socket this
    process has had open at some sample.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}

    def sample(self) -> tuple[int, int]:
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            fds = []
        for name in fds:
            try:
                fd = int(name)
                target = os.readlink(f"/proc/self/fd/{fd}")
            except (OSError, ValueError):
                continue
            if not target.startswith("socket:"):
                continue
            counters = _tcp_counters(fd)
            if counters is None:
                continue
            old = self._last.get(target, (0, 0))
            self._last[target] = (max(old[0], counters[0]), max(old[1], counters[1]))
        sent = sum(v[0] for v in self._last.values())
        received = sum(v[1] for v in self._last.values())
        return sent, received

"""A TCP relay between one learner and the syncer, used to cut that learner's network.

With ``partition`` chaos, the supervisor points each learner at its own relay instead of at the
syncer. ``partition(seconds)`` closes every open connection and refuses new ones until the time
is up; the learner sees a real broken network (its gRPC channel fails and reconnects with
backoff) while its process keeps running and training. Bytes are copied unchanged.
"""

from __future__ import annotations

import socket
import threading
import time


class Relay:
    """Listens on ``127.0.0.1:0`` and forwards every connection to ``target`` (``host:port``)."""

    def __init__(self, target: str, *, name: str = "relay") -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.name = name
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._blocked_until = 0.0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._blocked_until

    def partition(self, seconds: float) -> None:
        """Cut every connection now and refuse new ones for ``seconds``."""
        self._blocked_until = time.monotonic() + seconds
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _close(c)

    def heal(self) -> None:
        self._blocked_until = 0.0

    def close(self) -> None:
        self._closing.set()
        self.partition(0)
        _close(self._listener)
        self._thread.join(timeout=2)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.partitioned:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                _close(client)  # syncer down: the learner sees a refused connection
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass

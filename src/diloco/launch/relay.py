"""A TCP relay between one learner and the syncer, used to break that learner's network.

With network chaos (``partition``, ``drop``, ``delay``) the supervisor points each learner at its
own relay instead of at the syncer. The learner sees a real network fault while its process
keeps running and training; bytes are always copied unchanged:

- ``partition(seconds)`` closes every open connection and refuses new ones until the time is
  up or ``heal()`` (its gRPC channel fails and reconnects with backoff; ``math.inf``: until
  ``heal()``, as the supervisor does, so that its heal record precedes the healed link);
- ``drop()`` closes every open connection once: whatever messages were in flight (a fragment
  upload, a broadcast) are lost, and the learner may reconnect at once;
- ``delay(seconds, latency)`` holds every byte for ``latency`` seconds in both directions
  until the time is up (one-way latency, without a bandwidth cap);
- ``throttle(bytes_per_s)`` makes the relay a link of that rate each way (0: off), shared by
  all its connections as a real link is: each block is delivered once the link has carried it
  and everything queued on that direction before it;
- ``lose_replies(probability)``: the answer to an upload (told by its gRPC method,
  ``diloco.launch.grpc_calls``, whatever its size or codec) is lost with that probability,
  and the connection cut: the syncer handled the upload, the learner never hears its answer.
"""

from __future__ import annotations

import queue
import random
import socket
import threading
import time

from diloco.launch.grpc_calls import CallWatch


class Relay:
    """Listens on ``127.0.0.1:0`` and forwards every connection to ``target`` (``host:port``),
    from the local address ``source`` when given (e.g. ``127.0.0.2``: the target then sees
    the relayed connections come from another host)."""

    def __init__(self, target: str, *, name: str = "relay", source: str | None = None) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.source = (source, 0) if source else None
        self.name = name
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._blocked_until = 0.0
        self._delayed_until = 0.0
        self._latency = 0.0
        self._rate = 0.0
        self._free_at = {"up": 0.0, "down": 0.0}
        """When each direction of the throttled link has carried everything queued on it."""
        self._loss = 0.0
        self._random = random.Random(0)
        self.replies_lost = 0
        """Replies ``lose_replies`` threw away."""
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._blocked_until

    @property
    def connections(self) -> int:
        """Connections open through the relay now."""
        with self._lock:
            return len(self._conns) // 2  # each one holds its client and its upstream socket

    def latency(self) -> float:
        """The one-way latency added to bytes read now (0 outside a delay)."""
        return self._latency if time.monotonic() < self._delayed_until else 0.0

    def partition(self, seconds: float) -> None:
        """Cut every connection now and refuse new ones for ``seconds``."""
        self._blocked_until = time.monotonic() + seconds
        self.drop()

    def drop(self) -> None:
        """Cut every open connection now (messages in flight are lost); new ones are accepted."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _close(c)

    def delay(self, seconds: float, latency: float) -> None:
        """Add ``latency`` seconds to every byte, both ways, for the next ``seconds``."""
        if latency < 0:
            raise ValueError("latency must be >= 0")
        self._latency = latency
        self._delayed_until = time.monotonic() + seconds

    def throttle(self, bytes_per_s: float) -> None:
        """Carry ``bytes_per_s`` each way, over all connections together (0 lifts the cap)."""
        if bytes_per_s < 0:
            raise ValueError("bytes_per_s must be >= 0")
        self._rate = float(bytes_per_s)

    def lose_replies(self, probability: float, seed: int = 0) -> None:
        """Lose the reply to a large request with ``probability`` (0: never), seeded."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError("probability must be in [0, 1]")
        self._loss, self._random = probability, random.Random(seed)

    def heal(self) -> None:
        """End a partition or a delay now."""
        self._blocked_until = 0.0
        self._delayed_until = 0.0

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
                upstream = socket.create_connection(
                    self.target, timeout=2, source_address=self.source
                )
            except OSError:
                _close(client)  # syncer down: the learner sees a refused connection
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            calls = CallWatch()  # which streams carry uploads (``lose_replies``)
            for a, b, way in ((client, upstream, "up"), (upstream, client, "down")):
                pipe: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._read, args=(a, b, pipe), daemon=True).start()
                threading.Thread(
                    target=self._write, args=(a, b, pipe, way, calls), daemon=True
                ).start()

    def _read(self, src: socket.socket, dst: socket.socket, pipe: queue.SimpleQueue) -> None:
        """Reads ``src`` and queues each block with the time it may be written; None at the end
        (the writer closes both sockets once it has written everything before it)."""
        try:
            while data := src.recv(1 << 20):
                pipe.put((time.monotonic() + self.latency(), data))
        except OSError:
            pass
        finally:
            pipe.put(None)

    def _write(
        self,
        src: socket.socket,
        dst: socket.socket,
        pipe: queue.SimpleQueue,
        way: str,
        calls: CallWatch,
    ) -> None:
        """Writes queued blocks to ``dst`` in order, each no earlier than its due time (and,
        throttled, than the link has carried it); ``calls`` follows the connection's uploads
        (``lose_replies``)."""
        try:
            while (item := pipe.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                if (wait := self._carried(way, len(data)) - time.monotonic()) > 0:
                    time.sleep(wait)
                if way == "up":
                    calls.client_sent(data)
                elif self._lose(len(calls.first_answers(data))):
                    return  # (the finally cuts the connection: the reply is lost)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._forget(src, dst)

    def _lose(self, answers: int) -> bool:
        """Whether the block the syncer sends now is lost: it starts ``answers`` answers to
        uploads, each lost with the ``lose_replies`` probability."""
        if not answers or self._loss <= 0.0:
            return False
        with self._lock:
            lost = any(self._random.random() < self._loss for _ in range(answers))
            self.replies_lost += answers if lost else 0
        return lost

    def _carried(self, way: str, nbytes: int) -> float:
        """When the throttled link has carried ``nbytes`` more on ``way`` (now: no throttle)."""
        rate = self._rate
        with self._lock:
            now = time.monotonic()
            if rate <= 0:
                return now
            self._free_at[way] = max(now, self._free_at[way]) + nbytes / rate
            return self._free_at[way]

    def _forget(self, src: socket.socket, dst: socket.socket) -> None:
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

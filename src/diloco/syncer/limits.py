"""What one caller may hold of the syncer's threads: stream limits and stream deadlines.

Every ``Upload`` and ``Subscribe`` stream holds one of the gRPC pool's threads for as long
as it lasts. Without limits a token holder could open enough of them (or streams that never
send their first chunk) to fill the pool, and honest ``Join`` calls would wait forever. The
syncer therefore

* caps the streams open at once, per kind, overall and per caller (:class:`StreamLimits`): a
  call over a cap is refused at once with ``RESOURCE_EXHAUSTED`` and holds no thread, and the
  pool is sized so that the caps leave room for the short calls (join, heartbeat, status);
* cancels an upload whose first chunk has not arrived within ``FIRST_CHUNK_S``, or that is
  still arriving when its size at ``MIN_UPLOAD_BPS`` would have been done
  (:class:`Watchdog`, one thread for all deadlines).

A caller is its learner id when it presented its own token (``diloco.wire.auth``), else its
network address: without learner tokens, learners that share an address (``diloco run`` on
one machine) share that address's allowance, which is then the overall cap.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

FIRST_CHUNK_S = 20.0
"""An upload whose first chunk has not arrived after this many seconds is cancelled."""
MIN_UPLOAD_BPS = 16_000.0
"""An upload may take ``FIRST_CHUNK_S`` plus its size at this rate (bytes/s, 128 kbit/s)."""
UPLOADS_PER_LEARNER = 4
"""Uploads one learner (identified by its own token) may have open at once."""
SUBSCRIPTIONS_PER_LEARNER = 1
"""Subscribe streams one learner may have open at once (a newer one replaces the older)."""
SHORT_CALL_THREADS = 16
"""Pool threads kept for the short calls beyond the stream caps."""


class LimitExceeded(Exception):
    """A stream over its cap; the message says which."""


class StreamLimits:
    """Counts open streams per kind, overall and per caller, under its own lock."""

    def __init__(self, caps: dict[str, int], per_caller: dict[str, int]) -> None:
        """``caps``: streams of each kind open at once overall; ``per_caller``: per caller
        that is a learner (an address is only held to the overall cap)."""
        self.caps, self.per_caller = dict(caps), dict(per_caller)
        self._open: Counter[tuple[str, str]] = Counter()
        self._total: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, kind: str, caller: str, *, learner: bool):
        """Hold one ``kind`` stream for ``caller`` while the block runs; raises
        ``LimitExceeded`` (nothing held) when a cap is reached."""
        with self._lock:
            if self._total[kind] >= self.caps[kind]:
                raise LimitExceeded(
                    f"the syncer has {self._total[kind]} {kind} streams open, its cap"
                )
            mine = self.per_caller.get(kind, 0)
            if learner and mine and self._open[(kind, caller)] >= mine:
                raise LimitExceeded(
                    f"learner {caller!r} already has {mine} {kind} stream(s) open, its cap"
                )
            self._total[kind] += 1
            self._open[(kind, caller)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._total[kind] -= 1
                self._open[(kind, caller)] -= 1
                if not self._open[(kind, caller)]:
                    del self._open[(kind, caller)]

    def open(self, kind: str) -> int:
        with self._lock:
            return self._total[kind]


class Watchdog:
    """Runs an action at a deadline unless the deadline is disarmed first (one thread)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._actions: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stream-watchdog", daemon=True)
        self._thread.start()

    def arm(self, deadline: float, action: Callable[[], None]) -> int:
        """Run ``action`` at ``deadline`` (``time.monotonic()`` seconds); returns a handle."""
        with self._cond:
            handle = next(self._ids)
            self._actions[handle] = action
            heapq.heappush(self._heap, (deadline, handle))
            self._cond.notify()
            return handle

    def disarm(self, handle: int) -> None:
        with self._cond:
            self._actions.pop(handle, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, handle = heapq.heappop(self._heap)
                action = self._actions.pop(handle, None)
            if action is not None:
                action()

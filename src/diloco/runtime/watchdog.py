"""Run an action at a deadline unless it is disarmed first: one thread for many deadlines
(upload deadlines of the syncer, a commit's deadline, the dashboard's connection deadline)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


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

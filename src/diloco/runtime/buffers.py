"""Large float32 buffers kept for reuse, each handed out again once nothing refers to it.

A new buffer of a fragment's size costs more than its allocation: the kernel zeroes each of
its pages when it is first written. At 1B parameters (P = 24, 42M values, 168 MB a fragment)
that zeroing was 36% of the syncer's CPU (``perf``), six fresh buffers per commit, on the one
thread whose chain of passes sets the commit rate. A :class:`BufferPool` keeps up to ``keep``
buffers and gives one out again only when nothing outside the pool refers to it: CPython
counts the references to a numpy array, and every tensor or view made from one (``tensor``:
``torch.from_numpy``) holds one, until the last of them is gone. So a buffer still held
anywhere (a keyframe being sent, a snapshot being written) is never handed out twice, without
anyone giving it back by hand.

Cost: the idle buffers the pool keeps between uses (at most ``keep`` of the largest size
asked for), in exchange for no zeroing and no page faults when they are used again.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

_HELD_ONLY_BY_THE_POOL = 2
"""``sys.getrefcount`` of an idle pool buffer: the pool's list and the call's argument
(CPython's count; ``tests/test_buffers.py`` fails if an interpreter counts otherwise)."""


class BufferPool:
    """Up to ``keep`` float32 buffers for reuse (see the module docstring); thread-safe."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0
        """How many times a kept buffer was handed out again (for tests and benchmarks)."""

    def array(self, count: int) -> np.ndarray:
        """A float32 array of ``count`` values, uninitialised: a kept buffer nothing refers
        to, or a new one (kept while fewer than ``keep`` are)."""
        with self._lock:
            for i in range(len(self._buffers)):
                if (
                    self._buffers[i].size >= count
                    and sys.getrefcount(self._buffers[i]) == _HELD_ONLY_BY_THE_POOL
                ):
                    self.reused += 1
                    return self._buffers[i][:count]
            fresh = np.empty(count, dtype=np.float32)
            if len(self._buffers) < self.keep:
                self._buffers.append(fresh)
            elif self._buffers:  # full: let a smaller idle one go for this larger one
                idle = [
                    i
                    for i in range(len(self._buffers))
                    if sys.getrefcount(self._buffers[i]) == _HELD_ONLY_BY_THE_POOL
                ]
                if idle:
                    smallest = min(idle, key=lambda i: self._buffers[i].size)
                    if self._buffers[smallest].size < count:
                        self._buffers[smallest] = fresh
            return fresh[:count]

    def tensor(self, count: int) -> torch.Tensor:
        """``array(count)`` as a 1-d float32 tensor sharing its memory."""
        return torch.from_numpy(self.array(count))

    def kept_bytes(self) -> int:
        """The bytes of the buffers the pool keeps (in use or idle)."""
        with self._lock:
            return sum(b.nbytes for b in self._buffers)

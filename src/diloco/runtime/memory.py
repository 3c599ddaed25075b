"""Large buffers go back to the operating system when they are freed.

glibc's allocator serves a request above its mmap threshold with a mapping of its own, which
``free`` unmaps; but it raises that threshold to the size of every such block freed (up to
32 MB), so from the second commit on a syncer's fragment-sized temporaries (a merged delta, a
decoded upload, a wire image: 8 MB each at 50M parameters and P = 24) come from its heaps, one
per thread, where freed blocks stay resident. A process that holds a few large tensors for
long and makes many short-lived ones (the syncer) then grows by several bytes per parameter.
``release_large_frees`` fixes the threshold, which turns that adjustment off: every block of
``LARGE_BLOCK_BYTES`` or more is mapped, and unmapped when freed (a learner limits its
arenas instead: ``diloco.learner.memory``).
"""

from __future__ import annotations

import ctypes
import sys

LARGE_BLOCK_BYTES = 4 << 20
"""Blocks of this size or more are mapped on their own and returned when freed: four times
a commit's chunk (``diloco.algorithm.streaming.CHUNK_VALUES``), whose temporaries stay in
the heap and are reused, with no page faults."""
_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (malloc.h)."""


def release_large_frees(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Have the C allocator map every block of ``threshold`` bytes or more on its own (and
    unmap it when freed). Returns whether it could (glibc on Linux); elsewhere it does
    nothing and returns False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))

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
import os
import sys

LARGE_BLOCK_BYTES = 4 << 20
"""Blocks of this size or more are mapped on their own and returned when freed: four times
a commit's chunk (``diloco.algorithm.streaming.CHUNK_VALUES``), whose temporaries stay in
the heap and are reused, with no page faults."""
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for backing its CPU tensors of 2 MB or more with transparent huge pages."""
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


def huge_pages_for_large_tensors() -> bool:
    """Have torch back its CPU tensors of 2 MB or more with transparent huge pages
    (``HUGE_PAGES_ENV``: torch aligns them to 2 MB and advises the kernel to use huge
    pages; on a kernel whose huge-page mode is ``madvise``, as on the reference machine,
    they are 4 KB pages otherwise). The first write of a fresh fragment-sized buffer then
    costs one page fault per 2 MB instead of one per 4 KB: filling a new 42M-value tensor
    (a fragment of a 1B-parameter model at P = 24) took 58 ms with 4 KB pages and 9 ms with
    huge pages there (median of 5, one thread), and a commit makes several such buffers.
    Takes effect when called before torch's first tensor of 2 MB or more (torch reads the
    variable once); an operator's own setting of the variable wins. Returns whether huge
    pages are asked for."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    return os.environ[HUGE_PAGES_ENV] == "1"


def tune_for_large_tensors() -> None:
    """The syncer process's allocation settings: large blocks go back when freed
    (``release_large_frees``) and are backed by huge pages (``huge_pages_for_large_tensors``).
    Call it before the process makes its first large tensor."""
    release_large_frees()
    huge_pages_for_large_tensors()

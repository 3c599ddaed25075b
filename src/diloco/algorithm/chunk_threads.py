"""A commit's passes over a fragment, split over a few threads, with the same bits.

A commit at 1B parameters passes over 42M-value fragments several times: the merge's norms
and sums, the outer step, the down step's encoding. On one thread they run at one core's
speed while the syncer's process has other cores. Here the chunks of a pass are cut into
as many contiguous groups as there are threads; the calling thread runs the first group,
the pool's threads the others. torch and numpy let go of the interpreter lock inside these
operations, so the groups run at once.

**The same bits.** A chunk's operations are elementwise (or a quantisation of blocks the
chunk holds whole), so a value is computed the same way whichever thread computes it; a
reduction over a whole tensor (a norm) is one call, never split (``map_whole`` runs several
such calls side by side, each whole). The results therefore do not depend on the thread
count: a syncer restarted with another ``--commit-threads`` replays its journal to the same
digests. (torch's own intra-op threads would split reductions: their bits change with the
count.)

The thread count is the process's (``set_threads``, as ``torch.set_num_threads``): the
syncer sets it once at its start (``ServiceConfig.commit_threads``); 1 runs everything in
the caller's thread. A function given to ``for_each_chunk`` or ``map_whole`` must not call
them itself (the pool's threads never wait on the pool).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_threads = 1
_pool: ThreadPoolExecutor | None = None


def set_threads(n: int) -> None:
    """Split each pass over ``n`` threads from now on (the caller's and ``n − 1`` more). A
    pass already running keeps the pool it started with (its threads end once it is let
    go), so it is never cut short."""
    global _threads, _pool
    if int(n) != n or n < 1:
        raise ValueError(f"commit threads must be a whole number >= 1, got {n!r}")
    with _lock:
        _pool, _threads = None, int(n)


def threads() -> int:
    """The thread count passes are split over (``set_threads``; 1 by default)."""
    return _threads


def _threads_and_pool() -> tuple[int, ThreadPoolExecutor | None]:
    """The thread count and its pool (None for 1), read together: a ``set_threads`` at the
    same time changes both for the next pass, never in the middle of one."""
    global _pool
    with _lock:
        if _threads > 1 and _pool is None:
            _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="commit-pass")
        return _threads, _pool


def _in_groups(items: Sequence[T], run: Callable[[Sequence[T]], None]) -> None:
    """``run`` on contiguous groups of ``items``, one group per thread (the caller's the
    first), returning when all have. A group stops at its first failure; once every group
    has ended, the failure of the earliest group that failed is raised: the failure of the
    first failing item, as on one thread, whatever the count."""
    count, pool = _threads_and_pool()
    count = min(count, len(items))
    if count <= 1 or pool is None:
        run(items)
        return
    size = -(-len(items) // count)
    groups = [items[i : i + size] for i in range(0, len(items), size)]
    futures: list[Future] = []
    try:
        for group in groups[1:]:
            futures.append(pool.submit(run, group))
        run(groups[0])
    except BaseException:
        wait(futures)  # (they write the caller's tensors: never left running)
        raise
    wait(futures)
    for f in futures:
        f.result()


def for_each_chunk(n: int, chunk: int, fn: Callable[[int, int], None]) -> None:
    """Call ``fn(a, b)`` once for every chunk ``[a, b)`` of ``range(n)`` (``chunk`` values
    each, the last one shorter), the chunks in contiguous groups, one per thread. ``fn``
    may touch only its own chunk of what it writes. Returns when every call has; raises the
    first failing chunk's exception (as on one thread) after every group has ended."""

    def run(group: Sequence[tuple[int, int]]) -> None:
        for a, b in group:
            fn(a, b)

    _in_groups([(a, min(n, a + chunk)) for a in range(0, n, chunk)], run)


def map_whole(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, the calls in contiguous groups side by side on the
    threads (each call whole, e.g. one tensor's norm); the results in the order of
    ``items``."""
    results: list = [None] * len(items)

    def run(group: Sequence[int]) -> None:
        for i in group:
            results[i] = fn(items[i])

    _in_groups(range(len(items)), run)
    return results

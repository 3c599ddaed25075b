"""How many malloc arenas a learner's process uses (glibc), when its user asks.

Every step a learner makes and frees fragment-sized buffers on several threads: the delta it
sends (training thread), its encoding and the decoded residual (the sender thread), the
merged values that arrive (the link's thread). glibc gives each thread that contends for the
allocator an arena of its own and keeps the buffers freed in it for reuse, so each thread's
working set of such buffers stays resident: measured at 50M parameters, a plain training loop
peaks at 1.20 GB and the same loop with the Learner at 1.45x that with default arenas, 1.24x
with one arena (``benchmarks/HISTORY.md``, "What the Learner costs"); giving the memory back
with ``malloc_trim`` instead cost up to 12% of the steps/s (every freed page is faulted in
again). ``mallopt(M_ARENA_MAX, n)`` is a setting of the whole process, so the Learner changes
it only when asked (``LearnerConfig.malloc_arenas``; ``diloco learner`` asks for 1); the
environment variable ``MALLOC_ARENA_MAX=1`` does the same for any program.
"""

from __future__ import annotations

import ctypes
import logging

M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number for the arena limit (``malloc.h``)."""

log = logging.getLogger(__name__)


def limit_malloc_arenas(arenas: int) -> bool:
    """``mallopt(M_ARENA_MAX, arenas)``; True if glibc took it (False elsewhere). Threads
    created afterwards share the existing arenas."""
    if arenas < 1:
        raise ValueError(f"malloc arenas must be >= 1, got {arenas}")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = bool(mallopt(M_ARENA_MAX, arenas))
    if done:
        log.info("glibc malloc arenas limited to %d (LearnerConfig.malloc_arenas)", arenas)
    return done

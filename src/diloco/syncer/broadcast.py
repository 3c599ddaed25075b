"""Per-stream broadcast queues of the syncer and the chunking of fragment payloads.

Every ``Subscribe`` stream owns a :class:`Subscriber`: the committer offers each new version
of a fragment to every subscriber, a version still waiting to be sent is superseded by the
newer one (its contributors carried over, so the learner still learns whether its own
contribution was merged), and the stream's handler thread takes what is pending and sends it
in ``CHUNK_BYTES`` pieces.
"""

from __future__ import annotations

import threading

CHUNK_BYTES = 1 << 20
"""Tensor bytes per gRPC message: ~1 MB is fastest on loopback (DESIGN §2)."""


def chunk_payload(payload: bytes) -> list[memoryview]:
    """Split ``payload`` into ``CHUNK_BYTES`` pieces (one empty piece for an empty payload)."""
    view = memoryview(payload)
    return [view[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [view[:0]]


#: How many versions per fragment the syncer remembers the contributors of.
RECENT_VERSIONS = 16


class Subscriber:
    """Latest pending version of each fragment for one stream; older ones are superseded."""

    def __init__(self, learner_id: str, session: str, observer: bool) -> None:
        self.learner_id, self.session, self.observer = learner_id, session, observer
        self.pending: dict[int, tuple[int, bytes, frozenset[str]]] = {}
        self.cond = threading.Condition()
        self.closed = False

    def offer(
        self, fragment: int, version: int, payload: bytes, contributors: frozenset[str]
    ) -> None:
        """Queue a version; one still pending is superseded, its contributors carried over."""
        with self.cond:
            skipped = self.pending.get(fragment)
            if skipped is not None:
                contributors = contributors | skipped[2]
            self.pending[fragment] = (version, payload, contributors)
            self.cond.notify()

    def take(self, timeout: float) -> list[tuple[int, int, bytes, frozenset[str]]]:
        with self.cond:
            if not self.pending and not self.closed:
                self.cond.wait(timeout)
            items = sorted((p, v, b, c) for p, (v, b, c) in self.pending.items())
            self.pending.clear()
            return items

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

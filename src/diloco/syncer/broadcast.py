"""Per-stream broadcast queues of the syncer and the chunking of fragment payloads.

Every ``Subscribe`` stream owns a :class:`Subscriber`. The committer offers each new version
of a fragment to every subscriber as a **delta** (``W(v) − W(v−1)`` in the down codec) when
the stream's learner will hold ``v − 1``, and otherwise as a **keyframe** (``W(v)`` in fp32,
encoded only when a stream first needs one: most versions only ever go out as deltas), so a
learner never receives a version it cannot apply.

A stream that falls behind (its link drains slower than rounds commit: gRPC blocks its
handler thread while the link is full) does not fall further behind by it: a version still
waiting to be sent is followed by the next version's delta (a **chain** of deltas, exact,
applied in order) while the chain is smaller than one keyframe, and superseded by the newer
version's keyframe beyond that (the skipped versions' contributors carried over, so the learner
still learns whether its own contribution was merged). So a stream sends at most a
keyframe's bytes per fragment however many versions it missed, and a learner that keeps up
receives each version once, as its delta. The syncer's clock also queues **requests** here
("send your contribution for fragment p"); they go out before any payload. The stream's
handler thread takes what is pending, **one fragment at a time** (the one waiting longest),
and sends it in ``CHUNK_BYTES`` pieces.

**What a slow stream holds.** A keyframe is W_p at its version (4 bytes per value); its fp32
payload is a view of those bytes (a copy, 4 more, only on a big-endian host). What waits for a stream is, per fragment, the
newest version only (a newer keyframe replaces an unsent one: a learner applies the newest),
the very keyframe the syncer keeps for the next subscriber anyway; a stream stalled in a send
(its learner does not read) holds the one fragment it is sending, never the rest of its
model. So with S slow streams the syncer holds at most P + S keyframes (P: the fragments),
not a model per stream. [test_syncer_hygiene]
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.algorithm import codecs
from diloco.algorithm.fragments import fragment_digest
from diloco.wire.protocol import CHUNK_BYTES

KEYFRAME_CODEC = "fp32"
"""Keyframes carry W exactly, so a learner holding version v holds exactly W(v)."""


def _fp32_view(values: torch.Tensor) -> bytes | memoryview:
    """``codecs.encode(values, "fp32")``, as a view of ``values`` where that is the same
    bytes (a little-endian host, a contiguous fp32 CPU tensor)."""
    flat = values.detach().reshape(-1)
    if sys.byteorder != "little" or flat.dtype != torch.float32 or not flat.is_contiguous():
        return codecs.encode(values, KEYFRAME_CODEC)
    if flat.device.type != "cpu" or not codecs.all_finite(flat):
        return codecs.encode(values, KEYFRAME_CODEC)  # (raises what it raises)
    array = flat.numpy()
    array.flags.writeable = False
    return memoryview(array).cast("B")


def chunk_payload(payload: bytes | memoryview) -> list[memoryview]:
    """Split ``payload`` into ``CHUNK_BYTES`` pieces (one empty piece for an empty payload)."""
    view = memoryview(payload)
    return [view[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [view[:0]]


class Keyframe:
    """``W_p`` at one version, as the fp32 payload and digest a keyframe needs, made the first
    time a stream asks for them and then kept (thread-safe). ``values`` must not be changed
    in place afterwards (the committer makes a new tensor for every version).

    On a little-endian host the payload is ``values``' own memory (fp32 little-endian is
    what the tensor holds), read through a ``memoryview``: no second copy of ``W_p``."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self._payload: bytes | memoryview | None = None
        self._digest: str | None = None
        self._lock = threading.Lock()

    @property
    def payload(self) -> bytes | memoryview:
        """The fp32 payload: a read-only view of ``values`` where the host's byte order is
        the wire's, else ``codecs.encode(values, KEYFRAME_CODEC)``."""
        with self._lock:
            if self._payload is None:
                self._payload = _fp32_view(self.values)
            return self._payload

    @property
    def nbytes(self) -> int:
        """The payload's size (known without encoding it)."""
        return codecs.encoded_nbytes(self.values.numel(), KEYFRAME_CODEC)

    @property
    def digest(self) -> str:
        """``fragment_digest`` of the values (what a learner holding them sends at subscribe)."""
        with self._lock:
            if self._digest is None:
                self._digest = fragment_digest(self.values)
            return self._digest


#: How many versions per fragment the syncer remembers the contributors of.
RECENT_VERSIONS = 16


@dataclass(frozen=True)
class QueuedVersion:
    """One fragment version queued for a stream."""

    fragment: int
    version: int
    body: bytes | Keyframe
    """The delta's payload, or the keyframe (encoded when the stream sends it)."""
    codec: str
    base_version: int
    """``-1`` for a keyframe; otherwise the version the delta applies to."""
    contributors: frozenset[str]
    unchanged: bool = False
    """A keyframe without payload: the learner already holds this value (digest matched)."""
    dropped: frozenset[int] = frozenset()
    """This stream's learner's upload ids that the versions up to this one left out."""

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0

    @property
    def payload(self) -> bytes:
        """The bytes to send (an unchanged keyframe: none)."""
        if self.unchanged:
            return b""
        return self.body.payload if isinstance(self.body, Keyframe) else self.body


class Subscriber:
    """Pending requests and the latest pending version of each fragment for one stream."""

    def __init__(
        self, learner_id: str, session: str, observer: bool, held: dict[int, int] | None = None
    ) -> None:
        """``held``: the version of each fragment the learner said it holds when it
        subscribed (the stream sends it nothing older, and deltas only on top of it)."""
        self.learner_id, self.session, self.observer = learner_id, session, observer
        self.held: dict[int, int] = dict(held or {})
        self.pending: dict[int, list[QueuedVersion]] = {}
        """Per fragment, what waits to be sent, in order: a keyframe, or a chain of deltas."""
        self.requests: dict[int, int] = {}
        self.cond = threading.Condition()
        self.closed = False

    def offer(
        self,
        fragment: int,
        version: int,
        *,
        keyframe: Keyframe,
        delta: bytes | None = None,
        delta_codec: str = "",
        contributors: frozenset[str] = frozenset(),
        dropped: Mapping[str, frozenset[int]] | None = None,
    ) -> None:
        """Queue ``version`` (see the module docstring): its delta when this stream's
        learner will hold ``version − 1`` (nothing pending, or a pending chain of deltas or
        a confirmation ending there) and the chain stays smaller than a keyframe; else its
        keyframe, superseding what is pending. ``dropped``: per learner, its upload ids
        this version left out of its merge (this stream carries its own learner's)."""
        mine = (dropped or {}).get(self.learner_id, frozenset())
        with self.cond:
            chain = self.pending.get(fragment, [])
            ends_at = chain[-1].version if chain else self.held.get(fragment)
            chainable = all(item.is_delta or item.unchanged for item in chain)
            if (
                delta is not None
                and ends_at == version - 1
                and chainable
                and sum(len(i.body) for i in chain if i.is_delta) + len(delta) <= keyframe.nbytes
            ):
                chain.append(
                    QueuedVersion(
                        fragment,
                        version,
                        delta,
                        delta_codec,
                        version - 1,
                        contributors,
                        dropped=mine,
                    )
                )
            else:
                skipped = frozenset().union(*(item.contributors for item in chain))
                lost = frozenset().union(*(item.dropped for item in chain))
                chain = [
                    QueuedVersion(
                        fragment,
                        version,
                        keyframe,
                        KEYFRAME_CODEC,
                        -1,
                        contributors | skipped,
                        dropped=mine | lost,
                    )
                ]
            self.pending[fragment] = chain
            self.cond.notify()

    def confirm(self, fragment: int, version: int) -> None:
        """Tell this stream's learner it already holds ``version`` (no payload)."""
        with self.cond:
            self.pending[fragment] = [
                QueuedVersion(
                    fragment, version, b"", KEYFRAME_CODEC, -1, frozenset(), unchanged=True
                )
            ]
            self.cond.notify()

    def request(self, fragment: int, version: int) -> None:
        """Ask this stream's learner for its contribution to ``fragment``'s open round."""
        with self.cond:
            self.requests[fragment] = version
            self.cond.notify()

    def take(self, timeout: float) -> tuple[list[tuple[int, int]], list[QueuedVersion]]:
        """Wait (up to ``timeout``) for something to send; returns every request and what
        waits of one fragment, the one waiting longest (a keyframe, or a chain of deltas),
        and counts those versions as held by the learner. The other fragments wait here,
        where a newer version still replaces them (the module docstring)."""
        with self.cond:
            if not self.pending and not self.requests and not self.closed:
                self.cond.wait(timeout)
            requests = sorted(self.requests.items())
            self.requests.clear()
            items: list[QueuedVersion] = []
            if self.pending:  # (a dict keeps the order fragments began to wait in)
                items = self.pending.pop(next(iter(self.pending)))
            for item in items:
                self.held[item.fragment] = item.version
            return requests, items

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

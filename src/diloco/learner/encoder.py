"""How a link turns an upload job into the bytes it sends: the seam that fault injection
wraps (``diloco.learner.corrupt.CorruptingEncoder``), so the link itself has no fault
branches."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.algorithm import codecs
from diloco.learner.uploads import UploadJob


@dataclass(frozen=True)
class Outgoing:
    """An upload as it goes on the wire."""

    payload: bytes
    """The encoded delta sent."""
    tokens: int
    """The tokens it claims."""
    meant: bytes
    """What the learner meant to send (the payload unless a fault damaged it): its residual
    is measured against this, so damage is never fed back into the learner's progress."""


class UploadEncoder:
    """How a link turns a job into the bytes it sends; the seam that fault injection wraps
    (``diloco.learner.corrupt.CorruptingEncoder``) so the link itself has no fault branches."""

    def declared_tokens_per_step(self, tokens_per_step: int) -> int:
        """The tokens per step the link declares at join."""
        return tokens_per_step

    def encode(self, job: UploadJob, codec: str) -> Outgoing:
        payload = codecs.encode(job.delta, codec)
        return Outgoing(payload, job.tokens, payload)

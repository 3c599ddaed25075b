"""How a link turns an upload job into the bytes it sends: the seam that fault injection
wraps (``diloco.learner.corrupt.CorruptingEncoder``), so the link itself has no fault
branches."""

from __future__ import annotations

from diloco.algorithm import codecs
from diloco.learner.uploads import EncodedUpload, UploadJob


class UploadEncoder:
    """How a link turns a job into the bytes it sends; the seam that fault injection wraps
    (``diloco.learner.corrupt.CorruptingEncoder``) so the link itself has no fault branches."""

    def declared_tokens_per_step(self, tokens_per_step: int) -> int:
        """The tokens per step the link declares at join."""
        return tokens_per_step

    def encode(self, job: UploadJob, codec: str) -> EncodedUpload:
        payload = codecs.encode(job.delta, codec)
        return EncodedUpload(payload, job.tokens, payload, codec)

"""Silent data corruption, on purpose: the ``corrupt`` chaos fault inside a real learner.

A learner started with ``--corrupt HOW`` damages every outer gradient it uploads between two
wall-clock times, the way broken hardware would, while training normally otherwise:

- ``huge``: the delta is multiplied by ``HUGE_FACTOR`` (finite, passes every format check;
  the syncer's norm guard must catch it);
- ``flip``: the delta's sign is flipped (ordinary norm; only averaging limits it);
- ``nan``: the encoded payload's first four bytes become a NaN (the syncer's decoder must
  refuse it; the learner's own encoder would refuse a NaN delta, so it is injected after);
- ``hostile``: an attacker rather than broken hardware: the delta's sign is flipped (its
  ordinary norm passes the guard) and the learner declares ``HOSTILE_CLAIM`` times its
  tokens per step at join and claims that many times its tokens in every upload, to
  outweigh the honest learners (docs/security.md "A hostile learner").

The damage is done by ``CorruptingEncoder``, a wrapper around the link's upload encoder: the
link itself has no fault branches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from diloco.algorithm import codecs
from diloco.chaos import CORRUPT_HOWS
from diloco.learner.encoder import UploadEncoder
from diloco.learner.uploads import EncodedUpload, UploadJob

HUGE_FACTOR = 1e3
"""What ``huge`` multiplies a delta by."""
HOSTILE_CLAIM = 100
"""What ``hostile`` multiplies its declared tokens per step and its token claims by."""
_NAN = b"\xc0\x7f\xc0\x7f"  # NaN as float32 LE and as two bfloat16 LE; also an int8/int4 scale


def corrupt_delta(delta: torch.Tensor, how: str) -> torch.Tensor:
    """A damaged copy of ``delta`` (``delta`` itself is not modified)."""
    if how == "huge":
        return delta * HUGE_FACTOR
    if how in ("flip", "hostile"):
        return -delta
    if how == "nan":
        return delta
    raise ValueError(f"unknown corruption {how!r}; choose one of {', '.join(CORRUPT_HOWS)}")


def corrupt_payload(payload: bytes, how: str) -> bytes:
    """The encoded payload after damage (only ``nan`` touches bytes)."""
    if how == "nan" and len(payload) >= len(_NAN):
        return _NAN + payload[len(_NAN) :]
    return payload


@dataclass(frozen=True)
class Corruptor:
    """Corrupt uploads as ``how`` while ``start <= time.time() < end`` (epoch seconds)."""

    how: str
    start: float = 0.0
    end: float = float("inf")

    def __post_init__(self) -> None:
        if self.how not in CORRUPT_HOWS:
            raise ValueError(f"unknown corruption {self.how!r}; choose one of {CORRUPT_HOWS}")

    def active(self, now: float) -> bool:
        return self.start <= now < self.end

    def delta(self, delta: torch.Tensor) -> torch.Tensor:
        return corrupt_delta(delta, self.how)

    def payload(self, payload: bytes) -> bytes:
        return corrupt_payload(payload, self.how)

    def tokens(self, tokens: int) -> int:
        """The token count an upload claims (``hostile`` inflates it)."""
        return tokens * HOSTILE_CLAIM if self.how == "hostile" else tokens

    def declared(self, tokens_per_step: int) -> int:
        """The tokens per step declared at join (``hostile`` inflates it)."""
        return tokens_per_step * HOSTILE_CLAIM if self.how == "hostile" else tokens_per_step


class CorruptingEncoder(UploadEncoder):
    """A link's encoder wrapped to damage its uploads as ``corruptor`` says, while it is
    active; everything else goes through ``inner`` unchanged (``SyncerLink(encoder=...)``).
    ``corrupted`` counts the uploads it damaged (every shard's link may share one)."""

    def __init__(self, corruptor: Corruptor, inner: UploadEncoder | None = None) -> None:
        self.corruptor = corruptor
        self.inner = inner or UploadEncoder()
        self.corrupted = 0
        self._lock = threading.Lock()

    def declared_tokens_per_step(self, tokens_per_step: int) -> int:
        return self.corruptor.declared(self.inner.declared_tokens_per_step(tokens_per_step))

    def encode(self, job: UploadJob, codec: str) -> EncodedUpload:
        honest = self.inner.encode(job, codec)
        if not self.corruptor.active(time.time()):
            return honest
        damaged = codecs.encode(self.corruptor.delta(job.delta), codec)
        with self._lock:
            self.corrupted += 1
        return EncodedUpload(
            payload=self.corruptor.payload(damaged),
            tokens=self.corruptor.tokens(honest.tokens),
            meant=honest.meant,
            codec=codec,
        )

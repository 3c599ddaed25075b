"""Where the syncer's commits spend their time: a cheap recorder of each stage's durations,
always on (a part the committer holds: ``Committer.stage_times``).

The stages of one commit, in the order they run (``STAGES``): ``decode`` (each upload's
payload decoded to fp32 and its norm taken, on the upload's RPC thread: one sample per
upload), ``guard`` (closing the round under the lock: the direction check, the weights and
the share), ``merge`` (the merged delta), ``outer`` (the outer step and the commit's copies
of Θ_p and momentum), ``encode`` (the broadcast delta encoded and the wire image moved),
``checksum`` (the digest of Θ_p), ``persist`` (the store: the commit's journal record, or the
whole fragment for its first commit, synced), ``log`` (the receipt log and the tape record,
each synced) and ``broadcast`` (the change queued on every subscription: the sending itself
runs on the streams' threads and is not counted). ``snapshot`` is the background writer's
full snapshot of a fragment (off the commit path: one sample per snapshot).

A sample is taken with ``timing(stage)`` (the recorder's clock before and after) or given
as a duration (``add``). ``summary`` reports per stage the samples, their total and their
percentiles over the last ``KEPT_SAMPLES``; ``take`` reports the same and starts a new window
(a benchmark leaves its warm-up out). Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

STAGES = (
    "decode",
    "guard",
    "merge",
    "outer",
    "encode",
    "checksum",
    "persist",
    "log",
    "broadcast",
    "snapshot",
)
"""Every stage the recorder knows, in the order a commit runs them (``snapshot`` last: it
runs in the background)."""
KEPT_SAMPLES = 4096
"""Durations kept per stage for the percentiles (the totals count every sample)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 ≤ q ≤ 1) of ``values`` by the nearest rank; 0.0 for none.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 0.5), percentile([4.0, 1.0, 3.0, 2.0], 0.95)
    (2.0, 4.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered) - 1e-9)  # (the tolerance: 0.95 × 20 is 19, not 19.0000001)
    return ordered[min(max(rank, 1), len(ordered)) - 1]


class StageTimes:
    """Durations of the commit's stages (see the module docstring)."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, keep: int = KEPT_SAMPLES
    ) -> None:
        """``clock``: seconds, for ``timing`` (a test's fake clock); ``keep``: the durations
        kept per stage for the percentiles."""
        self.clock = clock
        self.keep = keep
        self._lock = threading.Lock()
        self._samples: dict[str, deque[float]] = {}
        self._totals: dict[str, tuple[int, float]] = {}

    def add(self, stage: str, seconds: float) -> None:
        """One sample of ``stage`` (one of ``STAGES``: ``ValueError`` otherwise)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
        with self._lock:
            kept = self._samples.get(stage)
            if kept is None:
                kept = self._samples[stage] = deque(maxlen=self.keep)
            kept.append(seconds)
            count, total = self._totals.get(stage, (0, 0.0))
            self._totals[stage] = (count + 1, total + seconds)

    @contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        """Time the block as one sample of ``stage`` (also when it raises)."""
        started = self.clock()
        try:
            yield
        finally:
            self.add(stage, self.clock() - started)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage with samples, in ``STAGES`` order: ``count``, ``total_s`` and the
        ``p50_s``, ``p95_s`` and ``max_s`` of the kept durations."""
        with self._lock:
            return self._summary()

    def take(self) -> dict[str, dict[str, float]]:
        """``summary``, then forget every sample: the next summary covers what follows."""
        with self._lock:
            summary = self._summary()
            self._samples.clear()
            self._totals.clear()
            return summary

    def _summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for stage in STAGES:
            if stage not in self._totals:
                continue
            count, total = self._totals[stage]
            kept = list(self._samples[stage])
            out[stage] = {
                "count": count,
                "total_s": total,
                "p50_s": percentile(kept, 0.5),
                "p95_s": percentile(kept, 0.95),
                "max_s": max(kept),
            }
        return out

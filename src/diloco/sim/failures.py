"""Slice outages under independent chip failures, drawn vectorized with numpy.

The model (docs/simulate.md): every chip is interrupted with exponential inter-arrival times
of mean ``mtbi_s`` (the paper: one year), independently of the others and of whether the job
is running. A chip interruption takes its whole slice (``slice_chips`` chips) down for a
recovery time drawn from a :class:`Recovery` distribution. A slice of ``c`` chips therefore
fails as a Poisson process of rate ``c / mtbi_s``; a failure that hits a slice which is
already down extends its outage to the later of the two recovery ends (the two outages are
merged). The result is, per slice, a list of disjoint outage intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from diloco.sim.config import Recovery as Recovery  # its home: the simulator's settings


@dataclass(frozen=True)
class Outages:
    """Disjoint down intervals per slice, sorted by (slice, start)."""

    slice_id: np.ndarray
    """int64, the slice of each outage (0 ≤ id < slices)."""
    start: np.ndarray
    """float64 seconds."""
    end: np.ndarray
    """float64 seconds; may lie beyond the horizon (the slice is still down at the end)."""
    slices: int
    horizon_s: float
    failures: np.ndarray | None = None
    """float64, sorted: every failure time before merging (also those that hit a slice that
    was already down). ``None``: the outage starts are the failures."""

    def failure_times(self) -> np.ndarray:
        """Every failure, sorted (data-parallel replaces a failed slice by a spare, so a
        failure of the slice under repair still hits the job's chips: none is merged away)."""
        return self.failures if self.failures is not None else np.sort(self.start)


def draw_outages(
    rng: np.random.Generator,
    *,
    slices: int,
    slice_chips: int,
    mtbi_s: float,
    recovery: Recovery,
    horizon_s: float,
) -> Outages:
    """Every slice outage in ``[0, horizon_s)``; a pure function of the generator state.

    Failures of all slices together form one Poisson process of rate
    ``slices · slice_chips / mtbi_s``; each failure picks its slice uniformly. Overlapping
    outages of one slice are merged.
    """
    if slices < 1 or slice_chips < 1:
        raise ValueError(f"need slices >= 1 and slice_chips >= 1 (got {slices}, {slice_chips})")
    if mtbi_s <= 0 or horizon_s <= 0:
        raise ValueError("mtbi_s and horizon_s must be > 0")
    rate = slices * slice_chips / mtbi_s  # failures per second, whole cluster
    n = int(rng.poisson(rate * horizon_s))
    start = np.sort(rng.uniform(0.0, horizon_s, n))
    sid = rng.integers(0, slices, n)
    end = start + recovery.draw(rng, n)
    merged = merge_outages(sid, start, end, slices=slices, horizon_s=horizon_s)
    return replace(merged, failures=start)


def merge_outages(
    slice_id: np.ndarray, start: np.ndarray, end: np.ndarray, *, slices: int, horizon_s: float
) -> Outages:
    """Merge overlapping down intervals of the same slice (vectorized).

    Sorted by (slice, start), an interval opens a new outage unless it starts before the
    running maximum end of the earlier intervals of its slice. The running maximum per slice
    is one global ``maximum.accumulate`` after shifting each slice's times by
    ``slice · offset`` (offset larger than any time), which keeps slices apart.
    """
    slice_id = np.asarray(slice_id, dtype=np.int64)
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    if slice_id.size == 0:
        empty = np.zeros(0)
        return Outages(np.zeros(0, dtype=np.int64), empty, empty.copy(), slices, horizon_s)
    order = np.lexsort((start, slice_id))
    sid, s, e = slice_id[order], start[order], end[order]
    offset = 2.0 * max(float(e.max()), float(s.max()), horizon_s) + 1.0
    run_end = np.maximum.accumulate(e + sid * offset) - sid * offset
    new = np.ones(sid.size, dtype=bool)
    same = sid[1:] == sid[:-1]
    new[1:] = ~same | (s[1:] > run_end[:-1])
    last = np.r_[np.flatnonzero(new)[1:] - 1, sid.size - 1]
    return Outages(sid[new], s[new], run_end[last], slices, horizon_s)

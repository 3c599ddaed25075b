"""Norm guard: refuse a contribution whose size is far outside what its fragment has seen.

Why: one learner with silent data corruption (a flipped exponent bit, a broken accelerator)
can send a finite outer gradient a thousand times too large. RDA averages *norms*, so such a
contribution moves the global fragment by hundreds of times a normal step and wrecks the run
for everyone. The guard compares each contribution's L2 norm with a robust reference and
refuses outliers before they enter a round.

Decision (a pure function, :func:`check_norm`):

- **Reference.** Once the fragment has ``min_history`` accepted norms, the reference is the
  median of its last ``window`` accepted norms (a median: a minority of bad learners cannot
  move it). Before that (warm-up) it is the smaller of that median (if any norm is known) and
  the norm of the fragment's own global parameters ``‖Θ_p‖``: no honest outer gradient moves
  a fragment by many times its own size, and the first honest norms tighten the limit at
  once (a corrupt contribution that slipped in first cannot loosen it). If the reference is
  0 (an all-zero fragment, nothing known yet) nothing is refused.
- **Limit.** A contribution is refused when ``‖Δ‖ > k · reference``; ``k = 0`` disables the
  guard. Default ``k = 10``: honest norms vary by a few × across a run (lr warm-up and decay,
  a learner back from a partition sending more steps at once), corruption by orders of
  magnitude.
- **Refuse, not clip.** Clipping keeps the corrupt *direction* and gives it a normal size and
  a full weight; refusing keeps the merge clean and costs only one contribution. Only accepted
  norms enter the history, so refused outliers never drift the reference.

What the guard does not catch: a corrupt delta of ordinary norm (e.g. a sign flip). Weighted
averaging with the honest learners bounds its effect (see docs/security.md).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_K = 10.0
"""Default limit factor: refuse ``‖Δ‖ > k × reference``."""
DEFAULT_WINDOW = 64
"""Accepted norms remembered per fragment."""
DEFAULT_MIN_HISTORY = 8
"""Accepted norms a fragment needs before the median replaces the warm-up reference."""


@dataclass(frozen=True)
class NormVerdict:
    accept: bool
    reason: str
    limit: float
    """The largest norm that would have been accepted (``inf``: no limit)."""


def check_norm(
    norm: float,
    history: Sequence[float],
    param_norm: float,
    *,
    k: float = DEFAULT_K,
    min_history: int = DEFAULT_MIN_HISTORY,
) -> NormVerdict:
    """Decide whether a contribution of L2 norm ``norm`` may enter its fragment's round.

    ``history`` holds the fragment's recent accepted norms (oldest first), ``param_norm`` is
    ``‖Θ_p‖`` of the current global fragment. Pure: same inputs, same verdict.
    """
    if not math.isfinite(norm) or norm < 0:  # overflowed float32, or garbage
        return NormVerdict(False, f"delta norm {norm} is not a finite non-negative number", 0.0)
    if k <= 0:
        return NormVerdict(True, "norm guard disabled", float("inf"))
    if len(history) >= min_history:
        reference = statistics.median(history)
        what = f"the median {reference:.4g} of the last {len(history)} accepted norms"
    elif history and statistics.median(history) < param_norm:
        reference = statistics.median(history)
        what = f"the median {reference:.4g} of the first {len(history)} accepted norms (warm-up)"
    else:
        reference = param_norm
        what = f"the fragment's parameter norm {reference:.4g} (warm-up, {len(history)} norms)"
    if reference <= 0:
        return NormVerdict(True, f"no reference yet ({what})", float("inf"))
    limit = k * reference
    if norm > limit:
        return NormVerdict(
            False, f"delta norm {norm:.4g} exceeds {k:g} x {what} (limit {limit:.4g})", limit
        )
    return NormVerdict(True, f"delta norm {norm:.4g} within {k:g} x {what}", limit)


class NormHistory:
    """The last ``window`` accepted contribution norms of every fragment."""

    def __init__(self, num_fragments: int, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self._norms = [deque(maxlen=window) for _ in range(num_fragments)]

    def of(self, fragment: int) -> tuple[float, ...]:
        return tuple(self._norms[fragment])

    def record(self, fragment: int, norm: float) -> None:
        self._norms[fragment].append(float(norm))

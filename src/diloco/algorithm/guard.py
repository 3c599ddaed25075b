"""Norm guard: refuse a contribution whose size is far outside what its fragment has seen.

Why: one learner with silent data corruption (a flipped exponent bit, a broken accelerator)
can send a finite outer gradient a thousand times too large. RDA averages *norms*, so such a
contribution moves the global fragment by hundreds of times a normal step and wrecks the run
for everyone. The guard compares each contribution with two references and refuses outliers
before they enter a round (a pure function, :func:`check_norm`):

1. **Against its fragment's recent contributions.** A delta's size grows with the inner steps
   it covers (a fragment's first send after a join may cover 1 step, the next 24), so the
   guard compares the *per-step norm* ``‖Δ‖ / steps`` with the median of the last ``window``
   accepted per-step norms of the fragment, once there are ``min_history`` of them: refused if
   above ``k ×`` that median. A median: a minority of bad learners cannot move it.
2. **Against the fragment itself**, always: refused if ``‖Δ‖ > param_ratio · ‖Θ_p‖``. No
   honest outer gradient moves a fragment by many times its own size; this is the only check
   while a fragment has no history yet (the first contributions, or after a syncer restart,
   since the history is not persisted), and it caps what a learner that inflates its step
   counter could push through check 1. Skipped while ``‖Θ_p‖ = 0``.

Defaults: ``k = 20``, ``param_ratio = 10``, ``window = 32``, ``min_history = 3``. Measured on
the tiny recipe, honest per-step norms of one fragment vary by up to ~9× early on (the lr
warm-up ramps while the first sends cover 1 to 24 steps) and honest deltas reach ~2× ‖Θ_p‖;
corruption by ×1000 is far outside both. ``k = 0`` disables the guard (non-finite norms are
still refused).

**Refuse, not clip.** Clipping keeps the corrupt *direction* and gives it a normal size and a
full weight; refusing keeps the merge clean and costs only one contribution (the learner's
next delta carries its new progress). Only accepted norms enter the history, so refused
outliers never drift the reference.

What the guard does not catch: a corrupt delta of ordinary size (a sign flip, noise of the
right scale). Weighted averaging with honest learners bounds its effect (docs/security.md).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_K = 20.0
"""Refuse a per-step norm above ``k ×`` the fragment's running median."""
DEFAULT_PARAM_RATIO = 10.0
"""Refuse ``‖Δ‖ > param_ratio · ‖Θ_p‖``."""
DEFAULT_WINDOW = 32
"""Accepted per-step norms remembered per fragment."""
DEFAULT_MIN_HISTORY = 3
"""Accepted norms a fragment needs before check 1 applies."""


@dataclass(frozen=True)
class NormVerdict:
    accept: bool
    reason: str


def check_norm(
    norm: float,
    steps: int,
    history: Sequence[float],
    param_norm: float,
    *,
    k: float = DEFAULT_K,
    param_ratio: float = DEFAULT_PARAM_RATIO,
    min_history: int = DEFAULT_MIN_HISTORY,
    sync_every: int = 0,
) -> NormVerdict:
    """Decide whether a contribution of L2 norm ``norm`` covering ``steps`` inner steps may
    enter its fragment's round.

    ``history`` holds the fragment's recent accepted per-step norms (oldest first),
    ``param_norm`` is ``‖Θ_p‖`` of the current global fragment. With ``sync_every`` (H) the
    bound of check 2 follows the steps a delta covers: ``param_ratio · max(steps / H, 1/4) ·
    ‖Θ_p‖``. On the syncer's clock a delta covers however many steps the learner did since
    it last sent the fragment: a learner whose delta was refused answers the next round with
    only a few steps (a corrupted short delta slipped under the plain bound while the
    fragment had no history), and when the syncer cannot tick as fast as steps are taken (the
    ``tiny`` recipe, ~10 ms steps) an honest delta covers hundreds of steps (one of 258 steps
    exceeded the plain bound). Pure: same inputs, same verdict.
    """
    if not math.isfinite(norm) or norm < 0:  # overflowed float32, or garbage
        return NormVerdict(False, f"delta norm {norm} is not a finite non-negative number")
    if k <= 0:
        return NormVerdict(True, "norm guard disabled")
    ratio = param_ratio
    if sync_every > 0:
        ratio *= max(steps / sync_every, 0.25)
    if param_norm > 0 and norm > ratio * param_norm:
        return NormVerdict(
            False,
            f"delta norm {norm:.4g} over {steps} steps exceeds {ratio:.3g} x the fragment's "
            f"own norm {param_norm:.4g}",
        )
    per_step = norm / max(steps, 1)
    if len(history) >= max(min_history, 1):
        median = statistics.median(history)
        if median > 0 and per_step > k * median:
            return NormVerdict(
                False,
                f"delta norm per step {per_step:.4g} ({norm:.4g} over {steps} steps) exceeds "
                f"{k:g} x the median {median:.4g} of the last {len(history)} accepted",
            )
    return NormVerdict(True, f"delta norm {norm:.4g} within bounds")


class NormHistory:
    """The last ``window`` accepted per-step contribution norms of every fragment."""

    def __init__(self, num_fragments: int, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self._norms = [deque(maxlen=window) for _ in range(num_fragments)]

    def of(self, fragment: int) -> tuple[float, ...]:
        return tuple(self._norms[fragment])

    def record(self, fragment: int, norm: float, steps: int) -> None:
        self._norms[fragment].append(float(norm) / max(steps, 1))

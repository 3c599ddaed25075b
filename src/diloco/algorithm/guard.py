"""Norm guard: refuse a contribution whose size is far outside what its fragment has seen.

Why: one learner with silent data corruption (a flipped exponent bit, a broken accelerator)
can send a finite outer gradient a thousand times too large. RDA averages *norms*, so such a
contribution moves the global fragment by hundreds of times a normal step and wrecks the run
for everyone. The guard compares each contribution with three references and refuses outliers
before they enter a round (a pure function, :func:`check_norm`):

1. **Against its fragment's recent contributions, learner by learner.** A delta's size grows
   with the inner steps it covers (a fragment's first send after a join may cover 1 step, the
   next 24), so the guard compares the *per-step norm* ``‖Δ‖ / steps`` with a reference: each
   learner's median of its last ``window`` accepted per-step norms of the fragment, and the
   upper median of those over the learners (``NormHistory.reference``), once the fragment has
   ``min_history`` accepted norms: refused if above ``k ×`` the reference. A learner is
   judged by the *other* learners' values once two or more of them hold norms (since
   2026-11-26): its own accepted norms cannot vouch for it. One value per learner, not per
   upload: a learner that floods the syncer with tiny deltas moves only its
   own value, so it cannot make honest uploads look like outliers; the *upper* median, so one
   learner of two cannot pull the reference below the honest one's. Zero norms (a learning
   rate warming up from 0, or a flood of empty deltas) say nothing about scale and are not
   recorded, so they cannot switch the check off.
2. **Against the fragment itself**, always: refused if ``‖Δ‖ > param_ratio · ‖Θ_p‖``. No
   honest outer gradient moves a fragment by many times its own size; this is the only check
   while a fragment has no history yet (the first contributions, or after a syncer restart,
   since the history is not persisted), and it caps what a learner that inflates its step
   counter could push through check 1. On the syncer's clock the bound follows the steps a
   delta covers (``check_norm``), but never beyond ``max_ratio · ‖Θ_p‖``, whatever the steps
   claimed. While ``‖Θ_p‖ = 0`` (a fragment of zero-initialised tensors: a LoRA adapter's
   B matrix, biases) there is nothing to scale by, and checks 1 and 3 wait for history, so
   an absolute bound takes its place: ``‖Δ‖ ≤ zero_rms · sqrt(numel)``, an RMS per value
   (``DEFAULT_ZERO_RMS``). It applies exactly while ``‖Θ_p‖ = 0``: at any non-zero norm,
   however small, the relative bound applies.
3. **Against the size of its fragment's recent contributions, whatever steps it claims**
   (since 2026-11-26): refused if ``‖Δ‖`` (plus what the learner's contribution already
   holds in the open round, so splitting a delta into many uploads gains nothing) is above
   ``k ×`` the *largest* of the learners' median recent accepted norms of the fragment
   (``NormHistory.size_reference``). Steps are claims: checks 1 and 2 judge a delta over at
   most the steps the syncer's clock allows (``plausible_steps``), and those grow with the
   time, hundreds a few seconds after the previous delta at 10 ms steps. The largest median, not the upper median,
   because learners differ in speed and a fast one brings more steps per round (replayed on
   a tape of a mixed fleet, honest sizes reached 38 × the upper median). Measured with the
   guard in place (5 runs of ``DEFAULT_MAX_RATIO``, 16,144 uploads, none refused):
   honest sizes at most 3.64 × the reference (tiny, 2 learners; p99 1.98), 2.05 × on the
   default recipe (p99 1.57). A learner's own median counts (a fast learner's honest
   deltas are many times a slow one's), so a learner that grows its deltas upload by upload
   raises its reference with them: check 3 stops a jump (a 9 × ‖Θ_p‖ delta from a learner
   that just joined, a run that diverges at once), check 2's ceiling bounds every one. On
   the syncer's clock only deltas of half a period or more enter its reference
   (:func:`covers_a_period`: short first deltas locked fragments out at H = 96).

Defaults: ``k = 20``, ``param_ratio = 10``, ``max_ratio = 32``, ``zero_rms = 1``,
``window = 32``, ``min_history = 3``. Measured on the tiny recipe, honest per-step norms of one fragment vary
by up to ~9× early on (the lr warm-up ramps while the first sends cover 1 to 24 steps);
honest sizes and ``‖Δ‖ / ‖Θ_p‖`` as above and in ``DEFAULT_MAX_RATIO``; corruption by ×1000
is far outside all three. ``k = 0`` disables the guard (non-finite norms are still refused).

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
from dataclasses import dataclass

DEFAULT_K = 20.0
"""Refuse a per-step norm above ``k ×`` the fragment's running median (check 1), a norm above
``k ×`` the largest of its learners' median norms (check 3)."""
DEFAULT_PARAM_RATIO = 10.0
"""Refuse ``‖Δ‖ > param_ratio · ‖Θ_p‖`` (on the syncer's clock: scaled by the steps covered)."""
DEFAULT_MAX_RATIO = 32.0
"""Refuse ``‖Δ‖ > max_ratio · ‖Θ_p‖`` whatever steps the contribution claims.

Measured 2026-11-26 (``diloco run --eval-every 0``, 1 min, 2-core machine; ``‖Δ‖ / ‖Θ_p‖``
of every accepted contribution, from the ``round`` records' ``norms`` / ``param_norm``):
tiny recipe, 2 learners: max 5.97, p99 0.62; tiny, 4 learners: max 4.98, p99 1.17; tiny, 3
learners, 2 of them slowed 3×: max 8.73, p99 0.87; tiny, 3 learners, ``--chaos
kill:mtbf=20s,down=2-5s``: max 11.98, p99 1.08; default recipe, 2 learners, 1.5 min: max
0.86, p99 0.49. Every value above 1.6 is in a fragment's first two commits, while the
fragment is still at its initialization (small weights) and a delta covers 57-227 steps
(at most 0.083 ‖Θ_p‖ per step): an honest delta of 9 ‖Θ_p‖ is possible there. 32 is 2.7 ×
the largest measured (at the steepest growth, a first delta of ~380 steps; the longest
honest delta seen covered 297). Once the fragment has history, check 3 is the tighter
bound."""
DEFAULT_ZERO_RMS = 1.0
"""While ``‖Θ_p‖ = 0``, refuse ``‖Δ‖ > zero_rms · sqrt(numel)``: a root mean square over
the fragment's values above 1, whatever steps the contribution claims.

Measured 2026-11-28 (one CPU thread, AdamW, the RMS of what zero-initialised tensors moved,
which for a fragment at 0 is its learner's delta): the ``tiny`` recipe with its biases and
LayerNorm biases at 0 and its attention output projections set to 0 (LoRA-style), the
recipe's warm-up and ``weight_decay``: after 500 steps at lr 3e-3 all of them together 0.048,
the largest single tensor 0.28 (largest single value 0.37); at lr 1e-2, 0.13 and 0.19; a
rank-8 LoRA B matrix (64 x 8) on a regression, 500 steps at lr 1e-3 / 3e-3: 0.051 / 0.056.
AdamW moves a value by about lr per step, so a delta of RMS 1 needs every value of the
fragment to move the same way for 1/lr steps at the peak rate (333 at lr 3e-3; a
fragment's first delta covers up to ~380 steps, ``DEFAULT_MAX_RATIO``), which none
approached. 1 is 3.5 x the largest measured. It is also far above an initialised weight's
RMS (``1/sqrt(fan_in)``, 0.02-0.2), so one such delta cannot move a fragment at 0 further
than a few initialisations' worth; once it is non-zero the relative bounds apply."""
DEFAULT_WINDOW = 32
"""Accepted per-step norms remembered per fragment."""
DEFAULT_MIN_HISTORY = 3
"""Accepted norms a fragment needs before check 1 applies."""
MAX_SPEEDUP = 4.0
"""How far from what the syncer measured a learner's pace is believed (``syncer.pace``): a
claimed step time is clamped to ``[measured / 4, measured · 4]``, and the guard credits a
learner with at most 4 times its measured pace, itself at most 4 times the fleet's."""
STEP_SLACK = 2
"""``plausible_steps``: steps allowed beyond what the elapsed time gives (a step begun
before, a step boundary's rounding)."""


@dataclass(frozen=True)
class NormVerdict:
    accept: bool
    reason: str


def check_norm(
    norm: float,
    steps: int,
    reference: float | None,
    param_norm: float,
    *,
    numel: int | None = None,
    size_reference: float | None = None,
    held: float = 0.0,
    k: float = DEFAULT_K,
    param_ratio: float = DEFAULT_PARAM_RATIO,
    max_ratio: float = DEFAULT_MAX_RATIO,
    zero_rms: float = DEFAULT_ZERO_RMS,
    sync_every: int = 0,
) -> NormVerdict:
    """Decide whether a contribution of L2 norm ``norm`` covering ``steps`` inner steps may
    enter its fragment's round.

    ``reference`` is the fragment's reference per-step norm (``NormHistory.reference``;
    ``None`` while it has too little history), ``size_reference`` its reference norm
    (``NormHistory.size_reference``; ``None`` alike), ``held`` the norm the learner's
    contribution already holds in the open round (its earlier increments: the sizes are
    judged on ``held + norm``, over ``steps``: the steps credited to both), ``param_norm`` is ``‖Θ_p‖`` of the current global fragment
    and ``numel`` its number of values: while ``param_norm`` is 0 check 2 cannot scale by it,
    and the size is bounded by ``zero_rms · sqrt(numel)`` instead (``numel`` is then
    required: ``ValueError`` without it).
    With ``sync_every`` (H) the bound of check 2 follows the steps a delta covers:
    ``min(param_ratio · max(steps / H, 1/4), max_ratio) · ‖Θ_p‖``. On the syncer's clock a
    delta covers however many steps the learner did since it last sent the fragment: a
    learner whose delta was refused answers the next round with only a few steps (a
    corrupted short delta slipped under the plain bound while the fragment had no history),
    and when the syncer cannot tick as fast as steps are taken (the ``tiny`` recipe, ~10 ms
    steps) an honest delta covers hundreds of steps (one of 258 steps exceeded the plain
    bound). ``max_ratio`` and check 3 do not depend on ``steps``, a claim. Pure: same
    inputs, same verdict.
    """
    if not math.isfinite(norm) or norm < 0:  # overflowed float32, or garbage
        return NormVerdict(False, f"delta norm {norm} is not a finite non-negative number")
    if k <= 0:
        return NormVerdict(True, "norm guard disabled")
    size = held + norm
    ratio = param_ratio
    if sync_every > 0:
        ratio *= max(steps / sync_every, 0.25)
    ratio = min(ratio, max_ratio)
    if param_norm > 0 and size > ratio * param_norm:
        return NormVerdict(
            False,
            f"delta norm {size:.4g} over {steps} steps exceeds {ratio:.3g} x the fragment's "
            f"own norm {param_norm:.4g}" + _held(held),
        )
    if not param_norm > 0:
        if numel is None:
            raise ValueError("check_norm needs the fragment's numel while its norm is 0")
        bound = zero_rms * math.sqrt(numel)
        if size > bound:
            return NormVerdict(
                False,
                f"delta norm {size:.4g} exceeds {bound:.4g} ({zero_rms:g} x the square root "
                f"of its {numel} values) while the fragment's own norm is 0" + _held(held),
            )
    per_step = size / max(steps, 1)
    if reference is not None and reference > 0 and per_step > k * reference:
        return NormVerdict(
            False,
            f"delta norm per step {per_step:.4g} ({norm:.4g} over {steps} steps) exceeds "
            f"{k:g} x the median {reference:.4g} of the learners' recent accepted ones",
        )
    if size_reference is not None and size_reference > 0 and size > k * size_reference:
        return NormVerdict(
            False,
            f"delta norm {size:.4g} exceeds {k:g} x the largest median {size_reference:.4g} "
            f"of the learners' recent accepted ones, whatever the steps (claimed {steps})"
            + _held(held),
        )
    return NormVerdict(True, f"delta norm {size:.4g} within bounds")


def _held(held: float) -> str:
    return f" (with {held:.4g} already in the round)" if held else ""


def plausible_steps(
    steps: int, elapsed_s: float, fastest_step_s: float, *, slack: int = STEP_SLACK
) -> int:
    """The steps the guard takes a delta to cover: the claimed ``steps``, at most what the
    syncer's clock allows: ``elapsed_s`` (since the delta's steps can have begun) at one step
    per ``fastest_step_s`` (the shortest step time the syncer credits the learner with,
    ``syncer.pace.fastest_step_s``), plus ``slack`` steps.

    A learner's step count is its own claim, and a larger one makes a larger delta look
    ordinary (a smaller per-step norm, a larger fragment bound). Only the guard uses the
    bound; the merge weights and the accounting keep the claim.

    >>> plausible_steps(1 << 24, elapsed_s=1.0, fastest_step_s=0.025)
    42
    >>> plausible_steps(30, elapsed_s=1.0, fastest_step_s=0.025)
    30
    >>> plausible_steps(1 << 24, elapsed_s=0.0, fastest_step_s=0.025)
    2
    """
    if not fastest_step_s > 0:
        raise ValueError(f"fastest_step_s must be > 0, got {fastest_step_s}")
    bound = max(elapsed_s, 0.0) / fastest_step_s + slack
    return max(1, min(steps, math.ceil(bound)))


def covers_a_period(steps: int, sync_every: int) -> bool:
    """Whether an accepted delta's size enters the size reference (check 3): on the syncer's
    clock (``sync_every`` = H > 0), only a delta of at least H/2 steps does.

    Why: a fragment's first delta after a join covers the steps since the join, a few of the
    lr warm-up for an early fragment. With H = 96 (2026-11-27, bench_quality) those sizes
    became the reference, every later delta of a whole period was more than k x it and
    refused, and refused deltas never enter the history: three fragments never merged
    again. Leaving short deltas out takes nothing from check 3: a claim of many steps is
    remembered as before, a claim of few is only not remembered (and check 1 still judges
    it per step). With the learners' schedule (``sync_every`` 0) every delta counts.

    >>> covers_a_period(4, 96), covers_a_period(48, 96), covers_a_period(1, 0)
    (False, True, True)
    """
    return 2 * steps >= sync_every


class NormHistory:
    """The last ``window`` accepted non-zero norms of every fragment, per learner: per step
    (check 1) and whole (check 3)."""

    def __init__(self, num_fragments: int, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self.window = window
        self._norms: list[dict[str, deque[float]]] = [{} for _ in range(num_fragments)]
        self._sizes: list[dict[str, deque[float]]] = [{} for _ in range(num_fragments)]

    def of(self, fragment: int) -> dict[str, tuple[float, ...]]:
        """Each learner's remembered per-step norms of ``fragment`` (oldest first)."""
        return {lid: tuple(q) for lid, q in sorted(self._norms[fragment].items())}

    def record(
        self, fragment: int, norm: float, steps: int, learner: str = "", *, sync_every: int = 0
    ) -> None:
        """Remember an accepted norm; a zero one is not remembered (it says nothing of scale).
        Its size (check 3) only if it covers a period (:func:`covers_a_period`)."""
        if norm > 0:
            tables = [(self._norms, float(norm) / max(steps, 1))]
            if covers_a_period(steps, sync_every):
                tables.append((self._sizes, float(norm)))
            for table, value in tables:
                queue = table[fragment].setdefault(learner, deque(maxlen=self.window))
                queue.append(value)

    def forget_sizes(self) -> None:
        """Drop every remembered size (check 3): the period they covered has changed."""
        for by_learner in self._sizes:
            by_learner.clear()

    def forget(self, learner: str) -> None:
        """Drop a learner's norms (its id was forgotten by the syncer)."""
        for by_learner in (*self._norms, *self._sizes):
            by_learner.pop(learner, None)

    def reference(
        self, fragment: int, min_history: int = DEFAULT_MIN_HISTORY, *, judged: str | None = None
    ) -> float | None:
        """The upper median over learners of each learner's median per-step norm, or ``None``
        while the fragment has fewer than ``min_history`` remembered norms in all.

        ``judged``: the learner whose delta the reference judges. Once at least two *other*
        learners hold norms of the fragment (``min_history`` of them in all), only theirs
        count: a learner's own accepted norms cannot vouch for its next delta (a corrupt
        delta that slipped in before the fragment had history was the upper median of it
        and one honest learner, and let every later one in), while the upper median of two
        or more others is never below what the upper median over all gave an honest
        learner with two others. With fewer others, all learners count (as before: a lone
        learner is judged by its own history, and of two learners neither alone judges the
        other, so one cannot get the other refused by flooding tiny deltas)."""
        by_learner = self._norms[fragment]
        if judged is not None:
            others = {lid: q for lid, q in by_learner.items() if lid != judged and q}
            if len(others) >= 2 and sum(len(q) for q in others.values()) >= max(min_history, 1):
                by_learner = others
        medians = self._medians(by_learner, min_history)
        return statistics.median_high(medians) if medians else None

    def size_reference(self, fragment: int, min_history: int = DEFAULT_MIN_HISTORY) -> float | None:
        """The largest over learners of each learner's median accepted norm (whole, not per
        step), or ``None`` while the fragment has fewer than ``min_history`` of them."""
        medians = self._medians(self._sizes[fragment], min_history)
        return max(medians) if medians else None

    @staticmethod
    def _medians(by_learner: dict[str, deque[float]], min_history: int) -> list[float]:
        if sum(len(q) for q in by_learner.values()) < max(min_history, 1):
            return []
        return [statistics.median(q) for q in by_learner.values() if q]

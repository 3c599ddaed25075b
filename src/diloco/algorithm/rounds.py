"""When a round closes, and whether a contribution is admitted: pure decisions.

A **round** collects contributions for one fragment. It closes when at least K contributions
are in AND the grace window after reaching quorum has passed, or at once when every live
learner has contributed. The grace window lets a learner that is just about to send join
the round instead of landing, stale, in the next one:

    grace = clip(γ · (τ·ξ_step − ξ_quorum − ξ_sync), 0, ξ_step)

with ξ_step a learner step, ξ_quorum the time from a round's first arrival to quorum, and
ξ_sync the merge + persist + broadcast time (running EMAs, see ``Ema``). The intuition: a
merged fragment is expected back at a learner within τ steps; whatever is left of that budget
after waiting for quorum and syncing can be spent waiting for stragglers, but never more than
one step. Before a step estimate exists the grace window is 0 (close at quorum): waiting on a
guess could only stall the first rounds. Missing ξ_quorum and ξ_sync count as 0.

Fewer than K learners live: the "every live learner has contributed" rule still closes the
round with the live ones, so training never stalls because of dead learners. A round whose
contributors all died is closed too (nobody else will come).

**Every round holding a quorum closes in bounded time.** On the syncer's clock only answers
(contributions that arrived after the round was asked for) count towards quorum: a late
contribution from the previous round rides along but must not close the round before the
learners asked have answered. A round that *holds* K contributions, answers or not, closes at
the latest ``max_open_s`` after it was first opened (``held_deadline``: one cycle of the
clock, the time until the fragment's turn comes again), so learners that sent early and then
went silent (live, but never answering) cannot hold their own progress back forever.

**Staleness.** A contribution computed against version ``b`` of a fragment whose current
version is ``v`` has staleness ``s = v − b``. ``s = 0`` is fresh; ``1 ≤ s ≤ max_staleness`` is
accepted with its weight multiplied by ``1 / (1 + s)`` (its anchor is ``s`` commits old, so it
partly repeats progress the global model already has); beyond that it is refused and the
learner is told to resync. A base version from the future is invalid.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Estimates:
    """Running estimates in seconds; ``None`` until the first measurement."""

    step_s: float | None = None
    quorum_s: float | None = None
    sync_s: float | None = None


@dataclass(frozen=True)
class OpenRound:
    """What ``decide_round`` needs to know of an open round."""

    contributors: frozenset[str]
    """Learner ids with a contribution in the round."""
    opened_at: float
    """Time of the round's first arrival."""
    quorum_at: float | None = None
    """Time the round first reached quorum, or ``None``."""
    held: int = 0
    """Contributions in the round, answers or not (0: count only ``contributors``)."""
    first_opened_at: float | None = None
    """When the round was first opened (a round asked again keeps it; None: ``opened_at``)."""


@dataclass(frozen=True)
class RoundDecision:
    close: bool
    """Close the round now."""
    wait_until: float | None
    """If not closing: the time to decide again (``None``: on the next arrival or liveness change)."""
    reason: str
    grace_s: float
    """The grace window used for this decision (seconds)."""


def grace_window(estimates: Estimates, *, gamma: float, tau: float) -> float:
    """``clip(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, ξ_step)``; 0 before a step estimate exists."""
    if estimates.step_s is None:
        return 0.0
    step = estimates.step_s
    raw = gamma * (tau * step - (estimates.quorum_s or 0.0) - (estimates.sync_s or 0.0))
    return min(max(raw, 0.0), step)


def decide_round(
    now: float,
    round_: OpenRound | None,
    live: Collection[str],
    *,
    quorum: int,
    gamma: float,
    tau: float,
    estimates: Estimates,
    max_open_s: float | None = None,
) -> RoundDecision:
    """Decide whether the open round of one fragment closes now (see the module docstring).

    ``live`` are the learner ids whose lease is valid at ``now``; ``quorum`` is K (≥ 1);
    ``max_open_s``: how long a round that holds K contributions (``round_.held``) may stay
    open without a quorum of answers (None: no bound).
    """
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    grace = grace_window(estimates, gamma=gamma, tau=tau)
    held_until = held_deadline(round_, quorum, max_open_s)
    if round_ is None or not round_.contributors:
        if held_until is not None:
            return _held(now, held_until, round_, grace)
        return RoundDecision(False, None, "no contributions yet", grace)
    n = len(round_.contributors)
    if all(learner in round_.contributors for learner in live):
        why = "every live learner has contributed" if live else "no learner is live"
        return RoundDecision(True, None, f"{why} ({n} in round)", grace)
    if n < quorum:
        if held_until is not None:
            return _held(now, held_until, round_, grace)
        return RoundDecision(False, None, f"waiting for quorum ({n}/{quorum})", grace)
    quorum_at = round_.quorum_at if round_.quorum_at is not None else now
    deadline = quorum_at + grace
    if now >= deadline:
        return RoundDecision(
            True, None, f"quorum {n}/{quorum} and grace {grace:.3f}s elapsed", grace
        )
    return RoundDecision(False, deadline, f"quorum {n}/{quorum}, grace until {deadline:.3f}", grace)


def held_deadline(round_: OpenRound | None, quorum: int, max_open_s: float | None):
    """When a round holding at least ``quorum`` contributions (answers or not) closes at the
    latest: ``max_open_s`` after it was first opened; None when there is no such bound."""
    if round_ is None or max_open_s is None or round_.held < quorum:
        return None
    first = round_.first_opened_at if round_.first_opened_at is not None else round_.opened_at
    return first + max_open_s


def _held(now: float, until: float, round_: OpenRound, grace: float) -> RoundDecision:
    if now >= until:
        why = f"it held {round_.held} contributions for its longest wait"
        return RoundDecision(True, None, why, grace)
    return RoundDecision(False, until, f"{round_.held} held, closing by {until:.3f}", grace)


@dataclass(frozen=True)
class Admission:
    accept: bool
    discount: float
    """Multiplier on the contribution's weight (1 when fresh, 0 when refused)."""
    staleness: int
    resync: bool
    """Refused because too stale: the learner should pull the fragment again."""
    reason: str
    version: int | None = None
    """The fragment's version when the syncer admitted it (set by the syncer's state)."""
    fate_unknown: bool = False
    """Not admitted: a resend whose earlier send may have been merged, by a commit whose log
    is no longer kept (``diloco.syncer.receipts``): neither merged nor to be sent again."""


def staleness_discount(staleness: int) -> float:
    """Weight multiplier for a contribution ``staleness`` commits behind: ``1 / (1 + s)``."""
    return 1.0 / (1.0 + staleness)


def admit_contribution(
    *, base_version: int, current_version: int, max_staleness: int = 2
) -> Admission:
    """Admit a contribution computed against ``base_version`` of a fragment now at ``current_version``."""
    s = current_version - base_version
    if base_version < 0 or s < 0:
        return Admission(
            False,
            0.0,
            s,
            False,
            f"base version {base_version} is not a committed version (current {current_version})",
        )
    if s == 0:
        return Admission(True, 1.0, 0, False, "fresh")
    if s <= max_staleness:
        d = staleness_discount(s)
        return Admission(True, d, s, False, f"stale by {s}, weight x{d:.3f}")
    return Admission(False, 0.0, s, True, f"stale by {s} > {max_staleness}: resync the fragment")


SCHEDULES = ("syncer", "learner")
"""Who drives the rounds (``SyncerConfig.schedule``): the syncer's clock or the learners'
step counts."""

MIN_TICK_S = 1e-3
MAX_TICK_S = 60.0
"""Bounds of the syncer's tick period (seconds): a wrong step estimate can neither flood the
learners with requests nor stop the rounds for longer than a minute."""


def fleet_step_time(step_times: Iterable[float | None]) -> float | None:
    """The fleet's step time: the lower median of the live learners' step times (seconds).

    A median so that neither one slow learner nor one that reports nonsense moves the pace;
    the *lower* one because a learner's step time is its own claim: claiming to be slow
    would stretch the tick period and the grace window (up to minutes: rounds stop closing),
    so with two learners the faster one sets the pace, and only a majority can slow it.
    ``None`` (and non-positive values) are learners without a measurement yet. ``None`` when
    nobody has one.

    >>> fleet_step_time([0.2, 0.3, None, 9.0])
    0.3
    >>> fleet_step_time([0.2, 3599.0])
    0.2
    """
    known = [t for t in step_times if t is not None and t > 0]
    return statistics.median_low(known) if known else None


def tick_period(step_s: float | None, *, sync_every: int, fragments: int) -> float | None:
    """Seconds between two ticks of the syncer's clock, or ``None`` (no estimate: no ticks).

    Every fragment's round should open once per ``sync_every`` (H) fleet steps, so the clock
    opens one of the syncer's ``fragments`` fragments every ``H·ξ_step / fragments`` seconds
    (one per learner step at P = H), clipped to [``MIN_TICK_S``, ``MAX_TICK_S``].

    >>> tick_period(0.3, sync_every=24, fragments=24)
    0.3
    >>> tick_period(None, sync_every=24, fragments=24) is None
    True
    """
    if sync_every < 1 or fragments < 1:
        raise ValueError(f"sync_every and fragments must be >= 1, got {sync_every}, {fragments}")
    if step_s is None or not step_s > 0:
        return None
    return min(max(step_s * sync_every / fragments, MIN_TICK_S), MAX_TICK_S)


def scheduled_sync_every(
    cycles: float, *, sync_every: int, early_sync_every: int = 0, early_cycles: int = 0
) -> int:
    """H for the syncer's clock after ``cycles`` cycles (a cycle: each served fragment merged
    once; the mean of their versions): ``early_sync_every`` for the first ``early_cycles``,
    ``sync_every`` after (an H schedule: short periods while the model changes fast). Pure.

    >>> [scheduled_sync_every(c, sync_every=24, early_sync_every=8, early_cycles=10) for c in (0, 9.9, 10)]
    [8, 8, 24]
    """
    if early_sync_every > 0 and cycles < early_cycles:
        return early_sync_every
    return sync_every


@dataclass(frozen=True)
class Tick:
    fragment: int | None
    """The fragment whose round opens now (``None``: not now)."""
    next_at: float | None
    """When to tick again (``None``: no estimate of the pace yet)."""
    cursor: int
    """Index in the served fragments of the fragment the next tick considers."""
    reason: str
    lost: float = 0.0
    """Due ticks this one did not make, in periods: those a stall passed over beyond
    ``MAKE_UP_TICKS`` (a fraction when the beat moves), and this one itself when every
    fragment still had an open round."""


MAKE_UP_TICKS = 2
"""Ticks a late tick may make up: on a 1B tape (P = 24, M = 4, a tick every 0.667 s) the
clock lost four ticks in 128 s to intervals of 2.1 to 2.4 periods, while commits held the
committer's thread, when one was made up."""


def next_tick(
    now: float,
    *,
    due_at: float | None,
    period: float | None,
    cursor: int,
    served: list[int],
    open_fragments: Collection[int],
) -> Tick:
    """The syncer's clock: which fragment's round opens at ``now``, if any.

    Fragments are taken in turn (``served[cursor]``); a fragment whose previous round is
    still open is skipped this turn (its learners are still answering), so at most one round
    per fragment is open. ``due_at`` is when this tick was due (``None``: the first tick,
    due now). A tick a period or more late makes up the ticks it passed over, at most
    ``MAKE_UP_TICKS`` of them: the next is due on the period's beat, but never more than
    ``MAKE_UP_TICKS − 1`` periods before ``now`` (so that many come at once), and from the
    last the period runs again. So commits that held the clock back cost no round, a longer
    stall no more than a short burst.
    """
    if period is None:
        return Tick(None, None, cursor, "no step estimate yet")
    if due_at is not None and now < due_at:
        return Tick(None, due_at, cursor, "not yet")
    start = due_at if due_at is not None else now
    next_at = max(start + period, now - (MAKE_UP_TICKS - 1) * period)
    passed_over = (next_at - (start + period)) / period
    n = len(served)
    for k in range(n):
        p = served[(cursor + k) % n]
        if p not in open_fragments:
            return Tick(p, next_at, (cursor + k + 1) % n, f"fragment {p}'s turn", passed_over)
    return Tick(None, next_at, cursor, "every fragment has an open round", passed_over + 1)


class RoundClock:
    """The syncer's clock as a part that owns its state: when the next tick is due, the
    period that was set with, whose turn it is, and the due ticks lost so far. Each call is
    ``next_tick`` with the clock read by the caller (``now``)."""

    def __init__(self) -> None:
        self.due_at: float | None = None
        """When the next tick is due (``None``: the first tick, due at once)."""
        self.period: float | None = None
        """The period ``due_at`` was set with."""
        self.cursor = 0
        """Index in the served fragments of the fragment the next tick considers."""
        self.lost = 0.0
        """Due ticks lost while learners were live, in periods (``Tick.lost``, summed): a
        syncer that makes every due commit keeps this at 0."""

    def tick(
        self,
        now: float,
        period: float | None,
        served: list[int],
        open_fragments: Collection[int],
        live: bool,
    ) -> Tick:
        """The tick at ``now`` at ``period`` (``tick_period``). When the pace rose, the due
        tick comes sooner too, but not before ``now``: a tick owed then is made now, and the
        whole periods since it was due count as lost (a tick a few ms late loses none).
        ``live``: some learner can be asked (with none, no round opens and no tick counts as
        lost)."""
        due, lost = self.due_at, 0.0
        if due is not None and period is not None and period < (self.period or 0.0):
            lost = float(max(0, math.floor((now - due) / period)))  # (owed: its beat moves)
            due = max(now, due - (self.period - period))
        self.period = period
        t = next_tick(
            now,
            due_at=due,
            period=period,
            cursor=self.cursor,
            served=served,
            open_fragments=open_fragments if live else served,
        )
        self.due_at, self.cursor = t.next_at, t.cursor
        if live:
            self.lost += t.lost + lost
        return t


class Ema:
    """Exponential moving average; ``value`` is ``None`` until the first update."""

    def __init__(self, decay: float = 0.8) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.value: float | None = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x
        return self.value

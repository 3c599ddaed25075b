"""The syncer's learner table: who joined, with which session, who is live, who is gone.

A part :class:`diloco.syncer.state.SyncerState` holds (``state.roster``). It owns the learner
records (``learners``), the highest generation each id joined with (``generations``), when
this syncer committed each fragment's recent versions (``commit_times``) and the fleet's
measured pace (``fleet_pace``): the decisions about membership and about the pace the
syncer believes of each learner (``syncer.pace``) live here, the rounds in ``state.py``.
What it needs of the rest of the state it is given at construction (``record``, ``waiting``,
``on_forget``) or per call (``finals_due``'s longest wait). Not thread-safe: callers hold
the state's lock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Sequence

from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.guard import plausible_steps
from diloco.algorithm.rounds import fleet_step_time
from diloco.syncer.config import SyncerConfig
from diloco.syncer.generations import Generations
from diloco.syncer.pace import (
    CommitTimes,
    FleetPace,
    believed_step_s,
    fastest_step_s,
    steps_since,
)
from diloco.syncer.records import (
    MAX_STEP_TIME_S,
    LearnerInfo,
    Refused,
    check_id,
    span,
    update_rate,
)


class LearnerRoster:
    """Join, heartbeat, leave, lease expiry, the live set and the learners' pace (see the
    module docstring)."""

    def __init__(
        self,
        config: SyncerConfig,
        layout: FragmentLayout,
        *,
        record: Callable[..., None],
        waiting: Callable[[], Collection[str]],
        on_forget: Callable[[str], None],
    ) -> None:
        """``record(event, now, **fields)``: puts its records (``join``, ``leave``,
        ``expire``, ...) on the tape (``SyncerState.record``). ``waiting()``: the ids with a contribution waiting in an open
        round (never taken out of a full table). ``on_forget(learner_id)``: called when an
        id leaves the table (the norm guard forgets its history)."""
        self.config = config
        self.layout = layout
        self.record = record
        self.waiting = waiting
        self.on_forget = on_forget
        self.learners: dict[str, LearnerInfo] = {}
        """Every known learner id's record (live or gone), by id."""
        self.generations = Generations()
        """The highest generation each learner id joined with (``syncer.generations``)."""
        self.commit_times = CommitTimes(config.max_staleness + 1)
        """When this syncer committed each fragment's versions a delta may still be taken
        against (``note_commit``)."""
        self.fleet_pace = FleetPace()
        """The fleet's measured step time, measured at most every ``pace.PACE_SPAN_S``."""

    def join(
        self,
        learner_id: str,
        *,
        tensors: Sequence[tuple[str, tuple[int, ...], str]],
        layout_hash: str,
        num_fragments: int,
        observer: bool,
        now: float,
        tokens_per_step: int = 0,
        generation: int = 0,
    ) -> LearnerInfo:
        """Admit a learner (or observer) whose model matches the layout; returns its record.

        Raises ``Refused("FAILED_PRECONDITION", ...)`` naming the first mismatching tensor.
        A learner that joins again gets a new session; its previous one is forgotten. When
        the table holds ``max_learner_ids`` ids, a new id takes the place of the one gone the
        longest (``_longest_gone``); only a table of live ids refuses it.
        ``tokens_per_step`` (0: not declared: its first contribution sets the bound,
        ``records.tokens_per_step_bound``) bounds the tokens per step it may claim.
        ``generation``: which process of the id joins (``diloco.syncer.generations``; 0: not
        given); a lower one than an earlier join's is refused for good, nothing changed.
        """
        check_id(learner_id)
        if not 0 <= tokens_per_step <= self.config.max_tokens_per_step:
            raise Refused(
                "INVALID_ARGUMENT",
                f"tokens_per_step must be in [0, {self.config.max_tokens_per_step}], "
                f"got {tokens_per_step}",
            )
        if num_fragments != self.layout.num_fragments:
            raise Refused(
                "FAILED_PRECONDITION",
                f"the syncer uses {self.layout.num_fragments} fragments, learner asked for {num_fragments}",
            )
        try:
            self.layout.check_compatible(tensors)
        except ValueError as exc:
            raise Refused(
                "FAILED_PRECONDITION", f"model does not match the syncer's: {exc}"
            ) from None
        if layout_hash != self.layout.hash:
            raise Refused(
                "FAILED_PRECONDITION",
                "layout hash differs although tensors match: different fragmentation",
            )
        self.generations.admit(learner_id, generation)  # (a superseded process: Refused)
        old = self.learners.get(learner_id)
        if old is None and len(self.learners) >= self.config.max_learner_ids:
            gone = self._longest_gone(now)
            if gone is None:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    f"the syncer already knows {len(self.learners)} learner ids "
                    "(max_learner_ids), all live",
                )
            self.forget(gone, now=now, reason="the learner table is full")
        info = LearnerInfo(
            learner_id,
            uuid.uuid4().hex,
            joined_at=now,
            last_seen=now,
            observer=observer,
            tokens_per_step=tokens_per_step,
        )
        info.first_joined_at = now
        if old is not None:
            info.contributions, info.bytes_up, info.bytes_down = (
                old.contributions,
                old.bytes_up,
                old.bytes_down,
            )
            info.accepted_at, info.first_joined_at = old.accepted_at, old.first_joined_at
            info.steps_from, info.pace = old.steps_from, old.pace
            info.pace.restart()
            info.verdicts = old.verdicts
            info.learned_tokens_per_step = old.learned_tokens_per_step
        self.learners[learner_id] = info
        self.record("join", now, learner=learner_id, observer=observer, rejoin=old is not None)
        return info

    def session_of(self, learner_id: str, session: str) -> LearnerInfo:
        """The record of ``learner_id`` joined as ``session``; ``Refused`` otherwise."""
        info = self.learners.get(learner_id)
        if info is None or info.session != session:
            raise Refused(
                "FAILED_PRECONDITION", f"unknown session for learner {learner_id!r}: join first"
            )
        return info

    def heartbeat(
        self,
        learner_id: str,
        session: str,
        *,
        now: float,
        step: int = 0,
        tokens: int = 0,
        steps_per_s: float = 0.0,
        state: str = "",
    ) -> LearnerInfo:
        """A heartbeat of ``session``: the learner is seen at ``now``, with its step counter,
        tokens, claimed pace and state (``Refused`` for an unknown session, nothing
        changed); a live learner whose lease had expired is live again."""
        info = self.session_of(learner_id, session)
        info.last_seen = now
        info.step, info.tokens, info.steps_per_s = step, tokens, steps_per_s
        if info.connected:
            info.state = state[:64] or info.state
        elif info.state != "left":  # alive, but its subscription closed: it resubscribes
            info.state = "no subscription"
        info.pace.observe(now, step)
        if steps_per_s > 0:
            self.believe_step_time(info, 1.0 / steps_per_s, now)
        update_rate(info, now, tokens, self.config.ema_decay)
        if not info.live and info.connected:
            info.live = True
            self.record("revive", now, learner=learner_id)
        return info

    def believe_step_time(self, info: LearnerInfo, claimed_s: float, now: float) -> None:
        """Take ``info``'s claimed step time (a heartbeat's, an upload's) for the clock's
        pace, clamped around what the syncer measured (``pace.believed_step_s``)."""
        fleet = self.measured_step_s(now)
        info.step_s = min(believed_step_s(claimed_s, info.pace.step_s, fleet), MAX_STEP_TIME_S)

    def measured_step_s(self, now: float) -> float | None:
        """The fleet's measured step time: the lower median of the live learners' (``pace``)."""
        return self.fleet_pace.step_s(
            now, lambda: fleet_step_time(self.learners[lid].pace.step_s for lid in self.live(now))
        )

    def credited_steps(self, info: LearnerInfo, fragment: int, steps: int, now: float) -> int:
        """The steps the norm guard takes ``info``'s delta of ``fragment`` claiming ``steps``
        to cover: at most what its measured pace allows since they can have begun
        (``guard.plausible_steps``, ``pace.fastest_step_s``, ``pace.steps_since``)."""
        joined = info.first_joined_at if info.first_joined_at is not None else now
        since = steps_since(info.steps_from.get(fragment), joined)
        fastest = fastest_step_s(info.pace.step_s, self.measured_step_s(now))
        return plausible_steps(steps, now - since, fastest)

    def credit_note(self, info: LearnerInfo, fragment: int, steps: int, now: float) -> str:
        """Why ``credited_steps`` gave fewer steps than claimed (for a refusal's reason);
        empty when it gave them all."""
        credited = self.credited_steps(info, fragment, steps, now)
        if credited >= steps:
            return ""
        joined = info.first_joined_at if info.first_joined_at is not None else now
        since = steps_since(info.steps_from.get(fragment), joined)
        fastest = fastest_step_s(info.pace.step_s, self.measured_step_s(now))
        return (
            f" (claimed {steps} steps, credited {credited}: {now - since:.3g} s since they "
            f"can have begun, at most one step per {fastest:.3g} s)"
        )

    def fleet_step_s(self, now: float | None = None) -> float | None:
        """The lower median of the live learners' step times as the clock believes them (all
        known ones if ``now`` is None): claims clamped around what the syncer measured
        (``believe_step_time``)."""
        live = self.live(now) if now is not None else None
        return fleet_step_time(
            i.step_s
            for lid, i in self.learners.items()
            if not i.observer and (live is None or lid in live)
        )

    def note_commit(self, fragment: int, version: int, now: float) -> None:
        """This syncer committed ``version`` of ``fragment`` at ``now``: the steps of a delta
        taken against it begin then (``note_accepted``)."""
        self.commit_times.note(fragment, version, now)

    def note_accepted(self, info: LearnerInfo, fragment: int, base_version: int) -> None:
        """``info``'s delta of ``fragment`` against ``base_version`` was accepted: the steps
        of its next one begin after that version's commit (``pace.steps_since``)."""
        committed_at = self.commit_times.at(fragment, base_version)
        if committed_at is None:
            info.steps_from.pop(fragment, None)
        else:
            info.steps_from[fragment] = committed_at

    def leave(self, learner_id: str, session: str, *, now: float, reason: str = "left") -> None:
        """Mark a learner gone (clean leave or its stream closed). Unknown sessions are ignored.
        A clean leave that comes after its stream closed still says "left" (synchronous mode
        stops waiting for a learner that left, not for one whose stream closed)."""
        info = self.learners.get(learner_id)
        if info is None or info.session != session:
            return
        if not info.connected:
            if reason == "left":
                info.state = reason
            return
        info.connected = False
        info.live = False
        info.state = reason
        self.record("leave", now, learner=learner_id, reason=reason)

    def expire(self, now: float) -> None:
        """Drop learners whose lease ran out from the live set (they may come back)."""
        for info in self.learners.values():
            if info.live and now - info.last_seen > self.config.lease_s:
                info.live = False
                info.state = "lease expired"
                silent_s = round(now - info.last_seen, 3)
                self.record("expire", now, learner=info.learner_id, silent_s=silent_s)

    def live(self, now: float) -> set[str]:
        """Ids of live learners at ``now`` that answer requests (not observers, not stopping)."""
        lease = self.config.lease_s
        return {
            i.learner_id
            for i in self.learners.values()
            if i.live and not (i.observer or i.stopping) and now - i.last_seen <= lease
        }

    def check_final_fragments(self, final: bool, final_fragments: Collection[int]) -> None:
        """``final_fragments`` come with a final upload, each a fragment of the layout, once
        (``Refused`` otherwise, before anything changes)."""
        if not final_fragments:
            return
        count = self.layout.num_fragments
        if not final:
            raise Refused("INVALID_ARGUMENT", "final_fragments need a final upload")
        if len(set(final_fragments)) != len(final_fragments) or not all(
            0 <= p < count for p in final_fragments
        ):
            raise Refused(
                "INVALID_ARGUMENT",
                f"final_fragments must be distinct fragments in [0, {count}), "
                f"got {span(sorted(final_fragments))}",
            )

    def finals_due(self, fragment: int, now: float, longest_wait_s: float) -> dict[str, float]:
        """The stopping learners whose finals named ``fragment`` and whose final for it has
        not been admitted, each with the time it stops being waited for: its lease running
        out (it heartbeats while it flushes) or ``longest_wait_s`` (one of the clock's
        longest waits; at least the lease) after its first final arrived, whichever comes
        first. A learner that leaves or whose stream closes is not waited for."""
        lease = self.config.lease_s
        longest = max(longest_wait_s, lease)
        due = {}
        for lid, i in self.learners.items():
            if not (i.stopping and i.connected and fragment in i.finals_due):
                continue
            until = min(i.last_seen + lease, (i.stopping_since or now) + longest)
            if now < until:
                due[lid] = until
        return due

    def note_final(
        self,
        info: LearnerInfo,
        fragment: int,
        final: bool,
        final_fragments: Collection[int],
        *,
        now: float,
        settled: bool,
    ) -> None:
        """A valid upload of ``fragment`` arrived from ``info``'s learner. A *final* one makes
        it stopping (the first: a ``stopping`` record) and adds the finals it names that this
        session has not delivered to ``finals_due``; once admitted (``settled``; a stale
        one will be sent again) it is delivered. Other uploads change nothing here."""
        if not final:
            return
        if not info.stopping:
            info.stopping, info.stopping_since = True, now
            finals = sorted(final_fragments)
            self.record("stopping", now, learner=info.learner_id, finals=finals)
        info.finals_due |= set(final_fragments) - info.finals_delivered
        if settled:
            info.finals_delivered.add(fragment)
            info.finals_due.discard(fragment)

    def forget_final(self, info: LearnerInfo, fragment: int, final: bool) -> None:
        """A final of a stopping learner was refused: it will not be sent again, so nothing
        waits for it. (A refused upload never makes a learner stopping.)"""
        if final and info.stopping:
            info.finals_delivered.add(fragment)
            info.finals_due.discard(fragment)

    def forget(self, learner_id: str, *, now: float, reason: str) -> None:
        """Remove an id from the table (``on_forget`` is told; a ``forget`` record)."""
        if self.learners.pop(learner_id, None) is not None:
            self.on_forget(learner_id)
            self.record("forget", now, learner=learner_id, reason=reason)

    def _longest_gone(self, now: float) -> str | None:
        """The id whose holder is gone (left, stream closed or lease expired) the longest and
        that has nothing waiting in an open round; ``None`` when there is none."""
        waiting = set(self.waiting())
        lease = self.config.lease_s
        gone = [
            (i.last_seen, lid)
            for lid, i in self.learners.items()
            if (not i.connected or now - i.last_seen > lease) and lid not in waiting
        ]
        return min(gone)[1] if gone else None

    def finished(self, waited_for: Collection[str]) -> int:
        """How many learners left cleanly after contributing and are not in ``waited_for``
        (a synchronous round's contributors): they finished their work and will not
        contribute again. A dead learner is not counted (it comes back), nor an id that only
        joined and left, nor an observer."""
        return sum(
            1
            for lid, i in self.learners.items()
            if i.state == "left" and i.contributions and not i.observer and lid not in waited_for
        )

    def recent_contributors(self, now: float) -> set[str]:
        """Ids with an accepted delta within the last cycle of the syncer's clock, doubled
        (``2 · H · ξ_step``, at least the lease): the learners a round's share counts. An id
        that joins and heartbeats but never contributes dilutes nothing."""
        step = self.fleet_step_s() or 0.0
        window = max(2 * self.config.protocol.sync_every * step, self.config.lease_s)
        return {
            lid
            for lid, i in self.learners.items()
            if i.accepted_at and now - max(i.accepted_at.values()) <= window
        }

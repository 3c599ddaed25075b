"""The syncer's state machine: learners, open rounds, commits. No sockets, no sleeps.

Every method takes ``now`` (seconds on a monotonic clock: the server passes
``diloco.runtime.clock.monotonic()``) so tests drive it with a fake clock. The gRPC server
(``server.py``) only decodes requests, calls these methods under one lock, persists commits
and broadcasts them.

Per fragment p the state holds the global value Θ_p (fp32, the single source of truth), its
version, the outer optimizer's momentum and at most one round. A round collects one
contribution per learner (a later increment from the same learner is added to its earlier
one, deltas and counters alike, so no progress is dropped) and closes as
``diloco.algorithm.rounds.decide_round`` says; closing merges the contributions with capped
token weights (× staleness discount), applies the outer Nesterov step and bumps the version.

With the syncer's schedule (the default) rounds open on the syncer's clock (``tick``): each
tick opens the next fragment's round and names the live learners it asks; a contribution
that arrives while its fragment has no open round waits in the fragment's next round.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Collection, Sequence

import torch

from diloco.algorithm.encoded_delta import EncodedDelta
from diloco.algorithm.fragments import FragmentLayout, fragment_digest
from diloco.algorithm.guard import NormHistory, check_norm
from diloco.algorithm.outer import NesterovOuter
from diloco.algorithm.rounds import (
    Admission,
    Ema,
    Estimates,
    OpenRound,
    RoundClock,
    admit_contribution,
    decide_round,
    scheduled_sync_every,
    tick_period,
)
from diloco.algorithm.shards import shard_fragments
from diloco.syncer.closing import RoundClosing
from diloco.syncer.config import SyncerConfig
from diloco.syncer.model import GlobalModel
from diloco.syncer.receipts import Receipts, UploadPart
from diloco.syncer.records import (
    Closing,
    Commit,
    Contribution,
    FragmentRound,
    LearnerInfo,
    Refused,
    RoundRequest,
    check_counters,
    check_room_in_round,
    learn_tokens_per_step,
    norm_of,
    span,
    state_digest,
)
from diloco.syncer.roster import LearnerRoster

__all__ = ["Closing", "Commit", "Contribution", "FragmentRound", "LearnerInfo", "Refused"]
__all__ += ["RoundRequest", "SyncerState", "fragment_digest"]


class SyncerState:
    """All mutable state of one syncer. Not thread-safe: callers hold one lock.

    Its parts own their state: ``model`` (``syncer.model.GlobalModel``) Θ_p, the versions
    and the outer optimizer; ``roster`` (``syncer.roster.LearnerRoster``) the learners,
    their generations and pace; ``closing`` (``syncer.closing.RoundClosing``) how a closed
    round is merged and committed, and the commit logs; the state itself the open rounds,
    the norm guard, the receipts and the syncer's clock. The learners' requests (``join``,
    ``heartbeat``, ``leave``, ``submit``) and the round's life (``tick``, ``poll``,
    ``close_rounds``, ``apply``) are the state's contract."""

    def __init__(
        self,
        layout: FragmentLayout,
        params: Sequence[torch.Tensor],
        config: SyncerConfig,
        *,
        versions: Sequence[int] | None = None,
        emit: Callable[[dict], None] = lambda record: None,
        fragments: Sequence[int] | None = None,
        shard: tuple[int, int] = (0, 1),
        embeddings: Collection[str] | None = None,
        wall_of: Callable[[float], float] = float,
    ) -> None:
        """``fragments`` (default: those of ``shard``) are the fragments this syncer owns;
        ``embeddings``: the parameter names merged by weighted mean (the model's embedding
        tables and output head, ``diloco.algorithm.embeddings``; None: the name rule
        ``diloco.algorithm.merge.is_embedding_name``). ``wall_of``: the wall time of a
        ``now`` (the server's: ``diloco.runtime.clock.wall_of``): decisions take ``now``
        from a monotonic clock, the records they emit carry ``t = wall_of(now)``; by
        default ``t = now`` (a test's fake clock)."""
        self.layout = layout
        self.config = config
        outer = NesterovOuter(lr=config.outer_lr, momentum=config.outer_momentum)
        self.model = GlobalModel(layout, params, outer, versions)
        """Θ_p, the versions and the outer optimizer (``syncer.model``)."""
        self.shard = shard
        """``(i, S)``: this syncer is shard i of S (``diloco.algorithm.shards``); (0, 1) unsharded."""
        if fragments is None:
            fragments = shard_fragments(layout.num_fragments, *shard)
        self.served = sorted(set(fragments))
        """Fragments this syncer owns: it takes uploads and broadcasts only for these."""
        self._owned = frozenset(self.served)
        if not self.served or len(self.served) != len(fragments):
            raise ValueError(f"fragments must be a non-empty list without repeats: {fragments}")
        if not 0 <= self.served[0] <= self.served[-1] < layout.num_fragments:
            raise ValueError(f"fragments must be in [0, {layout.num_fragments}): {fragments}")
        self.rounds: dict[int, FragmentRound] = {}
        self.norms = NormHistory(layout.num_fragments, config.norm_guard_window)
        self.emit = emit
        self.wall_of = wall_of
        self.syncer_id = uuid.uuid4().hex[:12]
        self.rounds_committed = 0
        self.refused = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._ema_quorum = Ema(config.ema_decay)
        self._ema_sync = Ema(config.ema_decay)
        self.clock = RoundClock()
        """The syncer's clock: the next tick and the due ticks lost (``rounds.RoundClock``)."""
        self.roster = LearnerRoster(
            config,
            layout,
            record=self.record,
            waiting=lambda: {lid for r in self.rounds.values() for lid in r.contributions},
            on_forget=self.norms.forget,
        )
        """The learner table (``syncer.roster``)."""
        pin_s = config.lease_s + config.commit_log_pin_s
        self.receipts = Receipts(config.commit_logs_kept, config.commit_logs_max, pin_s)
        """The fates of the learners' accepted uploads (``diloco.syncer.receipts``)."""
        self.closing = RoundClosing(
            config,
            layout,
            self.model,
            self.roster,
            served=self.served,
            embeddings=embeddings,
            wall_of=wall_of,
        )
        """How closed rounds are merged and committed; the commit logs (``syncer.closing``)."""
        self._period_now = self.sync_every()
        """The H the norm guard's sizes were recorded at (``note_period``)."""

    @property
    def params(self) -> list[torch.Tensor]:
        """Θ_p of each fragment (``GlobalModel.params``)."""
        return self.model.params

    @property
    def versions(self) -> list[int]:
        """Each fragment's version (``GlobalModel.versions``)."""
        return self.model.versions

    @property
    def outer(self) -> NesterovOuter:
        """The outer optimizer (``GlobalModel.outer``)."""
        return self.model.outer

    @property
    def learners(self) -> dict[str, LearnerInfo]:
        """Every known learner's record, by id (``LearnerRoster.learners``)."""
        return self.roster.learners

    def join(self, learner_id: str, **request) -> LearnerInfo:
        """Admit a learner (``LearnerRoster.join``: its contract and arguments)."""
        return self.roster.join(learner_id, **request)

    def heartbeat(self, learner_id: str, session: str, **beat) -> LearnerInfo:
        """A learner's heartbeat (``LearnerRoster.heartbeat``)."""
        return self.roster.heartbeat(learner_id, session, **beat)

    def leave(self, learner_id: str, session: str, *, now: float, reason: str = "left") -> None:
        """A learner leaves or its stream closed (``LearnerRoster.leave``)."""
        self.roster.leave(learner_id, session, now=now, reason=reason)

    def live(self, now: float) -> set[str]:
        """The live learners that answer requests (``LearnerRoster.live``)."""
        return self.roster.live(now)

    def finals_due(self, fragment: int, now: float) -> dict[str, float]:
        """``LearnerRoster.finals_due``, each waited for at most one of the clock's longest
        waits (``_longest_wait``)."""
        return self.roster.finals_due(fragment, now, self._longest_wait(self.estimates()))

    def logged_from(self) -> list[int]:
        """``Receipts.logged_from`` of the fragments this syncer owns."""
        return self.receipts.logged_from(self.layout.num_fragments, self._owned)

    def admission_version(self, fragment: int) -> int:
        """The version an upload of ``fragment`` accepted now is admitted at: the commit making
        the next version merges it. While a closed round of the fragment is being merged
        (``close_rounds`` took it, ``apply`` has not bumped the version yet) an upload lands
        in the round after it, so it is admitted at the version that round starts from."""
        return self.versions[fragment] + self.closing.merging(fragment)

    # ------------------------------------------------------------ contributions
    def submit(
        self,
        learner_id: str,
        session: str,
        *,
        fragment: int,
        base_version: int,
        steps: int,
        tokens: int,
        delta: torch.Tensor | EncodedDelta,
        step_time_s: float,
        nbytes: int,
        now: float,
        final: bool = False,
        upload_id: int = 0,
        delta_norm: float | None = None,
        final_fragments: Collection[int] = (),
        resend: bool = False,
    ) -> Admission:
        """Put a contribution into fragment ``fragment``'s open round: ``delta`` as the
        upload arrived (an ``EncodedDelta``: what the commit journal keeps), or decoded.

        ``delta_norm``: ``‖delta‖`` when the caller computed it already (outside the
        syncer's lock: the service does); computed here otherwise.

        Raises ``Refused`` for invalid requests (state unchanged); returns the admission
        (refused-as-stale contributions come back with ``resync=True``). On the syncer's
        schedule a contribution that finds no open round waits for the fragment's next tick;
        a ``final`` one (the learner is stopping and will not answer again) counts as its
        answer to that round, so learners that stop one after another are merged with the
        others and no extra round is made for them. ``final_fragments`` (with the first
        final upload of a session): every fragment its flush sends; while nobody is live, a
        round waits for those of them still on their way (``finals_due``), so a fleet that
        stops over slow links still merges one round per fragment. An ``upload_id`` the learner's accepted
        uploads already hold is a resend (its reply was lost): answered with the version it
        was admitted at, and nothing changes, whatever session it carries (the learner may
        have rejoined since its first send). A ``resend`` whose id the receipts do not hold
        and whose base version is older than the kept commit logs may have been merged by a
        commit whose log was let go: answered ``fate_unknown``, and nothing changes.
        """
        roster = self.roster
        roster.check_final_fragments(final, final_fragments)
        known = self.receipts.admitted(learner_id, upload_id, fragment)
        if known is not None or (resend and not self.receipts.fate_known(fragment, base_version)):
            answer = (learner_id, session, fragment, known)
            return self._answer_resend(*answer, now=now, final=(final, final_fragments))
        info = roster.session_of(learner_id, session)
        try:
            norm, credited = self._check_contribution(
                info,
                fragment,
                base_version,
                steps=steps,
                tokens=tokens,
                delta=delta,
                step_time_s=step_time_s,
                now=now,
                norm=delta_norm,
            )
        except Refused:
            roster.forget_final(info, fragment, final)  # (it will not come again)
            raise
        admission = admit_contribution(
            base_version=base_version,
            current_version=self.versions[fragment],
            max_staleness=self.config.max_staleness,
        )
        info.last_seen = now
        info.live = info.live or info.connected
        roster.note_final(info, fragment, final, final_fragments, now=now, settled=admission.accept)
        info.bytes_up += nbytes
        self.bytes_up += nbytes
        if step_time_s > 0:
            roster.believe_step_time(info, step_time_s, now)
        if not admission.accept:
            reason = admission.reason
            self.record("stale", now, learner=learner_id, fragment=fragment, reason=reason)
            return admission
        contribution = Contribution(
            learner_id,
            delta,
            base_version,
            steps,
            tokens,
            admission.discount,
            now,
            nbytes,
            final=final,
            credited=credited,
            uploads=[UploadPart(upload_id, steps, tokens)],
            norm=norm,
        )
        self._into_round(fragment, contribution, now)
        info.contributions += 1
        info.last_tokens = tokens
        learn_tokens_per_step(info, tokens=tokens, steps=steps)
        info.accepted_at[fragment] = now
        roster.note_accepted(info, fragment, base_version)
        admission = dataclasses.replace(admission, version=self.admission_version(fragment))
        self.receipts.admit(learner_id, upload_id, fragment, admission.version)
        self.norms.record(fragment, norm, credited, learner_id, sync_every=self._guard_period())
        return admission

    def _answer_resend(self, learner_id, session, fragment, known, *, now, final) -> Admission:
        """A resend the receipts answer: admitted at ``known``, or its fate unknown."""
        event = "resent" if known is not None else "fate_unknown"
        record = {"event": event, "learner": learner_id, "fragment": fragment}
        self.emit({**record, "t": self.wall_of(now)})
        if known is None:
            reason = "fate unknown: its base version is older than the commit logs kept"
            return Admission(False, 0.0, 0, False, reason, fate_unknown=True)
        info = self.learners.get(learner_id)
        if info is not None and info.session == session:
            self.roster.note_final(info, fragment, *final, now=now, settled=True)
        return Admission(True, 1.0, 0, False, "already accepted", known)

    def _into_round(self, fragment: int, contribution: Contribution, now: float) -> None:
        """Add an admitted contribution to ``fragment``'s round (made if none is open; on
        the syncer's clock it waits for the next tick). A learner's second contribution to
        one round is summed with its first (deltas and counters)."""
        round_ = self.rounds.get(fragment)
        if round_ is None:
            on_clock = self.config.schedule == "syncer"
            round_ = self.rounds[fragment] = FragmentRound(opened_at=None if on_clock else now)
        earlier = round_.contributions.get(contribution.learner_id)
        if earlier is None:
            round_.contributions[contribution.learner_id] = contribution
        else:
            earlier.add(contribution)
        self._note_quorum(round_, now)

    def _check_contribution(
        self, info, fragment, base_version, *, now, norm=None, **counters
    ) -> tuple[float, int]:
        """Refuse (``Refused``, nothing changed) what no round may hold: an observer's upload,
        a fragment another shard owns, bad counters, a base version that is not committed, an
        upload more than the learner's contribution to the open round may sum
        (``records.check_room_in_round``), a norm the guard refuses (judged over the steps the
        syncer credits the learner with, ``credited_steps``, and with what the learner's
        contribution already holds in the open round). Returns the delta's norm and the steps
        credited."""
        if info.observer:
            raise Refused("PERMISSION_DENIED", "observers cannot contribute")
        self.check_owned(fragment)
        numel = self.layout.fragments[fragment].numel
        check_counters(info, self.config, numel=numel, fragment=fragment, **counters)
        current = self.versions[fragment]
        if not 0 <= base_version <= current:
            raise Refused(
                "INVALID_ARGUMENT",
                f"base version {base_version} is outside [0, {current}]: negative, or ahead of the syncer's",
            )
        round_ = self.rounds.get(fragment)  # an earlier increment is summed with this one
        earlier = round_.contributions.get(info.learner_id) if round_ is not None else None
        check_room_in_round(earlier, fragment=fragment)
        norm = norm_of(counters["delta"]) if norm is None else norm
        steps = self.roster.credited_steps(info, fragment, counters["steps"], now)
        verdict = check_norm(
            norm,
            steps + (earlier.credited if earlier is not None else 0),
            self.norms.reference(
                fragment, self.config.norm_guard_min_history, judged=info.learner_id
            ),
            self.model.norm(fragment),
            numel=numel,
            size_reference=self.norms.size_reference(fragment, self.config.norm_guard_min_history),
            held=earlier.norm if earlier is not None else 0.0,
            k=self.config.norm_guard_k,
            param_ratio=self.config.norm_guard_param_ratio,
            max_ratio=self.config.norm_guard_max_ratio,
            zero_rms=self.config.norm_guard_zero_rms,
            sync_every=self._guard_period(),
        )
        if not verdict.accept:
            note = self.roster.credit_note(info, fragment, counters["steps"], now)
            raise Refused("OUT_OF_RANGE", f"fragment {fragment}: {verdict.reason}{note}")
        return norm, steps

    def sync_every(self) -> int:
        """H now: ``--sync-every``, or ``--early-sync-every`` for the clock's first
        ``--early-cycles`` cycles (``rounds.scheduled_sync_every``; cycles counted from the
        committed versions, so a restarted syncer resumes the schedule where it was)."""
        cfg = self.config
        if not cfg.early_sync_every:
            return cfg.protocol.sync_every
        cycles = sum(self.versions[p] for p in self.served) / max(len(self.served), 1)
        return scheduled_sync_every(
            cycles,
            sync_every=cfg.protocol.sync_every,
            early_sync_every=cfg.early_sync_every,
            early_cycles=cfg.early_cycles,
        )

    def note_period(self) -> None:
        """After a commit: when the H schedule moves on to another H, forget the norm guard's
        sizes (check 3). They covered periods of the old H: a delta of the new, longer one
        would be judged by them and, refused, never enter the history (the lock-out of
        ``guard.covers_a_period``)."""
        period = self.sync_every()
        if period != self._period_now:
            self._period_now = period
            self.norms.forget_sizes()

    def _guard_period(self) -> int:
        """H for the norm guard's step-scaled bounds: on the syncer's clock only (0: none)."""
        return self.sync_every() if self.config.schedule == "syncer" else 0

    def _note_quorum(self, round_: FragmentRound, now: float) -> None:
        if round_.opened_at is None or round_.quorum_at is not None:
            return
        if len(round_.answered()) >= min(self._quorum(), len(round_.asked or ()) or 1 << 30):
            round_.quorum_at = now
            self._ema_quorum.update(now - round_.opened_at)

    def check_owned(self, fragment: int) -> None:
        """Raise ``Refused`` unless this syncer (shard) owns ``fragment``."""
        if fragment not in self._owned:
            raise Refused(
                "INVALID_ARGUMENT",
                f"fragment {fragment} is not served by this syncer (shard {self.shard[0]}/"
                f"{self.shard[1]} owns {span(self.served)}): send it to its owner shard",
            )

    def note_refusal(
        self, learner_id: str, code: str, reason: str, now: float, *, rpc: str = ""
    ) -> None:
        """Count a refused request and put it on the tape (a ``refused`` record). Touches
        nothing that ``digest`` covers."""
        self.refused += 1
        learner_id, reason = learner_id[:64], reason[:300]
        self.record("refused", now, rpc=rpc, learner=learner_id, code=code, reason=reason)

    def record(self, event: str, now: float, **fields) -> None:
        """Put an ``event`` record on the tape (``emit``), stamped ``t = wall_of(now)``."""
        self.emit({"event": event, "t": self.wall_of(now), **fields})

    def digest(self) -> str:
        """SHA-256 over everything that shapes the global model (``records.state_digest``)."""
        return state_digest(self)

    # -------------------------------------------------------------------- rounds
    def estimates(self) -> Estimates:
        """The grace window's inputs: ξ_step is the fleet's step time (the lower median over
        learners: ``fleet_step_time``), ξ_quorum and ξ_sync the syncer's own measurements."""
        return Estimates(self.fleet_step_s(), self._ema_quorum.value, self._ema_sync.value)

    def fleet_step_s(self, now: float | None = None) -> float | None:
        """The fleet's step time as the clock believes it (``LearnerRoster.fleet_step_s``)."""
        return self.roster.fleet_step_s(now)

    def tick(self, now: float) -> tuple[RoundRequest | None, float | None]:
        """The syncer's clock (``schedule="syncer"``): open the round of the fragment whose
        turn it is and say whom to ask. Returns the request (``None``: no round opens now) and
        when to tick again (``None``: no step estimate yet, tick again on the next event)."""
        if self.config.schedule != "syncer":
            return None, None
        self.roster.expire(now)
        live = self.live(now)
        period = tick_period(
            self.fleet_step_s(now), sync_every=self.sync_every(), fragments=len(self.served)
        )
        # A round open with no answer when its turn comes again (its learners died or could
        # not answer) is asked again, unless it was asked under half a period ago (by the
        # tick before a made-up one); one with answers closes within its grace window.
        busy = [p for p, r in self.rounds.items() if r.busy(now, (period or 0.0) / 2)]
        t = self.clock.tick(now, period, self.served, busy, live=bool(live))
        if t.fragment is None:
            return None, t.next_at
        round_ = self.rounds.get(t.fragment)
        if round_ is None:
            round_ = self.rounds[t.fragment] = FragmentRound(opened_at=None)
        round_.opened_at, round_.asked = now, frozenset(live)
        if round_.first_opened_at is None:
            round_.first_opened_at = now
        self._note_quorum(round_, now)
        return RoundRequest(t.fragment, self.versions[t.fragment], frozenset(live)), t.next_at

    def record_sync_time(self, seconds: float) -> None:
        """Feed ξ_sync: measured merge + persist + broadcast time of one commit."""
        self._ema_sync.update(seconds)

    def _quorum(self) -> int:
        return self.config.wait_for_all or self.config.quorum

    def _decide(self, now: float, fragment: int, live: set[str], wait_for_finals: bool = True):
        round_ = self.rounds[fragment]
        if (
            not live
            and round_.contributions
            and wait_for_finals
            and self.config.schedule == "syncer"
        ):
            due = self.finals_due(fragment, now)  # (the fleet is stopping: one round each)
            if due:
                names = ", ".join(sorted(due))
                return False, min(due.values()), f"waiting for the final progress of {names}"
        if round_.opened_at is None:
            if live:
                return False, None, "waiting for the fragment's next tick"
            round_.opened_at = now  # nobody is left to ask: merge what waits
        if self.config.wait_for_all:  # synchronous DiLoCo: wait for everyone, no grace
            # ... who is still in the run: one that left cleanly has finished its work.
            need = max(1, self.config.wait_for_all - self.roster.finished(round_.contributions))
            n = len(round_.contributions)
            return n >= need, None, f"synchronous: {n}/{need} contributions"
        expected = live if round_.asked is None else live & round_.asked
        answered = round_.answered()
        if not expected:  # the learners it asked are gone: nobody else will answer
            answered = frozenset(round_.contributions)
        estimates = self.estimates()
        d = decide_round(
            now,
            OpenRound(
                answered,
                round_.opened_at,
                round_.quorum_at,
                held=len(round_.contributions),
                first_opened_at=round_.first_opened_at,
            ),
            expected,
            quorum=self.config.quorum,
            gamma=self.config.gamma,
            tau=self.config.tau,
            estimates=estimates,
            max_open_s=self._longest_wait(estimates),
        )
        return d.close, d.wait_until, d.reason

    def _longest_wait(self, estimates: Estimates) -> float:
        """How long a round holding a quorum may wait for answers: one cycle of the clock
        (``H`` fleet steps, when the fragment's turn comes again), at least τ steps; the
        lease before any step estimate exists."""
        period = tick_period(
            estimates.step_s, sync_every=self.sync_every(), fragments=len(self.served)
        )
        if period is None:
            return self.config.lease_s
        return max(period * len(self.served), self.config.tau * estimates.step_s)

    def poll(
        self, now: float, *, wait_for_finals: bool = True
    ) -> tuple[list[Commit], float | None]:
        """Close every round that should close at ``now`` and commit it (``close_rounds``,
        each one's ``Closing.merge`` and ``apply`` in one go).

        Returns the commits (in fragment order) and the earliest time a waiting round must
        be decided again (``None``: only a new arrival or liveness change can close one).
        ``wait_for_finals`` False (a syncer that stops): rounds do not wait for the finals of
        stopping learners still on their way (``finals_due``).
        """
        closed, wake = self.close_rounds(now, wait_for_finals=wait_for_finals)
        return [self.apply(c, c.merge(), now) for c in closed], wake

    def close_rounds(
        self, now: float, *, wait_for_finals: bool = True
    ) -> tuple[list[Closing], float | None]:
        """Take every round that should close at ``now`` out of the open rounds, with what
        its merge needs (its weights, the direction check's verdict, its share); ``wake`` as
        for ``poll``. Each must then be merged and passed to ``apply``, in this order."""
        self.roster.expire(now)
        live = self.live(now)
        closed, wake = [], None
        for fragment in sorted(self.rounds):
            close, wait_until, reason = self._decide(now, fragment, live, wait_for_finals)
            if close:
                round_ = self.rounds.pop(fragment)
                closed.append(self.closing.close(fragment, round_, reason, now, live))
            elif wait_until is not None:
                wake = wait_until if wake is None else min(wake, wait_until)
        return closed, wake

    def apply(self, closing: Closing, merged: torch.Tensor | None, now: float) -> Commit:
        """Commit a closed round with its merged delta (``RoundClosing.apply``: the new
        version; a dropped round, ``merged`` None, keeps it); a new version counts in
        ``rounds_committed`` and may move the H schedule on (``note_period``)."""
        commit = self.closing.apply(closing, merged, now)
        if commit.changed:
            self.rounds_committed += 1
            self.note_period()
        return commit

"""How a learner settles what the syncer told it: upload answers, rejoins to a restarted
syncer, notes of deltas left out of their merges, and the accounting that results (a mixin
of ``diloco.learner.learner.Learner``; training thread only).

Everything the link's threads report goes through the inbox and is settled here *in the
order it was reported*: an answer from a syncer that then died must be settled before the
rejoin to its successor, which returns what that syncer accepted and never committed.
"""

from __future__ import annotations

import torch

from diloco.learner.accounting import Accounting
from diloco.learner.inbox import Dropped, Rejoin
from diloco.learner.ledger import DeltaInFlight

MERGED_REMEMBERED = 4096
"""Merged upload ids a learner remembers, so a later note that the syncer left one out of its
merge (``Dropped``) moves its steps from merged to excluded."""


HELD, LOST, UNKNOWN = "held", "lost", "unknown"
"""The fates ``fate_at_rejoin`` tells apart."""


def fate_at_rejoin(rejoin: Rejoin, p: int, admitted: int, upload_id: int) -> str:
    """What the syncer a learner rejoined holds of a delta of fragment ``p`` that an earlier
    instance accepted at version ``admitted``: ``HELD`` (a kept commit log merged or left it
    out, or a round still open holds it), ``LOST`` (admitted at or after the version from
    which every commit's log is kept, ``logged_from``, and in none of them: its round died
    with the instance that accepted it, so it is sent again) or ``UNKNOWN`` (admitted
    before the kept logs, or without an id: nobody can tell; never guessed from versions).

    >>> r = Rejoin("a", "s", [5], (0,), frozenset({7}), (3,))
    >>> fate_at_rejoin(r, 0, 4, 7), fate_at_rejoin(r, 0, 4, 8), fate_at_rejoin(r, 0, 2, 8)
    ('held', 'lost', 'unknown')
    """
    if upload_id and upload_id in rejoin.committed:
        return HELD
    logged = rejoin.logged_from[p] if p < len(rejoin.logged_from) else -1
    if upload_id and 0 <= logged <= admitted:
        return LOST
    return UNKNOWN


def another_lineage(
    held_lineage: str | None,
    lineage: str,
    held: list[int],
    versions: list[int],
    fragments: tuple[int, ...],
) -> bool:
    """Whether a syncer just joined serves another history of versions than the one the
    learner holds values of (``diloco.syncer.lineage``): another lineage id than
    ``held_lineage`` (both known), or for a fragment it owns a version below the one the
    learner holds (``held``; -1: none): a syncer rolled back without a tape to tell it.
    Its version numbers then name other values than the learner's.

    >>> another_lineage("a", "b", [3], [3], (0,)), another_lineage("a", "a", [4], [3], (0,))
    (True, True)
    >>> another_lineage(None, "b", [3], [3], (0,)), another_lineage("a", "", [-1], [0], (0,))
    (False, False)
    """
    if held_lineage and lineage and held_lineage != lineage:
        return True
    return any(0 <= p < min(len(held), len(versions)) and held[p] > versions[p] for p in fragments)


class Settling:
    """The settling half of ``Learner`` (it uses the learner's inbox, ledger, counters,
    journal and the per-fragment step counts)."""

    def _settle(self) -> None:
        """Apply what the link reported since the last call (training thread only)."""
        for answer in self._inbox.take_answers():  # in the order they were reported
            if isinstance(answer, Rejoin):
                self._on_syncer(answer)
                continue
            if isinstance(answer, Dropped):
                self._on_dropped(answer)
                continue
            job, result = answer
            entry = self._ledger.find(job.fragment, job.job_id)
            if entry is None:
                continue
            dead = (
                self._answered_by_the_dead(job.fragment, entry, result)
                if result.outcome == "accepted"
                else None
            )
            if dead in (LOST, UNKNOWN):  # not held by the successor: never recorded accepted
                self._settle_at_rejoin(job.fragment, entry, dead)
                continue
            if result.outcome == "accepted":
                self._journal_settled(entry.upload_id, "accepted", result.admitted)
                entry.syncer_id = result.syncer_id
                if not torch.equal(entry.delta, result.sent):
                    self._residual.add(job.fragment)  # error feedback: delta − sent is in u_p
                entry.admitted, entry.delta = result.admitted, result.sent
                continue
            if result.outcome == "unknown":
                self._forget_unknown(job.fragment, entry)
                continue
            self._return(job.fragment, entry)
            if result.outcome == "guard" and self._reset(job.fragment):
                self._reset_now.add(job.fragment)  # an island sends it to its other ranks

    def _answered_by_the_dead(self, p: int, entry: DeltaInFlight, result) -> str | None:
        """The fate (``fate_at_rejoin`` with the successor's rejoin) of a delta an "accepted"
        answer came from a syncer instance this learner has already seen replaced (the
        sender thread may report an answer after the link thread reported the rejoin that
        followed it); None when the answer is not from a replaced instance."""
        successor = self._successors.get(result.syncer_id) if result.syncer_id else None
        if successor is None or p not in successor.fragments:
            return None
        if successor.another_lineage:
            return UNKNOWN  # its versions are not the successor's
        return fate_at_rejoin(successor, p, result.admitted, entry.upload_id)

    def _settle_at_rejoin(self, p: int, entry: DeltaInFlight, fate: str) -> None:
        """An accepted delta judged at a rejoin: kept on the ledger when the successor holds
        it, returned (sent again) when its round died, forgotten as unknown otherwise."""
        if fate == LOST:
            self._return(p, entry)  # its round died with the syncer that accepted it
        elif fate == UNKNOWN:
            self._forget_unknown(p, entry)

    def _forget_unknown(self, p: int, entry: DeltaInFlight) -> None:
        """Take ``entry`` off the ledger without sending it again or counting it merged: no
        syncer can tell whether it was merged. Its steps are counted ``unknown``, and its
        delta is taken into θ_p as a merge of it would be (``Learner._apply``): off the
        ledger, it would otherwise be undelivered progress, sent again with the next delta
        (merged twice where it was merged once)."""
        self._ledger.remove(p, entry)
        self._touch([p])
        with torch.no_grad():
            self.layout.add_(p, entry.delta, self.params)
        self._reset_now.add(p)  # (an island shares the changed θ_p with its other ranks)
        self._journal_settled(entry.upload_id, "unknown")
        self.unknown_steps[p] += entry.steps
        self.counters["unknown"] += 1

    def _return(self, p: int, entry: DeltaInFlight) -> None:
        """Take ``entry`` off the ledger: its progress is undelivered again (sent next time)."""
        self._ledger.remove(p, entry)
        self._journal_settled(entry.upload_id, "returned")
        self.steps_since[p] += entry.steps
        self.tokens_since[p] += entry.tokens
        self.counters["returned"] += 1

    def _on_syncer(self, rejoin: Rejoin) -> None:
        """A (re)join: a syncer that restarted lost its open rounds, so an accepted delta
        its commits did not hold is returned and sent again, or forgotten as unknown when
        nobody can tell (``fate_at_rejoin``). A syncer of another lineage (a state
        directory rolled back, ``another_lineage``) can tell nothing of the versions this
        learner's deltas were admitted at: every accepted one of its fragments is unknown,
        and each fragment waits for its rebase keyframe (``inbox.REBASE``) before it is
        sent again."""
        if self._unconfirmed:  # the first join (of this shard) after a restore
            self._confirm_delivered(rejoin.committed, rejoin.fragments, rejoin.logged_from)
        known = self._syncer_ids.get(rejoin.address)
        self._syncer_ids[rejoin.address] = rejoin.syncer_id
        if rejoin.lineage:
            self.lineages[rejoin.address] = rejoin.lineage
        if rejoin.another_lineage:
            self._rebasing.update(rejoin.fragments)
        elif known is None or known == rejoin.syncer_id:
            return
        if known is not None and known != rejoin.syncer_id:
            self._successors.setdefault(known, rejoin)
        for p in rejoin.fragments:
            for e in [e for e in self._ledger.of(p) if e.admitted is not None]:
                if e.syncer_id and e.syncer_id == rejoin.syncer_id:
                    continue  # accepted by this very instance
                if rejoin.another_lineage:
                    self._forget_unknown(p, e)
                    continue
                self._settle_at_rejoin(p, e, fate_at_rejoin(rejoin, p, e.admitted, e.upload_id))

    def _rebased(self, p: int) -> None:
        """The rebase keyframe of ``p`` was applied: it holds the new lineage's value."""
        self._rebasing.discard(p)
        self._awaited.pop(p, None)  # (the versions it waited past are another lineage's)

    def _journal_settled(self, upload_id: int, how: str, version: int | None = None) -> None:
        if self.journal is not None and upload_id:
            self.journal.settled(upload_id, how, version)

    def _count_merged(self, p: int, entries, version: int = -1) -> None:
        """Count deltas that left the ledger with version ``p``'s arrival: merged, or
        excluded when the syncer said its direction check left them out."""
        for e in entries:
            self._journal_settled(e.upload_id, "excluded" if e.excluded else "merged", version)
            if e.excluded:
                self.excluded_steps[p] += e.steps
                self.counters["excluded"] += 1
                continue
            self.merged_steps[p] += e.steps
            self.counters["merged"] += 1
            if e.upload_id:
                self._merged_recent[e.upload_id] = (p, e.steps)
                while len(self._merged_recent) > MERGED_REMEMBERED:
                    self._merged_recent.popitem(last=False)

    def _on_dropped(self, note: Dropped) -> None:
        """The syncer left these uploads out of their rounds' merges: an entry still on the
        ledger is marked (dropped when its version arrives), one already counted as merged
        is moved to excluded. Ids this learner does not know (or took care of) are ignored."""
        for upload_id in note.upload_ids:
            entry = self._ledger.find_upload(upload_id)
            if entry is not None:
                entry.excluded = True
                continue
            known = self._merged_recent.pop(upload_id, None)
            if known is not None:
                p, steps = known
                self.merged_steps[p] -= steps
                self.excluded_steps[p] += steps
                self.counters["merged"] -= 1
                self.counters["excluded"] += 1

    def accounting(self) -> Accounting:
        """Where every trained step went, per fragment: merged, in flight (accepted, its
        merge not back yet), unsent, dropped (``diloco.learner.accounting``). Call it from
        the training thread (between steps, or after ``close``)."""
        self._settle()
        unsent = self.unsent()
        return Accounting(
            self.local_step,
            tuple(self.merged_steps),
            tuple(self._in_flight()),
            tuple(unsent),
            tuple(self.dropped),
            tuple(self.excluded_steps),
            tuple(self.unknown_steps),
        )

    def _in_flight(self) -> list[int]:
        """Per fragment, the steps of accepted deltas whose merge has not come back."""
        in_flight = [0] * self.layout.num_fragments
        for p, e in self._ledger.items():
            if e.admitted is not None:
                in_flight[p] += e.steps
        return in_flight

    def delivered_steps(self) -> list[int]:
        """Per fragment, the steps the syncer has: merged, in flight or left out (what a
        resumed learner's earlier lives delivered, ``diloco.learner.journal``)."""
        columns = (self.merged_steps, self._in_flight(), self.excluded_steps)
        return [sum(c) for c in zip(*columns, strict=True)]

    def unanswered_uploads(self) -> list[tuple[int, int, int]]:
        """``(upload id, fragment, steps)`` of the deltas sent without an answer yet: counted
        in ``unsent``, although the syncer may have merged them (an audit checks them by id
        against its tape)."""
        return [(e.upload_id, p, e.steps) for p, e in self._ledger.items() if e.admitted is None]

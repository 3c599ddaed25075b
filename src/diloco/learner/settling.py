"""How a learner settles what the syncer told it: upload answers, rejoins to a restarted
syncer, notes of deltas left out of their merges, and the accounting that results (the
``Settler``, a part the ``Learner`` holds; training thread only).

Everything the link's threads report goes through the inbox and is settled here *in the
order it was reported*: an answer from a syncer that then died must be settled before the
rejoin to its successor, which returns what that syncer accepted and never committed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from diloco.algorithm.fragments import FragmentLayout
from diloco.learner.accounting import Accounting
from diloco.learner.inbox import Dropped, Inbox, Rejoin
from diloco.learner.ledger import DeltaInFlight, Ledger
from diloco.learner.progress import Progress

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


def unsettled_from(ledger: Ledger, versions: Sequence[int]) -> list[int]:
    """Per fragment, the oldest admission this learner may still ask a syncer about
    (``JoinRequest.unsettled_from``, which pins the syncer's commit logs from there on,
    ``diloco.syncer.retention``): the version its oldest accepted delta on the ledger was
    admitted at, or an unanswered one was made against (admitted there or later); with
    neither, the version held (-1: none). Stale is safe: ledger entries only leave and held
    versions only grow, so an older report is lower and pins more.

    >>> ledger = Ledger()
    >>> ledger.add(0, torch.zeros(1), 1, 1, 1).admitted = 3
    >>> ledger.add(1, torch.zeros(1), 1, 1, 1).base_version = 5
    >>> unsettled_from(ledger, [6, 7, 2, -1])
    [3, 5, 2, -1]
    """
    floors = list(versions)
    for p, e in ledger.items():
        at = e.admitted if e.admitted is not None else e.base_version
        if at >= 0:
            floors[p] = at if floors[p] < 0 else min(floors[p], at)
    return floors


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


class Settler:
    """Settles what the link reported (through the ``inbox``) on the ``ledger`` and the
    learner's ``progress``, in the order it was reported, and says where every trained step
    went (``accounting``). Given: ``touch`` (called with the fragments whose parameters it
    is about to change), ``reset`` (the learner's norm-guard reset of a fragment; True if it
    changed) and ``on_join`` (called with every rejoin before it is settled: the restorer
    confirms what the previous life delivered). It owns the syncer instances seen replaced
    and the last merged upload ids."""

    def __init__(
        self,
        inbox: Inbox,
        ledger: Ledger,
        progress: Progress,
        layout: FragmentLayout,
        params: dict[str, nn.Parameter],
        *,
        touch: Callable[[list[int]], None],
        reset: Callable[[int], bool],
        on_join: Callable[[Rejoin], None],
    ) -> None:
        self.inbox, self.ledger, self.progress = inbox, ledger, progress
        self.layout, self.params = layout, params
        self.touch, self.reset, self.on_join = touch, reset, on_join
        self.merged_recent: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Upload id -> (fragment, steps) of the last merged deltas (``MERGED_REMEMBERED``)."""
        self.successors: dict[str, Rejoin] = {}
        """A replaced syncer instance's id -> the rejoin to its successor (what it restored)."""

    def settle(self) -> None:
        """Apply what the link reported since the last call (training thread only)."""
        pr = self.progress
        for answer in self.inbox.take_answers():  # in the order they were reported
            if isinstance(answer, Rejoin):
                self.on_syncer(answer)
                continue
            if isinstance(answer, Dropped):
                self.on_dropped(answer)
                continue
            job, result = answer
            entry = self.ledger.find(job.fragment, job.job_id)
            if entry is None:
                continue
            dead = (
                self.answered_by_the_dead(job.fragment, entry, result)
                if result.outcome == "accepted"
                else None
            )
            if dead in (LOST, UNKNOWN):  # not held by the successor: never recorded accepted
                self.settle_at_rejoin(job.fragment, entry, dead)
                continue
            if result.outcome == "accepted":
                pr.journal_settled(entry.upload_id, "accepted", result.admitted)
                entry.syncer_id = result.syncer_id
                if not torch.equal(entry.delta, result.sent):
                    pr.residual.add(job.fragment)  # error feedback: delta − sent is in u_p
                entry.admitted, entry.delta = result.admitted, result.sent
                continue
            if result.outcome == "unknown":
                self.forget_unknown(job.fragment, entry)
                continue
            self.give_back(job.fragment, entry)
            if result.outcome == "guard" and self.reset(job.fragment):
                pr.reset_now.add(job.fragment)  # an island sends it to its other ranks
        self.note_unsettled()

    def note_unsettled(self) -> None:
        """Take the ledger's ``unsettled_from`` into the progress (the link reports it)."""
        self.progress.unsettled_from = unsettled_from(self.ledger, self.progress.versions)

    def answered_by_the_dead(self, p: int, entry: DeltaInFlight, result) -> str | None:
        """The fate (``fate_at_rejoin`` with the successor's rejoin) of a delta an "accepted"
        answer came from a syncer instance this learner has already seen replaced (the
        sender thread may report an answer after the link thread reported the rejoin that
        followed it); None when the answer is not from a replaced instance."""
        successor = self.successors.get(result.syncer_id) if result.syncer_id else None
        if successor is None or p not in successor.fragments:
            return None
        if successor.another_lineage:
            return UNKNOWN  # its versions are not the successor's
        return fate_at_rejoin(successor, p, result.admitted, entry.upload_id)

    def settle_at_rejoin(self, p: int, entry: DeltaInFlight, fate: str) -> None:
        """An accepted delta judged at a rejoin: kept on the ledger when the successor holds
        it, returned (sent again) when its round died, forgotten as unknown otherwise."""
        if fate == LOST:
            self.give_back(p, entry)  # its round died with the syncer that accepted it
        elif fate == UNKNOWN:
            self.forget_unknown(p, entry)

    def forget_unknown(self, p: int, entry: DeltaInFlight) -> None:
        """Take ``entry`` off the ledger without sending it again or counting it merged: no
        syncer can tell whether it was merged. Its steps are counted ``unknown``, and its
        delta is taken into θ_p as a merge of it would be (``Learner._apply``): off the
        ledger, it would otherwise be undelivered progress, sent again with the next delta
        (merged twice where it was merged once)."""
        pr = self.progress
        self.ledger.remove(p, entry)
        self.touch([p])
        with torch.no_grad():
            self.layout.add_(p, entry.delta, self.params)
        pr.reset_now.add(p)  # (an island shares the changed θ_p with its other ranks)
        if entry.found and pr.journal is not None:  # (an earlier life's upload)
            pr.journal.found_delivered(p, entry.steps, unknown=True)
        else:
            pr.journal_settled(entry.upload_id, "unknown")
        pr.unknown_steps[p] += entry.steps
        pr.counters["unknown"] += 1

    def give_back(self, p: int, entry: DeltaInFlight) -> None:
        """Take ``entry`` off the ledger: its progress is undelivered again (sent next time)."""
        pr = self.progress
        self.ledger.remove(p, entry)
        pr.journal_settled(entry.upload_id, "returned")
        pr.steps_since[p] += entry.steps
        pr.tokens_since[p] += entry.tokens
        pr.counters["returned"] += 1

    def on_syncer(self, rejoin: Rejoin) -> None:
        """A (re)join: a syncer that restarted lost its open rounds, so an accepted delta
        its commits did not hold is returned and sent again, or forgotten as unknown when
        nobody can tell (``fate_at_rejoin``). A syncer of another lineage (a state
        directory rolled back, ``another_lineage``) can tell nothing of the versions this
        learner's deltas were admitted at: every accepted one of its fragments is unknown,
        and each fragment waits for its rebase keyframe (``inbox.REBASE``) before it is
        sent again. ``on_join`` hears of it first."""
        pr = self.progress
        self.on_join(rejoin)
        if rejoin.fates is not None and rejoin.fates.excluded:  # (all of them, not the note's)
            self.on_dropped(Dropped(rejoin.address, rejoin.fates.excluded))
        known = pr.syncer_ids.get(rejoin.address)
        pr.syncer_ids[rejoin.address] = rejoin.syncer_id
        if rejoin.lineage:
            pr.lineages[rejoin.address] = rejoin.lineage
        if rejoin.another_lineage:
            pr.rebasing.update(rejoin.fragments)
        elif known is None or known == rejoin.syncer_id:
            return
        if known is not None and known != rejoin.syncer_id:
            self.successors.setdefault(known, rejoin)
        for p in rejoin.fragments:
            for e in [e for e in self.ledger.of(p) if e.admitted is not None]:
                if e.syncer_id and e.syncer_id == rejoin.syncer_id:
                    continue  # accepted by this very instance
                if rejoin.another_lineage:
                    self.forget_unknown(p, e)
                    continue
                self.settle_at_rejoin(p, e, fate_at_rejoin(rejoin, p, e.admitted, e.upload_id))

    def rebased(self, p: int) -> None:
        """The rebase keyframe of ``p`` was applied: it holds the new lineage's value."""
        self.progress.rebasing.discard(p)
        self.progress.awaited.pop(p, None)  # (the versions it waited past: another lineage's)

    def count_merged(self, p: int, entries, version: int = -1) -> None:
        """Count deltas that left the ledger with version ``p``'s arrival: merged, or
        excluded when the syncer said its direction check left them out."""
        pr = self.progress
        for e in entries:
            pr.journal_settled(e.upload_id, "excluded" if e.excluded else "merged", version)
            if e.found and pr.journal is not None:  # (merged or left out: delivered)
                pr.journal.found_delivered(p, e.steps)
            if e.excluded:
                pr.excluded_steps[p] += e.steps
                pr.counters["excluded"] += 1
                continue
            self.count_merged_upload(p, e.upload_id, e.steps)

    def keep_in_flight(self, p: int, upload_id: int, admitted: int, rejoin: Rejoin, at: int):
        """After a restore: the previous life's upload ``upload_id`` (queued at step ``at``)
        sits in a round still open at the syncer just joined, admitted at ``admitted``, and
        carried the checkpointed progress of ``p``. That progress is put on the ledger as
        that upload, accepted and in flight (``DeltaInFlight.found``): merged or left out
        when the version after ``admitted`` arrives, sent again if that syncer dies before
        (``on_syncer``), never counted merged on sight. θ_p stays; the progress is no longer
        undelivered."""
        pr = self.progress
        delta = pr.anchors[p].clone()  # G_p − θ_p − (what is on its way), as ``_send`` makes
        delta.sub_(self.layout.gather(p, self.params))
        on_its_way = self.ledger.on_its_way(p)
        if on_its_way is not None:
            delta.sub_(on_its_way)
        entry = self.ledger.add(p, delta, pr.steps_since[p], pr.tokens_since[p], at, upload_id)
        entry.admitted, entry.syncer_id, entry.found = admitted, rejoin.syncer_id, True
        entry.base_version = pr.versions[p]
        pr.steps_since[p] = pr.tokens_since[p] = 0
        pr.residual.discard(p)  # (the upload carried it)

    def count_merged_upload(self, p: int, upload_id: int, steps: int) -> None:
        """Count ``steps`` of fragment ``p`` merged by upload ``upload_id`` (0: no id) and
        remember it: a later note that the syncer left it out moves them to excluded."""
        pr = self.progress
        pr.merged_steps[p] += steps
        pr.counters["merged"] += 1
        if upload_id:
            self.merged_recent[upload_id] = (p, steps)
            while len(self.merged_recent) > MERGED_REMEMBERED:
                self.merged_recent.popitem(last=False)

    def on_dropped(self, note: Dropped) -> None:
        """The syncer left these uploads out of their rounds' merges: an entry still on the
        ledger is marked (dropped when its version arrives), one already counted as merged
        is moved to excluded. Ids this learner does not know (or took care of) are ignored."""
        pr = self.progress
        for upload_id in note.upload_ids:
            entry = self.ledger.find_upload(upload_id)
            if entry is not None:
                entry.excluded = True
                continue
            known = self.merged_recent.pop(upload_id, None)
            if known is not None:
                p, steps = known
                pr.merged_steps[p] -= steps
                pr.excluded_steps[p] += steps
                pr.counters["merged"] -= 1
                pr.counters["excluded"] += 1

    def accounting(self, unsent: list[int]) -> Accounting:
        """Where every trained step went, per fragment, given the ``unsent`` steps
        (``Learner.unsent``): merged, in flight, unsent, dropped, excluded, unknown. Settle
        first for an answer up to date."""
        pr = self.progress
        return Accounting(
            pr.local_step,
            tuple(pr.merged_steps),
            tuple(self.in_flight_steps()),
            tuple(unsent),
            tuple(pr.dropped),
            tuple(pr.excluded_steps),
            tuple(pr.unknown_steps),
        )

    def in_flight_steps(self) -> list[int]:
        """Per fragment, the steps of accepted deltas whose merge has not come back."""
        in_flight = [0] * self.layout.num_fragments
        for p, e in self.ledger.items():
            if e.admitted is not None:
                in_flight[p] += e.steps
        return in_flight

    def delivered_steps(self) -> list[int]:
        """Per fragment, the steps the syncer has: merged, in flight or left out (what a
        resumed learner's earlier lives delivered, ``diloco.learner.journal``)."""
        pr = self.progress
        columns = (pr.merged_steps, self.in_flight_steps(), pr.excluded_steps)
        return [sum(c) for c in zip(*columns, strict=True)]

    def unanswered_uploads(self) -> list[tuple[int, int, int]]:
        """``(upload id, fragment, steps)`` of the deltas sent without an answer yet: counted
        in ``unsent``, although the syncer may have merged them (an audit checks them by id
        against its tape)."""
        return [(e.upload_id, p, e.steps) for p, e in self.ledger.items() if e.admitted is None]

"""How a learner stops cleanly: flush its undelivered progress, wait for it to come back
merged, leave (the ``Stopper``, a part the ``Learner`` holds; ``Learner.flush``, ``drain``,
``close``; training thread only)."""

from __future__ import annotations

import time
from collections.abc import Callable

from diloco.learner.config import MAX_DRAIN_S, LearnerConfig
from diloco.learner.ledger import Ledger
from diloco.learner.pacing import Pacer
from diloco.learner.progress import Progress

AWAIT_POLL_S = 0.05
"""How often a wait for the link to come back looks at it."""
DRAIN_POLL_S = 0.02
"""How often a drain looks for the merges that bring its deltas back."""


class Stopper:
    """Stops a learner: ``flush`` queues every fragment's undelivered progress as finals and
    waits for their answers, ``drain`` waits for the merges that hold them, ``close`` does
    both (bounded) and leaves. Given: the ``link``, the ``ledger`` and ``progress`` it
    reads, the ``pacer`` (the step time sizes the drain), ``clock`` (every deadline is on
    it) and the learner's own steps: ``settle`` (``Settler.settle``), ``queue(p, final=)``,
    ``send_copied(wait=)`` and ``apply_arrived``. It owns what closing did (``report``) and
    whether the learner is ``closed``."""

    def __init__(
        self,
        link,
        ledger: Ledger,
        progress: Progress,
        config: LearnerConfig,
        pacer: Pacer,
        *,
        clock: Callable[[], float],
        settle: Callable[[], None],
        queue: Callable[..., bool],
        send_copied: Callable[..., None],
        apply_arrived: Callable[[], int],
    ) -> None:
        self.link, self.ledger, self.progress = link, ledger, progress
        self.config, self.pacer, self.clock = config, pacer, clock
        self.settle, self.queue = settle, queue
        self.send_copied, self.apply_arrived = send_copied, apply_arrived
        self.closed = False
        self.flushed: set[int] = set()
        """The fragments the last flush queued a final delta of."""
        self.report: dict = {}
        """What ``close`` did: fragments flushed, whether the uploads went out and the merges
        holding them came back in time (``drained``), and the fragments that did not."""

    def flush(self, timeout: float | None = None) -> bool:
        """Queue every fragment's undelivered progress, marked final (the syncer counts it as
        this learner's answer to the fragment's next round), and wait until every delta on
        its way has an answer.

        Used on a clean stop or a preemption notice (SIGTERM) so no finished work is lost.
        Progress whose upload failed (connection lost) or was refused as too stale is queued
        again (after applying what arrived) while time is left; progress the syncer refused
        otherwise stays unsent (the ``unsent_steps`` of ``close_report``).
        Returns True if every delta had an answer within ``timeout``.
        """
        wait = self.config.flush_timeout_s if timeout is None else timeout
        deadline = self.clock() + wait
        self.settle()
        self.flushed = set()
        for _attempt in range(3):
            stats = self.link.stats
            failed_before = stats.uploads_failed + stats.stale_replies
            self.send_copied(wait=True)  # (a CUDA learner's copies still on their way)
            with self.link.holding():  # all queued before the first goes: it names them all
                for p in range(len(self.progress.versions)):
                    if self.progress.versions[p] >= 0 and self.queue(p, final=True):
                        self.flushed.add(p)
                self.send_copied(wait=True)
            idle = self.link.wait_idle(max(0.0, deadline - self.clock()))
            self.settle()
            unanswered = bool(self.ledger.unanswered())
            if not idle or unanswered:
                return False
            stats = self.link.stats
            # failed or too stale: sent again once the newer versions that arrived are applied
            retry = stats.uploads_failed + stats.stale_replies > failed_before
            if retry:
                self.apply_arrived()
            if not retry or self.clock() >= deadline or not self.link.connected.is_set():
                return True
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every accepted delta has come back merged (the ledger is empty),
        applying what arrives. Returns True if so within ``timeout`` (bounded, never hangs).

        A link that drops meanwhile (its syncer restarting) is waited for, within the same
        bound, and so is the rejoin: the successor's answer at the rejoin settles what its
        predecessor accepted (``diloco.learner.settling``: a delta it never committed is
        judged lost and its progress returned), and what was returned is flushed again, as
        finals, and drained in turn. Without the wait the learner left holding deltas
        nobody would ever merge."""
        deadline = self.clock() + timeout
        joins = self.link.stats.connects
        while True:
            self.apply_arrived()
            pending = self.undrained()
            left = deadline - self.clock()
            rejoined = self.link.stats.connects != joins
            if (not pending and not rejoined) or left <= 0:
                break
            if rejoined or not self.link.connected.is_set():
                if not self.await_link(left):  # (connected: after the rejoin was reported)
                    break
                joins = self.link.stats.connects
                flushed = self.flushed
                self.flush(timeout=max(0.0, deadline - self.clock()))  # settles first
                self.flushed |= flushed
                continue
            time.sleep(DRAIN_POLL_S)
        return not pending

    def await_link(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the link is connected again; True if it is."""
        deadline = self.clock() + timeout
        while not self.link.connected.is_set():
            if self.clock() >= deadline or self.link.error is not None:
                return False
            time.sleep(AWAIT_POLL_S)
        return True

    def drain_timeout(self) -> float:
        """``drain_timeout_s``; on the syncer's clock at least one and a half of its cycles
        (H fleet steps, estimated by this learner's own step time), at most 30 s: flushed
        progress is merged at each fragment's next tick."""
        return drain_timeout(
            self.config.drain_timeout_s,
            self.link.schedule,
            self.link.sync_every,
            self.pacer.step_time,
        )

    def undrained(self) -> list[int]:
        """Fragments with a delta on its way (not yet merged back)."""
        return sorted(self.ledger.in_flight())

    def close(self, *, flush: bool = True) -> None:
        """Optionally flush and drain (bounded), then leave the syncer, stop the link's
        threads and close the journal. A second call does nothing."""
        if self.closed:
            return
        if flush and not self.link.connected.is_set():
            # (a syncer restarting: its successor settles what the dead one accepted)
            self.await_link(self.config.flush_timeout_s)
        if flush and self.link.connected.is_set():
            t0 = self.clock()
            flushed = self.flush()
            t1 = self.clock()
            wait = self.drain_timeout()
            drained = wait > 0 and self.drain(wait)
            self.report = {
                "flushed": len(self.flushed),
                "flush_ok": flushed,
                "flush_s": round(t1 - t0, 3),
                "drained": drained,
                "drain_s": round(self.clock() - t1, 3),
                "undrained": self.undrained(),
                "unsent_steps": sum(self.progress.steps_since),
            }
        self.progress.state = "closed"
        self.closed = True
        self.link.close()
        if self.progress.journal is not None:
            self.progress.journal.close()


def drain_timeout(
    configured_s: float, schedule: str, sync_every: int, step_time: float | None
) -> float:
    """How long a close drains: ``configured_s``; on the syncer's clock (``schedule``) at
    least one and a half of its cycles (``sync_every`` steps of ``step_time``), at most
    ``MAX_DRAIN_S``. Pure.

    >>> drain_timeout(5.0, "syncer", 100, 0.1), drain_timeout(5.0, "learner", 100, 0.1)
    (15.0, 5.0)
    """
    wait = configured_s
    if wait > 0 and schedule == "syncer" and step_time:
        cycle = sync_every * step_time
        wait = max(wait, min(1.5 * cycle, MAX_DRAIN_S))
    return wait

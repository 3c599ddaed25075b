"""How a learner stops cleanly: flush its undelivered progress, wait for it to come back
merged, leave (``Learner.flush``, ``drain``, ``close``; a mixin of ``Learner``)."""

from __future__ import annotations

import time

from diloco.learner.config import MAX_DRAIN_S


class Stopping:
    """The stopping half of ``diloco.learner.learner.Learner`` (it uses the learner's
    ledger, link, counters and ``_queue`` / ``_settle`` / ``apply_arrived``)."""

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
        deadline = time.monotonic() + (self.config.flush_timeout_s if timeout is None else timeout)
        self._settle()
        self._flushed = set()
        for _attempt in range(3):
            stats = self.link.stats
            failed_before = stats.uploads_failed + stats.stale_replies
            self._send_copied(wait=True)  # (a CUDA learner's copies still on their way)
            with self.link.holding():  # all queued before the first goes: it names them all
                for p in range(self.layout.num_fragments):
                    if self.versions[p] >= 0 and self._queue(p, final=True):
                        self._flushed.add(p)
                self._send_copied(wait=True)
            idle = self.link.wait_idle(max(0.0, deadline - time.monotonic()))
            self._settle()
            unanswered = bool(self._ledger.unanswered())
            if not idle or unanswered:
                return False
            stats = self.link.stats
            # failed or too stale: sent again once the newer versions that arrived are applied
            retry = stats.uploads_failed + stats.stale_replies > failed_before
            if retry:
                self.apply_arrived()
            if not retry or time.monotonic() >= deadline or not self.link.connected.is_set():
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
        deadline = time.monotonic() + timeout
        joins = self.link.stats.connects
        while True:
            self.apply_arrived()
            pending = self._undrained()
            left = deadline - time.monotonic()
            rejoined = self.link.stats.connects != joins
            if (not pending and not rejoined) or left <= 0:
                break
            if rejoined or not self.link.connected.is_set():
                if not self._await_link(left):  # (connected: after the rejoin was reported)
                    break
                joins = self.link.stats.connects
                flushed = self._flushed
                self.flush(timeout=max(0.0, deadline - time.monotonic()))  # settles first
                self._flushed |= flushed
                continue
            time.sleep(0.02)
        return not pending

    def _await_link(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the link is connected again; True if it is."""
        deadline = time.monotonic() + timeout
        while not self.link.connected.is_set():
            if time.monotonic() >= deadline or self.link.error is not None:
                return False
            time.sleep(0.05)
        return True

    def _drain_timeout(self) -> float:
        """``drain_timeout_s``; on the syncer's clock at least one and a half of its cycles
        (H fleet steps, estimated by this learner's own step time), at most 30 s: flushed
        progress is merged at each fragment's next tick."""
        wait = self.config.drain_timeout_s
        if wait > 0 and self.link.schedule == "syncer" and self._step_time:
            cycle = self.link.sync_every * self._step_time
            wait = max(wait, min(1.5 * cycle, MAX_DRAIN_S))
        return wait

    def _undrained(self) -> list[int]:
        """Fragments with a delta on its way (not yet merged back)."""
        return sorted(self._ledger.in_flight())

    def close(self, *, flush: bool = True) -> None:
        """Optionally flush, leave the syncer and stop the background threads (bounded)."""
        if self._closed:
            return
        if flush and not self.link.connected.is_set():
            # (a syncer restarting: its successor settles what the dead one accepted)
            self._await_link(self.config.flush_timeout_s)
        if flush and self.link.connected.is_set():
            t0 = time.monotonic()
            flushed = self.flush()
            t1 = time.monotonic()
            wait = self._drain_timeout()
            drained = wait > 0 and self.drain(wait)
            self.close_report = {
                "flushed": len(self._flushed),
                "flush_ok": flushed,
                "flush_s": round(t1 - t0, 3),
                "drained": drained,
                "drain_s": round(time.monotonic() - t1, 3),
                "undrained": self._undrained(),
                "unsent_steps": sum(self.steps_since),
            }
        self._state = "closed"
        self._closed = True
        self.link.close()
        if self.journal is not None:
            self.journal.close()

"""When a standalone syncer's run is over (``diloco syncer --stop-when-learners-leave``,
``--max-tokens``): a decision on the syncer's status, no I/O."""

from __future__ import annotations

from dataclasses import dataclass


def is_gone(learner) -> bool:
    """Whether a learner's status row (``LearnerStatus``) says it is out of the run: it left
    or its subscription stream closed (``connected`` false), and no final of its flush is
    still due. A learner whose lease expired while its stream stays open (a network blip, a
    slow step) and a stopping one still flushing are not gone."""
    return not learner.connected and learner.finals_due == 0


def everyone_left(status) -> bool:
    """Whether at least one learner joined and every one is gone (``is_gone``) with nothing
    of theirs in a round still to commit (``status.waiting`` 0; observers never count)."""
    learners = list(status.learners)
    return bool(learners) and status.waiting == 0 and all(is_gone(ls) for ls in learners)


@dataclass
class StopRule:
    """Decides, status after status, whether the run is over.

    ``when_learners_leave``: over once ``everyone_left`` has held for ``linger_s`` seconds
    (a learner that restarts within that time keeps the run going). ``max_tokens``: over once
    the syncer has merged at least that many tokens into the global model
    (``status.merged_tokens``; 0: no budget); the tokens learners claim in their heartbeats
    never count.
    """

    when_learners_leave: bool = False
    linger_s: float = 5.0
    max_tokens: int = 0
    _all_gone_since: float | None = None

    @property
    def active(self) -> bool:
        """Whether any condition can end the run (else there is nothing to check)."""
        return self.when_learners_leave or self.max_tokens > 0

    def check(self, status, now: float) -> str | None:
        """The reason the run is over (printed by the syncer), or None to go on.
        ``status``: the syncer's ``StatusReply`` (``merged_tokens``, ``waiting`` and the
        ``learners`` rows' ``connected`` and ``finals_due``); ``now``: any monotonic clock."""
        if self.max_tokens > 0 and status.merged_tokens >= self.max_tokens:
            return f"the syncer merged {status.merged_tokens:,} tokens (budget {self.max_tokens:,})"
        if not self.when_learners_leave:
            return None
        if not everyone_left(status):
            self._all_gone_since = None
            return None
        if self._all_gone_since is None:
            self._all_gone_since = now
        if now - self._all_gone_since >= self.linger_s:
            return f"every learner left ({len(status.learners)} joined)"
        return None

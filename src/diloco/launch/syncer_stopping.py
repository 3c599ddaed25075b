"""When a standalone syncer's run is over (``diloco syncer --stop-when-learners-leave``,
``--max-tokens``): a decision on the syncer's status, no I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopRule:
    """Decides, status after status, whether the run is over.

    ``when_learners_leave``: over once at least one learner has joined and none has been live
    for ``linger_s`` seconds (a learner that restarts within that time keeps the run going;
    observers never count). ``max_tokens``: over once the learners together report at least
    that many trained tokens (0: no budget).
    """

    when_learners_leave: bool = False
    linger_s: float = 5.0
    max_tokens: int = 0
    _none_live_since: float | None = None

    @property
    def active(self) -> bool:
        """Whether any condition can end the run (else there is nothing to check)."""
        return self.when_learners_leave or self.max_tokens > 0

    def check(self, learners, now: float) -> str | None:
        """The reason the run is over (printed by the syncer), or None to go on.
        ``learners``: the status's ``LearnerStatus`` rows (``live``, ``tokens``)."""
        learners = list(learners)
        if self.max_tokens > 0:
            tokens = sum(ls.tokens for ls in learners)
            if tokens >= self.max_tokens:
                return f"the learners trained {tokens:,} tokens (budget {self.max_tokens:,})"
        if not self.when_learners_leave or not learners:
            return None
        if any(ls.live for ls in learners):
            self._none_live_since = None
            return None
        if self._none_live_since is None:
            self._none_live_since = now
        if now - self._none_live_since >= self.linger_s:
            return f"every learner left ({len(learners)} joined)"
        return None

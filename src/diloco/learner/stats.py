"""A learner's counters, as ``Learner.stats`` shows them (read from its public state)."""

from __future__ import annotations


def learner_stats(learner) -> dict:
    """The counters of ``learner`` (a ``Learner``): its step and tokens, its link's traffic
    and answers, what it applied, reset and dropped, its event counters and, after
    ``close``, the close report."""
    s = learner.link.stats
    return {
        "learner_id": learner.learner_id,
        "step": learner.local_step,
        "tokens": learner.total_tokens,
        "connected": learner.link.connected.is_set(),
        "fragments_applied": learner.applied,
        "bytes_up": s.bytes_up,
        "bytes_down": s.bytes_down,
        "uploads_sent": s.uploads_sent,
        "uploads_refused": s.uploads_refused,
        "guard_resets": learner.guard_resets,
        "dropped_steps": sum(learner.dropped),
        "stale_replies": s.stale_replies,
        "uploads_failed": s.uploads_failed,
        "requests": s.requests,
        "keyframes": s.keyframes,
        "up_rate_Bps": learner.link.up_rate_Bps,
        "down_lag": learner.down_lag,
        **learner.counters,
        **({"close": learner.close_report} if learner.close_report else {}),
    }

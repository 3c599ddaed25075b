"""``LearnerConfig``: what a :class:`diloco.learner.learner.Learner` is told (the library's
keyword arguments; the worker process builds it from :class:`diloco.config.worker.WorkerConfig`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from diloco.learner.generation import next_generation
from diloco.learner.pacing import DEFAULT_LAG_STEPS, DEFAULT_MAX_STRETCH
from diloco.runtime.renamed import (
    h_is_the_syncers,
    p_is_num_fragments,
    refuse_renamed,
    renamed_keywords,
)
from diloco.wire.comms import comms_setting
from diloco.wire.protocol import ProtocolConfig

FLUSH_TIMEOUT_S = 10.0
"""``LearnerConfig.flush_timeout_s``'s default."""
DRAIN_TIMEOUT_S = 3.0
"""``LearnerConfig.drain_timeout_s``'s default."""
MAX_DRAIN_S = 30.0
"""The longest ``close`` waits for its merged fragments on the syncer's clock."""
LINK_CLOSE_S = 10.0
"""About the longest a link's close takes (its Leave call and thread joins)."""


def close_bound_s(
    flush_timeout_s: float = FLUSH_TIMEOUT_S, drain_timeout_s: float = DRAIN_TIMEOUT_S
) -> float:
    """How long a learner's clean stop can take: waiting for its link to come back (at most
    the flush timeout), the flush, the drain (none when ``drain_timeout_s`` is 0, else at
    most the longer of it and ``MAX_DRAIN_S``) and the link's close; what a launcher that
    stops learners must give them before it kills them. Pure."""
    drain = max(drain_timeout_s, MAX_DRAIN_S) if drain_timeout_s > 0 else 0.0
    return 2 * flush_timeout_s + drain + LINK_CLOSE_S


CLOSE_BOUND_S = close_bound_s()
"""``close_bound_s`` at the learner's defaults."""


def default_generation(generation_file: str | None = None) -> int:
    """A learner process's generation when none is given: with a ``generation_file``, the
    next one of the counter kept there (``diloco.learner.generation.next_generation``:
    above every one taken from it, whatever the wall clock did); without one, the wall clock
    in nanoseconds (``time.time_ns``), larger for a replacement only while the clocks that
    start both processes agree to better than the time between the two starts."""
    if generation_file:
        return next_generation(generation_file)
    return time.time_ns()


LEARNER_RENAMED = {"fragments": p_is_num_fragments, "sync_every": h_is_the_syncers}
"""The previous release's keyword arguments of a learner, and where each is now."""


def renamed(owner: str, given: dict) -> None:
    """Refuse (``TypeError``, one line naming the new spelling) a learner's keyword arguments
    ``given`` that use a previous release's names (``LEARNER_RENAMED``)."""
    refuse_renamed(owner, given, LEARNER_RENAMED)


@renamed_keywords(**LEARNER_RENAMED)
@dataclass(kw_only=True)
class LearnerConfig:
    num_fragments: int = ProtocolConfig.num_fragments
    """P: fragments the model is cut into (must match the syncer's: checked at join). H, the
    sync period, is the syncer's: it says it at join (``diloco.wire.protocol``)."""
    rebase_foreign: bool = True
    """When a merged fragment arrives that holds none of this learner's deltas, keep the
    undelivered progress on top of it (``θ ← θ + (G' − G)``, counters kept) instead of
    discarding it."""
    rebase_own: bool = True
    """When the merge that holds this learner's delta δ arrives, keep the progress made
    since δ was queued (``θ ← θ + (G' − G) + δ``) instead of overwriting it: the steps trained
    while δ travelled and was merged are not thrown away. False applies ``alpha``: the
    paper's rule."""
    alpha: float = 0.0
    """Mixing on receive: θ_p ← αθ_p + (1−α)Θ_p; 0 overwrites (the paper's rule)."""
    comms: str | None = None
    """The most traffic this learner's link accepts, as a named setting
    (``diloco.wire.comms``): a syncer whose exchange costs more bytes per parameter per step
    is refused at join (fatal: ``step`` raises it). None: whatever the syncer runs."""
    tokens_per_step: int = 0
    """The most tokens one step may hold (batch × sequence), declared to the syncer at join:
    it refuses contributions claiming more (0: not declared)."""
    delivery_file: str | None = None
    """Where to keep the delivery log (``diloco.learner.delivery``): per fragment, the step of
    the newest upload the syncer accepted. Without a ``journal_file``, a learner restored from
    a checkpoint drops the checkpointed progress it had accepted after that checkpoint (counted
    unknown: accepted is not merged) instead of sending it twice; with one, the first join
    decides from the syncer's commits. Keep it beside the checkpoint; None: no log."""
    journal_file: str | None = None
    """Where to append the upload journal (``diloco.learner.journal``): a line for every
    upload before it is sent, so an audit can tell whose steps each merged upload carried,
    across crashes. None: no journal."""
    learner_id: str | None = None
    """Identity at the syncer; default ``<hostname>-<pid>``. Keep it across restarts to rejoin."""
    generation: int | None = None
    """Which process of ``learner_id`` this is, sent with every join: a process started to
    replace another of the same id must have a larger one. The syncer refuses for good a
    join with a lower generation than one it saw for the id (the older process, a zombie
    cut off on a partitioned node, stops with an error), and a higher one takes the id over.
    None: ``default_generation(generation_file)``: the counter in ``generation_file``, else
    the wall clock in nanoseconds when the learner is made. Give a counter your launcher
    increases across every restart of the id (never one that starts over, as a new job's
    restart count does), in [1, 2^64)."""
    generation_file: str | None = None
    """Where to keep this learner id's last generation (``diloco.learner.generation``): each
    process takes the next one there, above the last whatever the wall clock did. Keep it
    beside the checkpoint; None: the default generation is the wall clock alone."""
    cpu_threads: int | None = None
    """``torch.set_num_threads(n)`` applied when the model is on CPU; None (default): the
    Learner leaves your process's thread settings alone. Several training processes sharing
    a machine's cores run steadier with 1 each (``diloco learner`` sets its own)."""
    malloc_arenas: int | None = None
    """Limit glibc's malloc arenas of the process to this many when the Learner starts,
    before its threads (``mallopt(M_ARENA_MAX)``; ``diloco.learner.memory``). None (default):
    your process is left alone. 1 keeps the buffers its link threads free from staying
    resident in per-thread arenas (at 50M parameters: peak memory 1.45x the plain loop's
    with default arenas, 1.24x with one); ``diloco learner`` uses 1."""
    flush_timeout_s: float = FLUSH_TIMEOUT_S
    """How long ``close`` (and a flush on SIGTERM) waits for the final uploads to be
    answered; what is still unanswered then is the unsent tail (``close_report``). On a slow
    link give it what one whole model of the up codec takes: sign1w's 0.129 bytes per
    parameter for 0.84M parameters take 29 s at 30 kbit/s."""
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    """After the final flush, how long ``close`` waits for the merged fragments to come back,
    so a learner that stops cleanly ends holding the global values. On the syncer's clock
    the flushed progress is merged at each fragment's next tick, so the wait is at least 1.5
    cycles of the clock (H of this learner's steps), at most 30 s. 0: leave as soon as the
    syncer has accepted the flush. The flushed progress is merged all the same (the syncer
    keeps what it accepted), but this learner ends holding its own values, not the merged
    ones, and the final download (up to a whole model's worth of the down codec) is not
    sent: for a fleet whose result is the syncer's export, on links where that download
    counts. The price: a syncer that restarts before it commits the flushed progress loses
    it, since the learner is gone and cannot send it again (a draining learner whose link
    drops waits for the rejoin within this bound and sends again what the restarted
    syncer's predecessor never committed)."""
    max_stretch: int = DEFAULT_MAX_STRETCH
    """Upload pacing (``diloco.learner.pacing``): while this learner's upload backlog would
    take longer than ``pace_lag_steps`` of its steps to drain, it defers the syncer's requests,
    at most ``max_stretch - 1`` times in a row per fragment (its period stays within
    ``max_stretch × H``); 1 turns pacing off."""
    pace_lag_steps: float = DEFAULT_LAG_STEPS
    """The upload backlog, in this learner's steps, above which it defers requests."""
    step_time_decay: float = 0.9
    """EMA decay of the measured step time reported to the syncer."""
    token: str | None = field(default=None, repr=False)
    """Shared secret the syncer requires (``diloco.wire.auth.load_token`` reads it from a file
    or ``$DILOCO_TOKEN``); sent as ``authorization: Bearer …`` on every call."""
    tls_ca: str | None = None
    """PEM CA bundle to verify the syncer's certificate; setting it (or ``tls_cert``) turns
    TLS on."""
    tls_cert: str | None = None
    """PEM client certificate for mutual TLS (with ``tls_key``)."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""

    def __post_init__(self) -> None:
        if self.comms is not None:
            comms_setting(self.comms)  # a bad name is refused here, not at join
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1 (got {self.num_fragments})")
        if self.generation is not None and not 1 <= self.generation < 1 << 64:
            raise ValueError(f"generation must be in [1, 2^64) (got {self.generation})")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(
                f"alpha must be in [0, 1) (got {self.alpha}); 0 overwrites with the global value"
            )
        for name in ("flush_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0 (got {value})")


def default_learner_id() -> str:
    """A learner's id when its config names none: ``HOST-PID``."""
    import os
    import socket

    return f"{socket.gethostname()[:40]}-{os.getpid()}"

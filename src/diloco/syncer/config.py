"""Configuration of the syncer service (one keyword-only dataclass, checked on creation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.algorithm.codec_sizes import CODECS, check_codec
from diloco.algorithm.guard import (
    DEFAULT_K,
    DEFAULT_MAX_RATIO,
    DEFAULT_MIN_HISTORY,
    DEFAULT_PARAM_RATIO,
    DEFAULT_WINDOW,
    DEFAULT_ZERO_RMS,
)
from diloco.algorithm.rounds import SCHEDULES
from diloco.runtime.renamed import moved_to_protocol, renamed_keywords
from diloco.runtime.schema import on_off, option
from diloco.syncer.receipts import RETAINED_COMMIT_LOGS
from diloco.syncer.retention import COMMIT_LOG_PIN_S, MAX_COMMIT_LOGS
from diloco.wire.comms import comms_setting
from diloco.wire.protocol import ProtocolConfig

MERGE_RULES = ("rda", "mean")
"""How a round's deltas are merged (``SyncerConfig.merge_rule``); ``mean`` is an ablation."""
WEIGHTINGS = ("tokens", "uniform")
"""How contributions are weighted (``SyncerConfig.weighting``); ``uniform`` is an ablation."""
OUTER_SCALES = ("share", "none")
"""How a round's merged delta is scaled before the outer step (``SyncerConfig.outer_scale``)."""


@renamed_keywords(
    sync_every=moved_to_protocol("sync_every"),
    fragments=moved_to_protocol("num_fragments"),
    num_fragments=moved_to_protocol("num_fragments"),
)
@dataclass(kw_only=True)
class SyncerConfig:
    """The syncer's algorithm: who drives the rounds, P and H, the quorum and grace window,
    the outer step, the codecs, the merge and the norm guard (docs/algorithm.md)."""

    schedule: str = option("syncer", choices=SCHEDULES)
    """Who drives the rounds: ``"syncer"`` (the syncer's clock opens each fragment's round
    in turn and asks every live learner for it; docs/algorithm.md "The syncer's
    clock") or ``"learner"`` (each learner sends fragment p on its own step count and a round
    opens at its first arrival; what synchronous mode uses)."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    """P and H (``diloco.wire.protocol``): with the syncer's schedule, each fragment's round
    opens once per H fleet steps; a model cut by ``SyncerServer.for_model`` or the syncer
    process has P fragments (one built from an explicit layout has the layout's)."""
    early_sync_every: int = option(0, metavar="H0")
    """An H schedule on the syncer's clock: H0 instead of H for the first
    ``--early-cycles`` cycles of the clock (a cycle: each fragment merged once), then H (0:
    off; ``diloco.algorithm.rounds.scheduled_sync_every``)."""
    early_cycles: int = option(0, metavar="N")
    """Cycles of the clock that run at ``--early-sync-every``."""
    quorum: int = option(1, metavar="K")
    """K: contributions a round needs before the grace window starts."""
    gamma: float = option(0.8)
    """γ: scale of the adaptive grace window (0 disables it: close at quorum)."""
    tau: float = option(2.0)
    """τ: steps within which a merged fragment is expected back at a learner."""
    ema_decay: float = 0.8
    """Decay of the running estimates ξ_step, ξ_quorum, ξ_sync."""
    max_staleness: int = option(2)
    """Contributions up to this many versions behind are accepted (discounted), older refused."""
    wait_for_all: int = option(0, metavar="M")
    """Synchronous mode: if > 0, every round waits for this many contributions (no grace)."""
    lease_s: float = option(5.0, flag="--lease")
    """A learner is live while its last heartbeat or upload is at most this old."""
    heartbeat_s: float | None = None
    """Heartbeat interval suggested to learners (None: ``min(1 s, lease_s / 4)``)."""
    outer_lr: float = option(0.6)
    """Outer Nesterov learning rate (its sweep: benchmarks/RESULTS.md, "The outer step")."""
    outer_momentum: float = option(0.7)
    """Outer Nesterov momentum μ."""
    outer_lr_decay: int = option(0, metavar="V")
    """A cosine decay of the outer lr over each fragment's first V versions, down to
    ``--outer-lr-final`` × ``--outer-lr`` (0: a constant outer lr;
    ``diloco.algorithm.outer.scheduled_outer_lr``)."""
    outer_lr_final: float = option(0.1, metavar="F")
    """Where ``--outer-lr-decay`` ends, as a fraction of ``--outer-lr``, in (0, 1]."""
    outer_scale: str = option("share", choices=OUTER_SCALES)
    """``"share"``: scale a round's merged delta by the share of the live learners' tokens it
    holds (``diloco.algorithm.outer.round_share``), so the outer lr does not depend on M;
    ``"none"``: apply every round at the full lr."""
    up_codec: str = option(None, type=str, choices=CODECS)  # type: ignore[assignment]
    """Codec learners use for their outer gradients (default: the ``--comms`` setting's,
    sign1)."""
    down_codec: str = option(None, type=str, choices=CODECS)  # type: ignore[assignment]
    """Codec of the deltas the syncer broadcasts (``W(v) − W(v−1)``, with the rounding kept
    in W for the next one; default: the ``--comms`` setting's, int2); keyframes (join,
    resync) are always fp32."""
    down_feedback: bool = option(None, type=on_off, metavar="on|off")  # type: ignore[assignment]
    """on: what the down codec rounds away stays in ``Θ_p − W_p`` and goes out with the next
    delta (error feedback); off: every commit sets Θ_p to the W_p it sent, so the syncer and
    its learners hold the same values and the outer momentum alone carries the merged deltas
    into later steps (docs/algorithm.md, "Down without error feedback"). Default: the
    ``--comms`` setting's (on for ``default``, off for ``low`` and ``lowest``)."""
    merge_rule: str = option("rda", flag="--merge", choices=MERGE_RULES)
    """``"rda"``: radial–directional averaging for every non-embedding tensor (embeddings by
    weighted mean); ``"mean"``: weighted mean for every tensor (an ablation)."""
    weighting: str = option("tokens", choices=WEIGHTINGS)
    """``"tokens"``: ``w = tokens² / steps``; ``"uniform"``: every contribution weighs 1 (an
    ablation; the staleness discount still applies)."""
    weight_cap: float = option(3.0)
    """No contribution weighs more than this × the round's lower median weight
    (``diloco.algorithm.merge.cap_weights``); 0 turns the cap off."""
    direction_floor: float = option(0.0, metavar="COS")
    """In a round of 3 or more contributions, one whose cosine with the round's
    coordinate-wise median (``diloco.algorithm.direction.consensus_cosines``) is below this is
    left out of the merge (a reversed or unrelated delta); -1 turns the check off."""
    max_tokens_per_step: int = 1 << 24
    """Sanity bound on ``tokens / steps`` in a contribution."""
    max_steps_per_contribution: int = 1 << 24
    """Sanity bound on ``steps`` in a contribution."""
    norm_guard_k: float = option(DEFAULT_K, flag="--norm-guard", metavar="K")
    """Refuse a contribution whose norm per inner step exceeds k × the running median of its
    fragment's accepted ones, or whose norm exceeds k × the largest of the learners' median
    accepted norms of the fragment, whatever steps it claims (see ``diloco.algorithm.guard``).
    0 disables the guard."""
    norm_guard_param_ratio: float = DEFAULT_PARAM_RATIO
    """Refuse a contribution whose norm exceeds this × the fragment's own norm ‖Θ_p‖ (on the
    syncer's clock, × the H-steps it covers, at least 1/4)."""
    norm_guard_max_ratio: float = DEFAULT_MAX_RATIO
    """... but never more than this × ‖Θ_p‖, whatever steps it claims (the measurements
    behind it: ``diloco.algorithm.guard.DEFAULT_MAX_RATIO``)."""
    norm_guard_zero_rms: float = DEFAULT_ZERO_RMS
    """While ‖Θ_p‖ = 0 (nothing for the two bounds above to scale by), refuse a contribution
    whose norm exceeds this × the square root of the fragment's number of values: a root
    mean square per value (the measurements behind it:
    ``diloco.algorithm.guard.DEFAULT_ZERO_RMS``)."""
    norm_guard_window: int = DEFAULT_WINDOW
    """Accepted per-step norms per fragment the running median is taken over."""
    norm_guard_min_history: int = DEFAULT_MIN_HISTORY
    """Accepted norms a fragment needs before the median applies."""
    max_learner_ids: int = option(1024, metavar="N")
    """Distinct learner ids the syncer remembers: a new id beyond them takes the place of the
    one gone the longest, and is refused only when all of them are live."""
    commit_logs_kept: int = option(RETAINED_COMMIT_LOGS, metavar="N")
    """Commit logs the syncer keeps (memory and ``receipts.jsonl``) whatever the learners
    report: how far back the fates of accepted uploads stay known for a learner that reports
    no pin; an older one is *unknown* (``diloco.syncer.receipts``)."""
    commit_logs_max: int = option(MAX_COMMIT_LOGS, metavar="N")
    """Most commit logs kept while learners' pins still need them (``diloco.syncer.retention``):
    past it the oldest are let go anyway (``commit_logs_dropped`` on the tape) and their
    uploads' fates are unknown."""
    commit_log_pin_s: float = option(COMMIT_LOG_PIN_S, metavar="SECONDS")
    """How long after its lease a learner that stopped reporting keeps its pin on the commit
    logs (and a restarted syncer holds every log for the learners to report again)."""
    commits_per_snapshot: int = option(0, metavar="K")
    """Commits of a fragment between two full snapshots of it, written in the background
    (``diloco.syncer.snapshots``); 0 (the default): by bytes, a snapshot once the records
    past the last one hold 0.4 of a snapshot's bytes, 8 to 64 records apart
    (``diloco.syncer.snapshot_interval``). Each commit in between appends its admitted
    uploads, as they arrived, to the commit journal (``diloco.syncer.journal``); a restart
    replays the records past the snapshot. Bytes made durable per commit, per value of the
    fragment: the journal's M × u (u: the up codec's bytes per value) plus 12/K for the
    snapshot (Θ_p, momentum and wire image in fp32). By bytes that is at most about
    3.5 × M × u (while M × u ≥ 0.075; below, 64 records bind): with sign1 up (u = 0.156) a
    snapshot every 8 commits for M = 4, every 31 for M = 1; a fixed K = 8 would make one
    learner's commit write 10.6 × what it merged."""

    @staticmethod
    def upgrade_file_data(data: dict) -> dict:
        """A configuration file written before ``down_feedback`` existed holds the resolved
        H and codecs and no ``down_feedback``: its run kept the down codec's rounding, so it
        is read with down feedback on (not the value its ``--comms`` name has now)."""
        protocol = data.get("protocol")
        resolved = isinstance(protocol, dict) and "sync_every" in protocol
        if resolved and {"up_codec", "down_codec"} <= data.keys() and "down_feedback" not in data:
            return {**data, "down_feedback": True}
        return data

    def __post_init__(self) -> None:
        named = comms_setting(self.protocol.comms)  # resolved once: the config holds values
        self.up_codec = named.up_codec if self.up_codec is None else self.up_codec
        self.down_codec = named.down_codec if self.down_codec is None else self.down_codec
        if self.down_feedback is None:
            self.down_feedback = named.down_feedback
        for codec in (self.up_codec, self.down_codec):
            check_codec(codec)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES} (got {self.schedule!r})")
        if self.early_sync_every < 0 or self.early_cycles < 0:
            raise ValueError("--early-sync-every and --early-cycles must be >= 0")
        if (self.early_sync_every > 0) != (self.early_cycles > 0):
            raise ValueError("--early-sync-every and --early-cycles go together (or neither)")
        if self.early_sync_every >= self.protocol.sync_every:
            raise ValueError(
                f"--early-sync-every ({self.early_sync_every}) must be below --sync-every "
                f"({self.protocol.sync_every}): short periods first"
            )
        if self.early_sync_every and self.schedule != "syncer":
            raise ValueError("--early-sync-every needs the syncer's clock (--schedule syncer)")
        if self.merge_rule not in MERGE_RULES:
            raise ValueError(f"merge_rule must be one of {MERGE_RULES} (got {self.merge_rule!r})")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS} (got {self.weighting!r})")
        if not -1.0 <= self.direction_floor <= 1.0:
            raise ValueError(f"direction_floor must be in [-1, 1] (got {self.direction_floor})")
        if not self.weight_cap >= 0:
            raise ValueError(f"weight_cap must be >= 0 (0: off; got {self.weight_cap})")
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1 (got {self.quorum})")
        if not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0 (got {self.outer_lr})")
        if self.outer_lr_decay < 0:
            raise ValueError(f"--outer-lr-decay must be >= 0 (0: off; got {self.outer_lr_decay})")
        if not 0.0 < self.outer_lr_final <= 1.0:
            raise ValueError(f"--outer-lr-final must be in (0, 1] (got {self.outer_lr_final})")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")
        if self.gamma < 0 or self.tau < 0:
            raise ValueError(f"gamma and tau must be >= 0 (got {self.gamma}, {self.tau})")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1) (got {self.ema_decay})")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if self.wait_for_all < 0:
            raise ValueError(f"wait_for_all must be >= 0 (got {self.wait_for_all})")
        if self.wait_for_all and self.schedule != "learner":
            raise ValueError(
                "synchronous mode (wait_for_all > 0) runs on the learners' schedule: "
                "pass schedule='learner' (--schedule learner)"
            )
        beat = self.heartbeat_interval_s
        if not beat > 0 or self.lease_s < 2 * beat:
            raise ValueError(
                f"lease_s ({self.lease_s}) must be at least twice heartbeat_s ({beat}) "
                "so one lost heartbeat does not drop a learner"
            )
        if not self.norm_guard_param_ratio > 0:
            raise ValueError(
                f"norm_guard_param_ratio must be > 0 (got {self.norm_guard_param_ratio})"
            )
        if not self.norm_guard_max_ratio >= self.norm_guard_param_ratio:
            raise ValueError(
                f"norm_guard_max_ratio ({self.norm_guard_max_ratio}) must be >= "
                f"norm_guard_param_ratio ({self.norm_guard_param_ratio}): raise it too"
            )
        if not self.norm_guard_zero_rms > 0:
            raise ValueError(f"norm_guard_zero_rms must be > 0 (got {self.norm_guard_zero_rms})")
        if not self.norm_guard_k >= 0:
            raise ValueError(f"norm_guard_k must be >= 0 (0 disables it; got {self.norm_guard_k})")
        if self.norm_guard_window < 1 or self.norm_guard_min_history < 0:
            raise ValueError(
                "norm_guard_window must be >= 1 and norm_guard_min_history >= 0 "
                f"(got {self.norm_guard_window}, {self.norm_guard_min_history})"
            )
        if self.outer_scale not in OUTER_SCALES:
            raise ValueError(
                f"outer_scale must be one of {OUTER_SCALES} (got {self.outer_scale!r})"
            )
        if self.commits_per_snapshot < 0:
            raise ValueError(
                f"commits_per_snapshot must be >= 0, 0 for by bytes (got {self.commits_per_snapshot})"
            )
        if self.commit_logs_kept < 1 or self.commit_logs_max < self.commit_logs_kept:
            raise ValueError(
                "commit_logs_kept must be >= 1 and commit_logs_max >= commit_logs_kept "
                f"(got {self.commit_logs_kept}, {self.commit_logs_max})"
            )
        if not self.commit_log_pin_s >= 0:
            raise ValueError(f"commit_log_pin_s must be >= 0 (got {self.commit_log_pin_s})")
        if self.max_learner_ids < 1:
            raise ValueError(f"max_learner_ids must be >= 1 (got {self.max_learner_ids})")
        for name in ("up_codec", "down_codec"):
            if getattr(self, name) not in CODECS:
                raise ValueError(f"{name} must be one of {CODECS} (got {getattr(self, name)!r})")

    @property
    def heartbeat_interval_s(self) -> float:
        """``heartbeat_s``, or ``min(1 s, lease_s / 4)`` when it is None."""
        return self.heartbeat_s if self.heartbeat_s is not None else min(1.0, self.lease_s / 4)

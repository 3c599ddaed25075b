"""The configuration of one learner process (``diloco learner``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco.chaos import CORRUPT_HOWS
from diloco.config.common import ClientSecurityConfig, DeviceConfig, RecipeConfig
from diloco.learner.config import DRAIN_TIMEOUT_S, FLUSH_TIMEOUT_S
from diloco.learner.pacing import DEFAULT_MAX_STRETCH
from diloco.runtime.cadence import AUTO, parse_every
from diloco.runtime.schema import option, same_option
from diloco.wire.protocol import ProtocolConfig


@dataclass(kw_only=True, frozen=True)
class LearnerProtocolConfig:
    """What a learner process holds of the protocol (``ProtocolConfig``'s options, but H:
    the learner takes H from the syncer's join reply, so it has no ``--sync-every``)."""

    num_fragments: int = same_option(ProtocolConfig, "num_fragments")
    """P: fragments the model is cut into (the syncer checks it at join: the same as its
    own)."""
    comms: str | None = same_option(ProtocolConfig, "comms")
    """The most this learner's link accepts, a named communication setting
    (``diloco.wire.comms``): it refuses a syncer whose exchange costs more bytes per
    parameter per step (default: no limit)."""

    @staticmethod
    def upgrade_file_data(data: dict) -> dict:
        """A learner's configuration file once held H (``sync_every``), which it never read."""
        return {k: v for k, v in data.items() if k != "sync_every"}


@dataclass(kw_only=True)
class WorkerConfig:
    """One learner process: what it trains, which syncer it joins, when and how it stops.

    ``diloco run`` writes one per learner (``learners/<id>/config.json``) and starts
    ``diloco learner --config FILE``; by hand, every field is also a flag.
    """

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    protocol: LearnerProtocolConfig = field(default_factory=LearnerProtocolConfig)
    security: ClientSecurityConfig = field(default_factory=ClientSecurityConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    syncer: str | None = option(None, metavar="HOST:PORT[,...]")
    """Syncer address ``HOST:PORT``, or every shard's address comma-separated for a sharded
    syncer, or ``@FILE``: read it from FILE before every (re)connect (a syncer that may
    restart elsewhere); required unless ``--no-sync``."""
    no_sync: bool = option(False)
    """Train alone without a syncer (a baseline)."""
    id: str = option(metavar="ID")
    """Learner id (keep it across restarts: the syncer and the checkpoint know it by it)."""
    index: int = option(0)
    """Learner index: selects this learner's data stream."""
    batch_size: int | None = option(None, type=int)
    """Sequences per step (default: the recipe's)."""
    slow: float = option(1.0, metavar="F")
    """Emulated slowdown factor (3: each step takes 3x as long)."""
    jitter: float = option(0.0, metavar="J")
    """Each step takes up to +-J of its (slowed) cost more or less (seeded)."""
    total_steps: int = option(0)
    """Stop after this many steps (0: until SIGTERM)."""
    schedule_steps: int = option(0)
    """Length of the lr schedule (0: ``--total-steps``)."""
    schedule_seconds: float = option(0.0)
    """Fit the lr schedule to this time budget when the step count is unknown."""
    run_started_epoch_s: float = option(0.0, flag="--run-started")
    """Epoch seconds the run started (``--schedule-seconds`` counts from it; 0: now)."""
    deadline_epoch_s: float = option(0.0, flag="--deadline")
    """Epoch seconds: stop (cleanly, as on SIGTERM) at the first step boundary after it (0:
    none); for launchers whose signals may not reach the learner."""
    checkpoint_every_s: float | str = option(
        AUTO, type=parse_every, metavar="SECONDS|auto", flag="--checkpoint-every"
    )
    """Seconds between local checkpoints in ``--workdir`` (0: only at exit), or ``auto``: as
    often as keeps saving under 1% of the time, 1-300 s (``diloco.runtime.cadence``)."""
    wait_for_merge: int = option(-1, metavar="LAG")
    """Synchronous DiLoCo: before each step, wait until every fragment sent LAG or more steps
    ago came back merged (-1: never wait, the decoupled default)."""
    merge_timeout_s: float = option(120.0, flag="--merge-timeout")
    """With ``--wait-for-merge``: the longest wait before training on regardless."""
    overwrite_own: bool = option(False)
    """Apply a merge that holds this learner's delta by the paper's overwrite, dropping the
    steps trained while the delta was in flight (default: keep them)."""
    max_stretch: int = option(DEFAULT_MAX_STRETCH, metavar="K")
    """Upload pacing: while the upload backlog is long, defer the syncer's requests, at most
    K-1 times in a row per fragment (1: never defer; ``diloco.learner.pacing``)."""
    flush_timeout_s: float = option(FLUSH_TIMEOUT_S, flag="--flush-timeout", metavar="SECONDS")
    """At a clean stop (SIGTERM, the end), how long to wait for the final uploads to be
    answered; what is not is the unsent tail. On a slow link: what one whole model of the up
    codec takes on it (keep the scheduler's grace period above it)."""
    drain_timeout_s: float = option(DRAIN_TIMEOUT_S, flag="--drain-timeout", metavar="SECONDS")
    """At a clean stop, after the flush, how long to wait for the merged fragments to come
    back (on the syncer's clock at least 1.5 of its cycles, that extension capped at 30 s);
    0: leave once the syncer has accepted the flush, without the final download (the
    progress is merged all the same unless the syncer restarts before it commits it; this
    learner ends holding its own values)."""
    workdir: str | None = option(None, metavar="DIR")
    """Directory for progress and checkpoints."""
    island: str = option("ddp", choices=("ddp", "fsdp"))
    """Under torchrun with several ranks (an island): how its ranks train one model, DDP
    (each rank a whole replica) or FSDP2 (``fully_shard``: each rank holds a shard)."""
    threads: int = option(1)
    """Torch CPU threads (two 1-thread processes run steadier than one 2-thread one)."""
    join_timeout_s: float = option(60.0, flag="--join-timeout")
    """Seconds to keep trying to join the syncer before giving up."""
    report_every_s: float = option(1.0, flag="--report-every")
    """Seconds between progress lines."""
    exit_with_parent: bool = option(False)
    """Stop (cleanly) if the parent process dies."""
    corrupt: str | None = option(None, choices=CORRUPT_HOWS)
    """Chaos: damage every uploaded delta (emulated silent data corruption)."""
    corrupt_start: float = option(0.0)
    """Epoch seconds the corruption starts."""
    corrupt_end: float = option(0.0)
    """Epoch seconds it ends (0: never)."""

    def __post_init__(self) -> None:
        """Refuse stop timeouts no learner can keep (``ValueError`` naming the flag: exit 2
        at the CLI, nothing started)."""
        for flag, value in (
            ("--flush-timeout", self.flush_timeout_s),
            ("--drain-timeout", self.drain_timeout_s),
        ):
            if not 0 <= value < math.inf:
                raise ValueError(f"{flag} must be a finite number of seconds >= 0 (got {value})")

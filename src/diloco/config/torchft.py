"""The configuration of the torchft peer's processes: its lighthouse and one replica group.

:func:`diloco.baselines.torchft.peer.run_torchft` writes a :class:`ReplicaConfig` per learner
to ``<run_dir>/config/replica-<i>.json`` and starts ``python -m diloco.cli.torchft_replica
replica --config FILE``; the lighthouse takes its few flags directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config.common import RecipeConfig
from diloco.runtime.schema import option
from diloco.syncer.config import SyncerConfig
from diloco.wire.comms import DEFAULT_SETTING


@dataclass(kw_only=True, frozen=True)
class LighthouseConfig:
    """torchft's lighthouse: forms the quorum of replica groups before every sync."""

    port_file: str = option(metavar="FILE")
    """Write the lighthouse's address to this file once it listens."""
    bind: str = option("[::]:0")
    """Address to listen on (port 0: a free one)."""
    min_replicas: int = option()
    """Replica groups a quorum needs."""
    join_timeout_ms: int = option(60000)
    """How long the lighthouse waits for more replicas to join a quorum."""
    quorum_tick_ms: int = option(100)
    """How often the lighthouse checks whether a quorum can form."""
    heartbeat_timeout_ms: int = option(5000)
    """A replica that has not sent a heartbeat for this long is out of the quorum."""


@dataclass(kw_only=True, frozen=True)
class ReplicaConfig:
    """One replica group of the torchft peer (one process, world size 1, gloo on CPU)."""

    recipe: RecipeConfig = field(default_factory=lambda: RecipeConfig(recipe="tiny"))
    index: int = option()
    """This replica group's index (its data stream is learner ``index``'s)."""
    replicas: int = option()
    """M: replica groups in the run."""
    lighthouse: str | None = option(None)
    """The lighthouse's address (or give ``--lighthouse-file``)."""
    lighthouse_file: str | None = option(None, metavar="FILE")
    """File the lighthouse writes its address to (waited for)."""
    lighthouse_host: str | None = option(None)
    """Reach the lighthouse at this host, on the port it wrote (a replica on a wide-area link
    reaches it at its link's hub address, ``--wan``)."""
    host: str = option("127.0.0.1")
    """The address other replica groups reach this one at (its store and manager)."""
    workdir: str = option(metavar="DIR")
    """Progress, ``stopped`` and the final model go here."""
    batch_size: int | None = option(None, type=int)
    """Sequences per step (default: the recipe's)."""
    slow: float = option(1.0, metavar="F")
    """Emulated slowdown of each step's compute (3: it takes 3x as long)."""
    sync_every: int = option(DEFAULT_SETTING.sync_every, metavar="H")
    """H: inner steps between two syncs of the whole model."""
    fragments: int = option(1, metavar="P")
    """Streaming fragments (1: torchft's plain DiLoCo)."""
    sync_delay: int = option(0)
    """τ: inner steps a fragment's all-reduce may overlap."""
    outer_lr: float = option(SyncerConfig.outer_lr)
    """Outer SGD learning rate (our syncer's default)."""
    outer_momentum: float = option(SyncerConfig.outer_momentum)
    """Outer momentum (Nesterov when > 0; our syncer's default)."""
    rounds: int = option(0)
    """Stop at this committed step (0: none)."""
    schedule_steps: int = option(0)
    """Length of the lr schedule in steps (0: fit it to ``schedule_seconds``)."""
    schedule_seconds: float = option(0.0)
    """Fit the lr schedule to this time budget when the step count is unknown."""
    run_started_epoch_s: float = option(0.0, flag="--run-started")
    """Epoch seconds the run started (the lr schedule's clock; 0: now)."""
    min_replica_size: int = option(1)
    """Replica groups a sync needs to commit."""
    timeout_s: float = option(60.0)
    """Seconds a collective or the store may take."""
    quorum_timeout_s: float = option(120.0)
    """Seconds a quorum may take to form."""
    hard_deadline_epoch_s: float = option(0.0, flag="--hard-deadline")
    """Exit at this epoch time whatever happens (0: none)."""
    threads: int = option(1)
    """Torch CPU threads."""

    @property
    def total_steps(self) -> int:
        """No step budget: a replica stops at a committed step or when told (the lr schedule
        reads ``schedule_steps`` / ``schedule_seconds``)."""
        return 0

    def __post_init__(self) -> None:
        if (self.lighthouse is None) == (self.lighthouse_file is None):
            raise ValueError("give exactly one of --lighthouse and --lighthouse-file")
        if self.fragments < 1 or self.sync_every % self.fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of fragments ({self.fragments})"
            )

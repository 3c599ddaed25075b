"""The configuration of the torchft peer: the whole run, its lighthouse, one replica group.

:class:`PeerSettings` are the settings of a run (:func:`diloco.baselines.torchft.peer.run_torchft`,
``python -m diloco.cli.torchft_peer``). The run writes a :class:`ReplicaConfig` per learner
to ``<run_dir>/config/replica-<i>.json`` and starts ``python -m diloco.cli.torchft_replica
replica --config FILE``; the lighthouse takes its few flags directly. Each default is written
once: a peer's setting that a replica or the lighthouse also has takes theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diloco.config.common import RecipeConfig
from diloco.runtime.schema import option, same_option
from diloco.syncer.config import SyncerConfig
from diloco.wire.comms import DEFAULT_SETTING

PEER_RECIPE = "tiny"
"""The recipe the peer trains unless told (its tests and smoke runs)."""


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

    recipe: RecipeConfig = field(default_factory=lambda: RecipeConfig(recipe=PEER_RECIPE))
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


def parse_slow_item(text: str) -> tuple[int, float]:
    """``"1=3"`` -> ``(1, 3.0)``: replica 1 three times slower (``ValueError`` otherwise)."""
    index, sep, factor = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(index), float(factor)
    except ValueError:
        raise ValueError(f"--slow wants I=F, got {text!r}") from None


@dataclass(kw_only=True, frozen=True)
class PeerSettings:
    """One run of the torchft peer (the keyword arguments of
    :func:`diloco.baselines.torchft.peer.run_torchft`, whose docstring says how they act);
    each option is also a flag of ``python -m diloco.cli.torchft_peer``."""

    learners: int = option(2, short="-m", metavar="M")
    """M: replica groups (one process each)."""
    recipe: str = option(PEER_RECIPE)
    """Model recipe, as ``diloco run --recipe``."""
    data: str | None = same_option(RecipeConfig, "data")
    """Train a text recipe on this UTF-8 file instead of Shakespeare's plays."""
    seed: int = same_option(RecipeConfig, "seed")
    """Seed of the initial model and of the data streams."""
    minutes: float = option(1.0)
    """Wall-clock budget in minutes (0: none)."""
    tokens: int = option(0)
    """Token budget over all replicas (0: none)."""
    rounds: int = option(0)
    """Stop after this many committed syncs (0: none)."""
    sync_every: int = same_option(ReplicaConfig, "sync_every")
    """H: inner steps between two syncs of the whole model (our default)."""
    fragments: int = same_option(ReplicaConfig, "fragments")
    """Streaming fragments P (1: torchft's plain DiLoCo)."""
    sync_delay: int = same_option(ReplicaConfig, "sync_delay")
    """τ: inner steps a fragment's all-reduce may overlap."""
    outer_lr: float = same_option(ReplicaConfig, "outer_lr")
    """Outer SGD learning rate (our syncer's default)."""
    outer_momentum: float = same_option(ReplicaConfig, "outer_momentum")
    """Outer momentum, Nesterov when > 0 (our syncer's default)."""
    slow: dict[int, float] = option(default_factory=dict, type=parse_slow_item, metavar="I=F")
    """Emulated slower hardware: replica I takes F times as long per inner step
    (repeatable)."""
    batch_size: int = option(0)
    """Sequences per step (0: the recipe's)."""
    run_dir: str | Path | None = option(None, metavar="DIR")
    """Keep logs, progress and final models here (default: a temporary directory, removed)."""
    wan: tuple[str, ...] = option((), metavar="SPEC")
    """Every replica group on its own shaped link, as ``diloco run --wan`` (repeatable; root
    only)."""
    threads: int = ReplicaConfig.threads
    """Torch CPU threads of each replica process."""
    min_replicas: int = 0
    """Replica groups a quorum needs (0: all of them)."""
    join_timeout_ms: int = LighthouseConfig.join_timeout_ms
    """The lighthouse's wait for more replicas to join a quorum."""
    quorum_tick_ms: int = LighthouseConfig.quorum_tick_ms
    """How often the lighthouse checks whether a quorum can form."""
    heartbeat_timeout_ms: int = LighthouseConfig.heartbeat_timeout_ms
    """A replica silent for this long is out of the quorum."""
    start_timeout_s: float = 120.0
    """A replica must complete its first sync within this many seconds of the start."""
    stop_timeout_s: float = 30.0
    """How long replicas may take to stop once the budget is spent (plus one sync period)."""
    max_minutes: float = 60.0
    """Bounds every run, whatever its budget."""

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1 (got {self.learners})")
        if not (self.minutes > 0 or self.tokens > 0 or self.rounds > 0):
            raise ValueError("give a budget: minutes, tokens or rounds")
        frags, every = self.fragments, self.sync_every
        if frags < 1 or every < frags or every % frags:
            raise ValueError(
                f"torchft needs sync_every ({every}) to be a multiple of fragments ({frags})"
            )
        for i, factor in self.slow.items():
            if not 0 <= i < self.learners or not factor >= 1.0:
                raise ValueError(
                    f"slow: learner {i} factor {factor} (index < {self.learners}, factor >= 1)"
                )

    @property
    def quorum(self) -> int:
        """Replica groups a quorum needs (``min_replicas``, 0: all of them)."""
        return self.min_replicas or self.learners

    @property
    def budget_s(self) -> float:
        return self.minutes * 60 if self.minutes else self.max_minutes * 60

"""The configuration of one rank of the data-parallel baseline (``diloco dp-worker``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config.common import RecipeConfig
from diloco.runtime.cadence import AUTO, parse_every
from diloco.runtime.schema import option


@dataclass(kw_only=True)
class DpWorkerConfig:
    """One rank of a static data-parallel group (``diloco run --mode dp`` starts M of them)."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    store: str = option(metavar="HOST:PORT")
    """The supervisor's ``TCPStore``."""
    generation: int = option(0)
    """Rendezvous generation (the supervisor bumps it when the group restarts)."""
    rank: int = option()
    """This rank."""
    world: int = option()
    """Ranks in the group."""
    batch_size: int | None = option(None, type=int)
    """Sequences per step (default: the recipe's)."""
    slow: float = option(1.0, metavar="F")
    """Emulated slowdown factor (3: each step takes 3x as long)."""
    total_steps: int = option(0)
    """Stop after this many steps (0: until SIGTERM)."""
    schedule_steps: int = option(0)
    """Length of the lr schedule (0: ``--total-steps``)."""
    schedule_seconds: float = option(0.0)
    """Fit the lr schedule to this time budget when the step count is unknown."""
    run_started_epoch_s: float = option(0.0, flag="--run-started")
    """Epoch seconds the run started (``--schedule-seconds`` counts from it; 0: now)."""
    checkpoint_dir: str = option(metavar="DIR")
    """The group's checkpoint directory."""
    checkpoint_every_s: float | str = option(
        AUTO, type=parse_every, metavar="SECONDS|auto", flag="--checkpoint-every"
    )
    """Seconds between group checkpoints, or ``auto`` (``diloco.runtime.cadence``)."""
    workdir: str = option(metavar="DIR")
    """This rank's progress file goes here."""
    snapshot: str | None = option(None, metavar="FILE")
    """Rank 0 keeps the current parameters in this file (for the evaluator)."""
    snapshot_every: float = option(5.0)
    """Seconds between snapshots."""
    report_every_s: float = option(1.0, flag="--report-every")
    """Seconds between progress lines."""
    threads: int = option(1)
    """Torch CPU threads."""
    rendezvous_timeout_s: float = option(120.0, flag="--rendezvous-timeout")
    """Seconds the group may take to assemble."""
    collective_timeout_s: float = option(300.0, flag="--collective-timeout")
    """Seconds a collective may wait for a hung rank before the group fails."""
    exit_with_parent: bool = option(False)
    """Stop (cleanly) if the parent process dies."""

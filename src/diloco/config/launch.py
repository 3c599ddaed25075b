"""The configuration of ``diloco launch``: a syncer for the user's model and N copies of the
user's own training script (``diloco.launch.script``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config.run import RayConfig
from diloco.dashboard.wandb_log import WANDB_MODES
from diloco.learner.config import close_bound_s
from diloco.runtime.cadence import AUTO, parse_every
from diloco.runtime.procs import MAX_UNPLANNED_RESTARTS
from diloco.runtime.schema import option
from diloco.syncer.config import SyncerConfig


@dataclass(kw_only=True)
class LaunchConfig:
    """A syncer serving ``--model`` and N copies of a training script that joins it with
    ``diloco.Learner.from_env`` (docs/own-model.md)."""

    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    learners: int = option(2, metavar="N")
    """N: copies of the script."""
    model: str | None = option(None, metavar="MODULE:CALLABLE")
    """The model the script trains: ``CALLABLE()`` of ``MODULE`` (imported from the working
    directory) builds it exactly as the script does; the syncer serves it (required)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """``--backend local|ray`` and the Ray options of ``diloco run``: with ray the copies
    are Ray actors placed as ``diloco run`` places learners (``diloco.launch.ray_script``);
    ``--max-restarts`` bounds their restarts (``--ray-max-restarts`` is refused)."""
    max_restarts: int = option(MAX_UNPLANNED_RESTARTS, metavar="K")
    """A copy that fails (exits non-zero, or is killed) is restarted from its checkpoint,
    at most K times; once more fails the run (the others are stopped)."""
    eval: str | None = option(None, metavar="MODULE:CALLABLE")
    """Score the global model as it goes: ``CALLABLE(model)`` returns its held-out loss (a
    float; the model is ``--model``'s, holding the global values)."""
    eval_every: float = option(5.0, metavar="SECONDS")
    """Seconds between ``--eval`` scores (0: only at the start and the end)."""
    minutes: float = option(0.0)
    """Wall-clock budget: stop the copies (they flush) after this long (0: none; the run
    ends when every copy has ended)."""
    checkpoint_every_s: float | str = option(
        AUTO, type=parse_every, metavar="SECONDS|auto", flag="--checkpoint-every"
    )
    """Seconds between each copy's checkpoints, or ``auto`` (``diloco.runtime.cadence``)."""
    name: str | None = option(None)
    """Run name (default: the start time)."""
    runs_dir: str = option("runs", metavar="DIR")
    """Where run directories go."""
    json: bool = option(False)
    """Print the summary as JSON."""
    no_view: bool = option(False)
    """No live view."""
    token_file: str | None = option(None, metavar="FILE")
    """The run's shared secret (default: ``$DILOCO_TOKEN``, else a fresh one in
    ``<run dir>/token``); each copy gets its own token derived from it."""
    dashboard: str = option("127.0.0.1:0", metavar="HOST:PORT|off")
    """Serve the live dashboard here (port 0: a free port; off: none), as ``diloco run``."""
    tensorboard: bool = option(True)
    """Write TensorBoard scalars to ``<run dir>/tensorboard/`` while the run goes."""
    wandb: str = option("off", choices=WANDB_MODES)
    """Log the same scalars to Weights & Biases (``offline`` or ``online``)."""
    wandb_project: str = option("diloco", metavar="NAME")
    """The W&B project of ``--wandb``."""
    start_timeout_s: float = option(60.0, hidden=True, flag="--start-timeout")
    """Seconds the syncer may take to start before the run fails."""
    script: str = ""
    """The training script (a positional argument)."""
    args: list[str] = field(default_factory=list)
    """The script's own arguments (everything after it)."""

    # what the shared supervisor loop of ``diloco run`` asks of a configuration
    tokens = 0
    steps = 0
    shards = 1
    mode = "decoupled"

    @property
    def backend(self) -> str:
        """``local`` or ``ray`` (``--backend``)."""
        return self.ray.backend

    @property
    def stop_after_s(self) -> float:
        """Seconds copies get to flush and exit at a stop before they are killed: a
        learner's clean stop at its defaults, and 5 s."""
        return close_bound_s() + 5.0

    def __post_init__(self) -> None:
        from diloco.runtime.model_ref import check_model_ref

        if self.learners < 1:
            raise ValueError(f"--learners must be >= 1 (got {self.learners})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if self.minutes < 0 or self.eval_every < 0:
            raise ValueError("--minutes and --eval-every must be >= 0")
        if self.model is None:
            raise ValueError("--model MODULE:CALLABLE is required: the model the script trains")
        check_model_ref(self.model)
        if self.eval is not None:
            try:
                check_model_ref(self.eval)
            except ValueError as exc:
                raise ValueError(str(exc).replace("--model", "--eval")) from None
        if self.dashboard != "off":
            from diloco.wire.auth import split_address

            split_address(self.dashboard, what="--dashboard")

"""The configuration of one syncer process (``diloco syncer``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from diloco.config.common import RecipeConfig, ServerSecurityConfig
from diloco.runtime.schema import option
from diloco.syncer.config import SyncerConfig
from diloco.syncer.limits import DEFAULT_MAX_LEARNERS


@dataclass(kw_only=True)
class ServiceConfig:
    """One syncer (or syncer shard) process: the model it serves, its settings (with the
    protocol's P and H: ``syncer.protocol``), where it
    listens and keeps its state.

    ``diloco run`` writes one (``syncer.json``) and starts ``diloco syncer --config FILE``
    with each shard's own ``--shard``, ``--state-dir`` and ``--port-file``.
    """

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    security: ServerSecurityConfig = field(default_factory=ServerSecurityConfig)
    bind: str = option("127.0.0.1:7000", metavar="HOST:PORT")
    """Address to listen on (port 0 picks a free port)."""
    port_file: str | None = option(None, metavar="FILE")
    """Write the bound ``host:port`` here once serving."""
    state_dir: str | None = option(None, metavar="DIR")
    """Durable state directory (restored on restart)."""
    tape: str | None = option(None, metavar="FILE")
    """Event tape path (default ``STATE_DIR/events.jsonl``)."""
    accept_rollback: bool = option(False)
    """Serve a state directory that was rolled back (a backup restored: its tape records
    newer versions of it) as a new lineage: learners holding the lost versions take keyframes
    and count what they cannot account for as unknown (``diloco.syncer.lineage``). Without
    it such a directory is refused (exit 2). Give it once, for the start after the restore."""
    dashboard: str | None = option(None, metavar="HOST:PORT")
    """Serve the live dashboard and Prometheus ``/metrics`` here (default: none; needs the
    tape: ``--state-dir`` or ``--tape``). A network address needs ``--token-file``; the page
    then takes the token or the read-only viewer token in the printed link."""
    shard: str = option("0/1", metavar="I/S")
    """Serve only shard I of S: the fragments p with p mod S == I (0/1: all); start S syncers
    with 0/S .. S-1/S and give learners every address (docs/deploy.md)."""
    max_learners: int = option(DEFAULT_MAX_LEARNERS, metavar="N")
    """Learners (training at once) the syncer is sized for: its caps on open uploads and
    subscriptions (N each, + 8 subscriptions for observers) and its thread pool
    (``diloco.syncer.limits``); at most ``--max-learner-ids``."""
    model: str | None = option(None, metavar="MODULE:CALLABLE")
    """Serve your own model instead of a recipe's: ``CALLABLE()`` of ``MODULE`` (imported
    from the working directory) returns it, built as every learner builds it
    (``diloco.runtime.model_ref``; docs/own-model.md)."""
    stop_when_learners_leave: bool = option(False)
    """Exit (0) once every learner that joined has left (or its stream closed) with nothing
    of it still to merge, and none came back within the lease (``--lease``); a learner whose
    lease expired while its stream stays open, or one still flushing, keeps the run going."""
    max_tokens: int = option(0, metavar="N")
    """Exit (0) once the syncer has merged N tokens into the global model (0: no budget;
    the tokens its commits merged, per fragment, averaged over its fragments; what learners
    claim in heartbeats never counts). Give learners their own budget too: this one stops
    the syncer, not them."""
    snapshot_every_s: float = option(0.0, flag="--snapshot-every", metavar="SECONDS")
    """Write the global model as the model's own ``state_dict`` (safetensors) every SECONDS
    and at exit (0: only with ``--snapshot``, and then only at exit)."""
    snapshot: str | None = option(None, metavar="FILE")
    """Where snapshots go (default ``STATE_DIR/global.safetensors``)."""
    threads: int = option(1)
    """Torch CPU threads."""
    commit_threads: int = option(2, metavar="N")
    """Threads a commit's passes over a fragment (the merge, the outer step, the down step)
    are split over; the bits do not depend on N (``diloco.algorithm.chunk_threads``)."""
    exit_with_parent: bool = option(False)
    """Stop (cleanly) if the parent process dies."""

    def __post_init__(self) -> None:
        from diloco.runtime.model_ref import check_model_ref
        from diloco.wire.auth import split_address

        split_address(self.bind, what="--bind")
        if self.model is not None:
            check_model_ref(self.model)
        if not 1 <= self.max_learners <= self.syncer.max_learner_ids:
            raise ValueError(
                f"--max-learners must be in [1, --max-learner-ids ({self.syncer.max_learner_ids})]"
                f", got {self.max_learners}"
            )
        if self.commit_threads < 1 or self.threads < 1:
            raise ValueError("--commit-threads and --threads must be >= 1")
        if self.max_tokens < 0 or self.snapshot_every_s < 0:
            raise ValueError("--max-tokens and --snapshot-every must be >= 0")
        if self.snapshot_every_s > 0 and not (self.snapshot or self.state_dir):
            raise ValueError("--snapshot-every needs --snapshot FILE or --state-dir")
        if (self.snapshot_every_s > 0 or self.snapshot) and self.shard not in ("0/1", ""):
            raise ValueError(
                "snapshots need the whole model: a sharded syncer's run is exported with "
                "diloco export"
            )
        if self.dashboard is not None:
            split_address(self.dashboard, what="--dashboard")
            if not (self.state_dir or self.tape):
                raise ValueError("--dashboard draws the event tape: give --state-dir or --tape")

    @property
    def snapshot_path(self) -> str | None:
        """Where this syncer writes its snapshots (None: it writes none)."""
        if self.snapshot:
            return self.snapshot
        if self.snapshot_every_s > 0 and self.state_dir:
            return os.path.join(self.state_dir, "global.safetensors")
        return None

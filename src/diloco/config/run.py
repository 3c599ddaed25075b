"""The configuration of a whole run (``diloco run``), composed of its components' ones.

``RunConfig`` is the one schema of a run: ``diloco run`` builds it from its flags, writes it to
``runs/<name>/config.json``, derives each child's configuration from it (the syncer's
``ServiceConfig``, each learner's ``WorkerConfig``, written beside them) and the simulator's
twin reads it back (``diloco.sim.twin``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diloco.config.common import DeviceConfig, RecipeConfig
from diloco.dashboard.wandb_log import WANDB_MODES
from diloco.learner.config import DRAIN_TIMEOUT_S, FLUSH_TIMEOUT_S, close_bound_s
from diloco.learner.pacing import DEFAULT_MAX_STRETCH
from diloco.runtime.cadence import AUTO, parse_every
from diloco.runtime.schema import option
from diloco.syncer.config import SyncerConfig

MODES = ("decoupled", "sync", "dp")
"""``diloco run --mode``: decoupled rounds, synchronous DiLoCo, or the data-parallel baseline."""
BACKENDS = ("local", "ray")
"""Where ``diloco run`` starts its processes: on this machine, or as Ray actors."""


@dataclass(kw_only=True)
class RayConfig:
    """The Ray backend (``--backend ray``); the local backend refuses the ``ray`` options."""

    backend: str = option("local", choices=BACKENDS)
    """local: processes on this machine; ray: actors on a Ray cluster."""
    address: str | None = option(None)
    """Ray cluster to join, e.g. auto (default: start a local Ray instance for the run)."""
    ray_learner_cpus: float | None = option(None, type=float)
    """CPUs Ray reserves per learner (default 1)."""
    ray_learner_gpus: float | None = option(None, type=float)
    """GPUs Ray reserves per learner (default 0)."""
    ray_syncer_cpus: float | None = option(None, type=float)
    """CPUs Ray reserves for the syncer (default 1)."""
    ray_max_restarts: int | None = option(None, type=int)
    """Times Ray restarts a failed learner (default -1: always); the syncer: always."""
    ray_syncer_host: str | None = option(None)
    """Host the syncer binds on its node (default 127.0.0.1 for a local Ray instance, the
    node's IP with ``--address``; a non-loopback bind needs ``--token-file``)."""
    ray_learner_resources: str | None = option(None, metavar="NAME[,NAME...]")
    """Spread learners over nodes by custom resources: learner i runs on a node that has
    resource NAME[i mod k] (it asks 0.001 of it: a label, e.g. one region per node)."""
    ray_syncer_resource: str | None = option(None, metavar="NAME[,NAME...]")
    """Run the syncer on a node that has this custom resource instead of the node of
    ``diloco run`` (with ``--shards S``: shard i on a node with NAME[i mod k]; one name per
    shard puts each on its own node): if that node is lost Ray restarts the syncer (shard) on
    another node that has it, from its state directory (``--runs-dir`` shared by the nodes),
    and the learners follow its new address (they read it from its port file: ``--syncer
    @FILE``)."""


@dataclass(kw_only=True)
class RunConfig:
    """A syncer, M learners and an evaluator (``diloco run``); see docs/cli.md."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    syncer: SyncerConfig = field(default_factory=SyncerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    learners: int = option(2, short="-m", metavar="M")
    """M: learner processes."""
    minutes: float = option(3.0)
    """Wall-clock budget (0: none)."""
    tokens: int = option(0)
    """Stop after this many tokens in total (0: no limit)."""
    steps: int = option(0)
    """Each learner stops after this many steps (0: no limit)."""
    mode: str = option("decoupled", choices=MODES)
    """decoupled: asynchronous rounds (quorum + grace); sync: every round waits for all M; dp:
    data-parallel baseline (all-reduce every step, group restarts on failure)."""
    batch_size: int | None = option(None, type=int)
    """Batch size of every learner (default: the recipe's)."""
    batch: list[str] = option(default_factory=list, metavar="I=N")
    """Batch size of learner I (repeatable)."""
    slow: list[str] = option(default_factory=list, metavar="I=F")
    """Learner I takes F times as long per step (repeatable), e.g. ``--slow 1=3``."""
    add_learners: list[str] = option(default_factory=list, metavar="AT:N")
    """Start N more learners AT into the run, e.g. ``90s:2`` (repeatable): capacity that
    joins mid-run ("scavenging"); their indices follow the first M (``--batch``/``--slow``
    may name them). Decoupled mode, or data-parallel (the group stops and starts again at the
    new size); local backend; the chaos schedule spares them."""
    jitter: float = option(0.0, metavar="J")
    """Every learner's step time varies by up to +-J of its (slowed) cost, seeded per learner
    (e.g. 0.2 with ``--slow`` for a mixed fleet)."""
    max_stretch: int = option(DEFAULT_MAX_STRETCH, metavar="K")
    """Learners on a slow link defer requests while their upload backlog is long, at most K-1
    times in a row per fragment (1: never; ``diloco.learner.pacing``)."""
    flush_timeout_s: float = option(FLUSH_TIMEOUT_S, flag="--flush-timeout", metavar="SECONDS")
    """At their clean stop, how long learners wait for their final uploads to be answered
    (what is not is their unsent tail): on slow links (``--wan``), what one whole model of
    the up codec takes on the link."""
    drain_timeout_s: float = option(DRAIN_TIMEOUT_S, flag="--drain-timeout", metavar="SECONDS")
    """At their clean stop, how long learners wait for their flushed progress to come back
    merged; 0: they leave once the syncer has accepted it, without the final download (a
    whole model's worth of the down codec per learner; the export, the syncer's Θ, holds
    the flushed progress all the same)."""
    overwrite_own: bool = option(False)
    """Learners apply a merge holding their own delta by the paper's overwrite, dropping the
    steps trained while it was in flight (default: keep them)."""
    eval_every: float = option(5.0)
    """Seconds between evaluations (0: only at the start and the end)."""
    chaos: str = option("", metavar="SPEC")
    """Inject failures, e.g. ``kill:mtbf=60s,down=5-15s;syncer-kill:at=120s`` (docs/cli.md)."""
    spares: int = option(-1, metavar="N")
    """Warm spare processes (torch imported) that restarted learners run in, for fast
    restarts; local backend (-1: two when ``--chaos`` kills learners, or the whole group with
    ``--mode dp``; else none)."""
    checkpoint_every_s: float | str = option(
        AUTO, type=parse_every, metavar="SECONDS|auto", flag="--checkpoint-every"
    )
    """Seconds between the learners' (or the data-parallel group's) checkpoints, or ``auto``:
    as often as keeps saving under 1% of the time (``diloco.runtime.cadence``)."""
    name: str | None = option(None)
    """Run name (default: the start time)."""
    runs_dir: str = option("runs", metavar="DIR")
    """Where run directories go."""
    json: bool = option(False)
    """Print the summary as JSON."""
    no_view: bool = option(False)
    """No live view."""
    shards: int = option(1, metavar="S")
    """Start S syncer processes, each owning the fragments p mod S == i."""
    token_file: str | None = option(None, metavar="FILE")
    """The run's shared secret (default: ``$DILOCO_TOKEN``, else a fresh one in
    ``<run dir>/token``); each learner and the evaluator get their own token derived from it
    (docs/security.md)."""
    dashboard: str = option("127.0.0.1:0", metavar="HOST:PORT|off")
    """Serve the live dashboard and Prometheus ``/metrics`` here (port 0: a free port; off:
    none); its link, with the run's read-only viewer token, is printed and written to
    ``<run dir>/dashboard.url``. A network address needs the run's token (as the syncer)."""
    tensorboard: bool = option(True)
    """Write TensorBoard scalars to ``<run dir>/tensorboard/`` while the run goes."""
    wandb: str = option("off", choices=WANDB_MODES)
    """Log the same scalars to Weights & Biases: ``offline`` (``<run dir>/wandb/``, upload
    later with ``wandb sync``) or ``online`` (needs ``pip install wandb`` and a login)."""
    wandb_project: str = option("diloco", metavar="NAME")
    """The W&B project of ``--wandb``."""
    wan: list[str] = option(default_factory=list, metavar="SPEC")
    """Put each learner on its own shaped wide-area link (root only; repeatable; docs/wan.md):
    ``rate=50mbit,rtt=40ms`` for every learner, ``2,3:rate=5mbit,rtt=80ms`` for learners 2
    and 3."""
    start_timeout_s: float = option(60.0, flag="--start-timeout", metavar="SECONDS")
    """Seconds a process may take to start (and the syncer to answer) before the run fails."""
    stop_timeout_s: float | None = option(
        None, type=float, flag="--stop-timeout", metavar="SECONDS"
    )
    """Seconds learners get to flush and exit at the end before they are killed; default:
    their clean stop's bound at ``--flush-timeout`` and ``--drain-timeout``
    (``diloco.learner.config.close_bound_s``: 65 s at the defaults) and 5 s (before
    2026-11-27 30 s, which killed learners of ``--comms lowest`` still draining on a
    100 kbit/s link)."""

    @property
    def stop_after_s(self) -> float:
        """Seconds learners get to stop cleanly at the end before they are killed:
        ``--stop-timeout``, else their clean stop's bound at ``--flush-timeout`` and
        ``--drain-timeout`` and 5 s."""
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        return close_bound_s(self.flush_timeout_s, self.drain_timeout_s) + 5.0

    def __post_init__(self) -> None:
        """Refuse values no run can have (``ValueError`` naming the flag: exit 2 at the CLI)."""
        for flag, value, low in (
            ("--learners", self.learners, 1),
            ("--shards", self.shards, 1),
            ("--max-stretch", self.max_stretch, 1),
            ("--minutes", self.minutes, 0),
            ("--tokens", self.tokens, 0),
            ("--steps", self.steps, 0),
            ("--eval-every", self.eval_every, 0),
        ):
            if not value >= low:
                raise ValueError(f"{flag} must be >= {low} (got {value})")
        for flag, value in (
            ("--flush-timeout", self.flush_timeout_s),
            ("--drain-timeout", self.drain_timeout_s),
            ("--stop-timeout", self.stop_timeout_s or 0.0),
        ):
            if not 0 <= value < math.inf:
                raise ValueError(f"{flag} must be a finite number of seconds >= 0 (got {value})")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1 (got {self.batch_size})")
        if self.mode != "decoupled" and self.syncer.early_sync_every:
            raise ValueError("--early-sync-every needs --mode decoupled (the syncer's clock)")
        if self.mode == "dp" and self.device != DeviceConfig():
            raise ValueError("--device/--bf16 are for learners; --mode dp trains on CPU")
        if self.dashboard != "off":
            from diloco.wire.auth import split_address

            split_address(self.dashboard, what="--dashboard")


def load_run_config(path) -> RunConfig:
    """A ``RunConfig`` from a JSON file (a run directory's ``config.json``) or a TOML file
    (``ConfigError`` naming what does not fit)."""
    from diloco.runtime.config_files import read_config_file

    return read_config_file(path, RunConfig)

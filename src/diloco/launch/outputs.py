"""The live outputs of ``diloco run``: the dashboard (page, JSON snapshot, Prometheus
``/metrics``), the TensorBoard scalars in ``runs/<name>/tensorboard/`` and, with ``--wandb``,
the same scalars in Weights & Biases.

The dashboard's socket is bound before the run starts anything (a busy or invalid
``--dashboard`` is an error of the command, exit 2) and before ``--wan`` moves the supervisor
into its hub namespace, so the page stays reachable from this host's own loopback. The link
it prints carries the run's read-only viewer token (``diloco.wire.auth.viewer_token``) and is
also written to ``runs/<name>/dashboard.url`` (mode 0600).
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco.config.run import RunConfig
from diloco.dashboard.live import LiveOutputs
from diloco.dashboard.watch import RunWatch
from diloco.recipes import recipe_of

DASHBOARD_OFF = "off"


def open_outputs(config: RunConfig, run_dir: Path, token: str | None) -> LiveOutputs:
    """Bind and start the dashboard (unless ``--dashboard off``) and prepare the scalars
    (unless ``--no-tensorboard``). Raises ``OSError`` (address busy), ``ValueError`` (not
    ``HOST:PORT``) or ``AuthConfigError`` (a network address without a token)."""
    from diloco.dashboard.server import DashboardServer
    from diloco.dashboard.tensorboard import ScalarLog
    from diloco.dashboard.wandb_log import WandbLog

    sinks = [ScalarLog(run_dir / "tensorboard")] if config.tensorboard else []
    if config.wandb != "off":
        sinks.append(
            WandbLog(run_dir, name=run_dir.name, project=config.wandb_project, mode=config.wandb)
        )
    outputs = LiveOutputs(scalars=sinks)
    if config.dashboard != DASHBOARD_OFF:
        outputs.server = DashboardServer(outputs.snapshot, bind=config.dashboard, token=token)
        outputs.server.start()
        fd = os.open(run_dir / "dashboard.url", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(outputs.server.url + "\n")
    return outputs


def run_watch(config: RunConfig, run_dir: Path, plans, started: float) -> RunWatch:
    """The watch of a run directory: its tape, metrics and the learners' progress files."""
    return RunWatch(
        tape=run_dir / "syncer" / "events.jsonl",
        fragments=config.syncer.protocol.num_fragments,
        started=started,
        mode=config.mode,
        name=run_dir.name,
        budget_s=config.minutes * 60 if config.minutes else None,
        metrics=run_dir / "metrics.jsonl",
        progress={p.id: run_dir / "learners" / p.id / "progress.jsonl" for p in plans},
        loss_unit=recipe_of(config.recipe).loss_unit,
    )

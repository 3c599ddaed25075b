"""A run's scalars in Weights & Biases (``diloco run --wandb offline|online``): the same
points as TensorBoard's (``diloco.dashboard.tensorboard.scalar_points``), each logged with
``train/tokens`` as its step metric.

``offline`` writes ``runs/<name>/wandb/`` (``wandb sync`` uploads it later); ``online`` needs
the ``wandb`` package and the user's own login. ``wandb`` is imported only here, only when
asked for (``pip install 'diloco[wandb]'``).
"""

from __future__ import annotations

from pathlib import Path

from diloco.dashboard.tensorboard import scalar_points
from diloco.runtime.optional import import_optional

WANDB_MODES = ("off", "offline", "online")


def check_wandb(mode: str) -> None:
    """Refuse ``--wandb MODE`` where the ``wandb`` package is missing (``MissingExtra``, one
    line naming the extra), before a run starts anything."""
    if mode != "off":
        import_optional("wandb", "wandb", f"--wandb {mode}")


def rows_of(points) -> list[dict]:
    """W&B rows of ``points``, in order: points of one step share a row, but never two of one
    tag (two evaluations at the same tokens are two rows, as they are two TensorBoard
    points)."""
    rows: list[dict] = []
    for p in points:
        if not rows or rows[-1]["train/tokens"] != p.step or p.tag in rows[-1]:
            rows.append({"train/tokens": p.step})
        rows[-1][p.tag] = p.value
    return rows


class WandbLog:
    """Logs a run's scalars to one W&B run (started on first write)."""

    def __init__(self, run_dir: str | Path, *, name: str, project: str, mode: str) -> None:
        if mode not in WANDB_MODES[1:]:
            raise ValueError(f"--wandb must be one of {', '.join(WANDB_MODES)}")
        self.run_dir, self.name, self.project, self.mode = Path(run_dir), name, project, mode
        self._run = None
        self._loss_t = float("-inf")

    def write(self, snapshot: dict) -> None:
        if self._run is None:
            import wandb

            self._run = wandb.init(
                project=self.project,
                name=self.name,
                dir=str(self.run_dir),
                mode=self.mode,
                settings=wandb.Settings(console="off"),
            )
            self._run.define_metric("train/tokens")
            self._run.define_metric("*", step_metric="train/tokens")
        points, self._loss_t = scalar_points(snapshot, self._loss_t)
        for row in rows_of(points):
            self._run.log(row)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

"""A run's scalars (``runs/<name>/tensorboard/``, and Weights & Biases with ``--wandb``),
written from its snapshots.

:func:`scalar_points` turns a snapshot into points, one per scalar, with the run's total
tokens as the step and the snapshot's time as the wall time; held-out losses come once
each, at the tokens and time they were measured. Every sink writes the same points. Tags:

- ``heldout/loss``; ``train/tokens``, ``train/goodput``;
- ``rounds/total``, ``rounds/per_second``, ``rounds/contributors_mean``;
- ``bytes/up``, ``bytes/down``;
- ``learner/<id>/tokens_per_second``, ``learner/<id>/steps_per_second``.

``tensorboard --logdir runs`` shows every run side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    tag: str
    value: float
    step: int
    """The run's total tokens when it was measured."""
    wall: float
    """Epoch seconds when it was measured."""


def scalar_points(snapshot: dict, losses_after: float) -> tuple[list[Point], float]:
    """The snapshot's points (see the module docstring), with only the held-out losses
    measured after ``losses_after`` (seconds since the start); and the newest loss's time."""
    s = snapshot
    started = s["t"] - s["elapsed_s"]
    step, wall = int(s["tokens"]), s["t"]
    points: list[Point] = []
    newest = losses_after
    for t, loss, tokens in s["loss"]:
        if t > newest and loss is not None:
            points.append(Point("heldout/loss", float(loss), int(tokens), started + t))
            newest = t
    values = {
        "train/tokens": s["tokens"],
        "train/goodput": (s["goodput"] or {}).get("goodput"),
        "rounds/total": s["rounds"]["total"],
        "rounds/per_second": s["rounds"]["per_s"],
        "rounds/contributors_mean": s["rounds"]["contributors"]["mean"],
        "bytes/up": s["bytes"]["up"],
        "bytes/down": s["bytes"]["down"],
    }
    for ln in s["learners"]:
        values[f"learner/{ln['id']}/tokens_per_second"] = ln["tokens_per_s"]
        values[f"learner/{ln['id']}/steps_per_second"] = ln["steps_per_s"]
    points += [Point(tag, float(v), step, wall) for tag, v in values.items() if v is not None]
    return points, newest


class ScalarLog:
    """Appends a run's scalars to a TensorBoard event file in ``log_dir`` (created on first
    write)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        self._loss_t = float("-inf")  # time of the newest held-out loss written

    def write(self, snapshot: dict) -> None:
        """Add the snapshot's scalars (and the held-out losses not written yet)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), flush_secs=10)
        points, self._loss_t = scalar_points(snapshot, self._loss_t)
        for p in points:
            self._writer.add_scalar(p.tag, p.value, global_step=p.step, walltime=p.wall)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

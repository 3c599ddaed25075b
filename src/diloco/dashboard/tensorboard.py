"""TensorBoard scalars of a run (``runs/<name>/tensorboard/``), written from its snapshots.

Each :meth:`ScalarLog.write` adds one point per scalar, with the run's total tokens as the
step and the snapshot's time as the wall time (TensorBoard's "relative" axis is then time
since the start); held-out losses are written once each, at the tokens and time they were
measured. Tags:

- ``heldout/loss``; ``train/tokens``, ``train/goodput``;
- ``rounds/total``, ``rounds/per_second``, ``rounds/contributors_mean``;
- ``bytes/up``, ``bytes/down``;
- ``learner/<id>/tokens_per_second``, ``learner/<id>/steps_per_second``.

``tensorboard --logdir runs`` shows every run side by side.
"""

from __future__ import annotations

from pathlib import Path


class ScalarLog:
    """Appends a run's scalars to an event file in ``log_dir`` (created on first write)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        self._loss_t = float("-inf")  # time of the newest held-out loss written

    def write(self, snapshot: dict) -> None:
        """Add the snapshot's scalars (and the held-out losses not written yet)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), flush_secs=10)
        w, s = self._writer, snapshot
        started = s["t"] - s["elapsed_s"]
        step, wall = int(s["tokens"]), s["t"]

        def add(tag: str, value) -> None:
            if value is not None:
                w.add_scalar(tag, float(value), global_step=step, walltime=wall)

        for t, loss, tokens in s["loss"]:
            if t > self._loss_t and loss is not None:
                w.add_scalar(
                    "heldout/loss", float(loss), global_step=int(tokens), walltime=started + t
                )
                self._loss_t = t
        add("train/tokens", s["tokens"])
        add("train/goodput", (s["goodput"] or {}).get("goodput"))
        add("rounds/total", s["rounds"]["total"])
        add("rounds/per_second", s["rounds"]["per_s"])
        add("rounds/contributors_mean", s["rounds"]["contributors"]["mean"])
        add("bytes/up", s["bytes"]["up"])
        add("bytes/down", s["bytes"]["down"])
        for ln in s["learners"]:
            add(f"learner/{ln['id']}/tokens_per_second", ln["tokens_per_s"])
            add(f"learner/{ln['id']}/steps_per_second", ln["steps_per_s"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

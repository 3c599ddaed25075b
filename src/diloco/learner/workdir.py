"""A learner's work directory: its checkpoint, progress records and accounting at exit.

What a learner leaves in its work directory, whoever started it (the recipe worker,
``diloco.launch.learner_worker``, or a user's own script launched by ``diloco launch`` through
``Learner.from_env``):

    checkpoint.pt      the last local checkpoint (``load_checkpoint``; format 1: ``model``,
                       ``optimizer``, ``learner`` and, for the recipe worker, ``stream``)
    delivered.json     what was delivered after it (``diloco.learner.delivery``)
    journal.jsonl      every upload's life (``diloco.learner.journal``)
    generation         the last process generation taken (``diloco.learner.generation``)
    progress.jsonl     progress records, one at most every ``PROGRESS_EVERY_S`` and one at exit
    final.json         the accounting at a clean stop (``write_final_state``), beside
    final.safetensors  the anchors held then

:class:`WorkdirReporter` is the part a launched ``Learner`` holds (``Learner.reporter``): at
each step it writes the progress record (with the script's training loss) and the checkpoint
when one is due; at a clean close the last checkpoint and the final accounting.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from diloco.learner.generation import GENERATION_FILE as PROCESS_GENERATIONS
from diloco.learner.journal import JOURNAL_FILE
from diloco.runtime.cadence import AUTO, CheckpointCadence
from diloco.runtime.checkpoint_writer import CheckpointWriter
from diloco.runtime.training import ProgressLog

CHECKPOINT = "checkpoint.pt"
DELIVERY_LOG = "delivered.json"  # diloco.learner.delivery
UPLOAD_JOURNAL = JOURNAL_FILE  # diloco.learner.journal
GENERATION_FILE = PROCESS_GENERATIONS  # diloco.learner.generation
PROGRESS_FILE = "progress.jsonl"
FINAL_ACCOUNTING = "final.json"
"""A learner's accounting at a clean stop (``diloco.report.audit_files`` reads it)."""
CHECKPOINT_FORMAT = 1
PROGRESS_EVERY_S = 1.0
"""Seconds between a launched learner's progress records."""


def load_checkpoint(path: Path) -> dict | None:
    """The checkpoint at ``path`` (``weights_only=True``), or None if there is none or it is
    unreadable (then the learner starts fresh from the global model, and says so)."""
    import torch

    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged checkpoint must not keep a learner down
        print(f"ignoring unreadable checkpoint {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        print(f"ignoring checkpoint {path}: unknown format", file=sys.stderr)
        return None
    return state


def write_final_state(workdir: Path, learner) -> None:
    """Write what this learner holds at exit: its anchor (last global value received) and
    version per fragment, as ``final.safetensors`` + ``final.json`` (with the steps of each
    fragment that never reached the syncer: the unsent tail), for audits and tests."""
    from safetensors.torch import save_file

    anchors = {
        f"anchor.{p}": a.contiguous() for p, a in enumerate(learner.anchors) if a is not None
    }
    save_file(anchors, str(workdir / "final.safetensors"))
    (workdir / FINAL_ACCOUNTING).write_text(
        json.dumps(
            {
                "versions": learner.versions,
                "life": getattr(getattr(learner, "journal", None), "life", None),
                "unsent": learner.unsent(),
                "dropped": list(getattr(learner, "dropped", [])),
                **(
                    {
                        "accounting": learner.accounting().to_dict(),
                        "unanswered": learner.unanswered_uploads(),
                    }
                    if hasattr(learner, "accounting")
                    else {}
                ),
                **learner.stats,
            },
            indent=1,
        )
    )


class WorkdirReporter:
    """A launched learner's files in ``workdir`` (module docstring), and the stop request.

    ``stop`` is set when the process is asked to stop (SIGTERM, SIGINT, or the launcher
    gone): :meth:`stepped` then says so, and the learner flushes and ends the script.
    ``checkpoint_every``: seconds between checkpoints, 0 for none until exit, or ``"auto"``
    (``diloco.runtime.cadence``). It never holds the learner: each call is given it."""

    def __init__(
        self,
        workdir: Path,
        *,
        first_step: int,
        stop: threading.Event,
        checkpoint_every: float | str = AUTO,
        echo: str | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stop = stop
        self.log = ProgressLog(
            self.workdir / PROGRESS_FILE, PROGRESS_EVERY_S, first_step=first_step, echo=echo
        )
        self.cadence = CheckpointCadence(every=checkpoint_every, start=self.log.started)
        self.writer = CheckpointWriter()
        self.last_loss: float | None = None
        """The last training loss the script reported (None: none yet)."""
        self.closed = False

    @property
    def checkpoint(self) -> Path:
        return self.workdir / CHECKPOINT

    def state(self, learner) -> dict:
        """The checkpoint: model, inner optimizer (if the learner has one), learner state
        (references to the live tensors: the writer copies them)."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "model": learner.model.state_dict(),
            "learner": learner.state_dict(),
        }
        if learner.optimizer is not None:
            state["optimizer"] = learner.optimizer.state_dict()
        return state

    def stepped(self, learner, loss: float | None) -> bool:
        """After a step: its progress record (``loss``: the script's training loss, a float
        or a 0-d tensor), a checkpoint if one is due; returns whether a stop was asked for."""
        if loss is not None:
            self.last_loss = float(loss.detach() if hasattr(loss, "detach") else loss)
        stats = learner.stats
        self.log.step(
            learner.local_step,
            tokens=learner.total_tokens,
            loss=self.last_loss,
            bytes_up=stats.get("bytes_up", 0),
            bytes_down=stats.get("bytes_down", 0),
            deferred=stats.get("deferred", 0),
            down_lag=stats.get("down_lag", 0),
        )
        now = time.time()
        if self.cadence.due(now) and not self.writer.busy:
            saving = time.perf_counter()
            self.writer.submit(self.checkpoint, self.state(learner))
            self.cadence.saved(time.time(), time.perf_counter() - saving)
        return self.stop.is_set()

    def closed_by(self, learner, *, clean: bool) -> None:
        """At the learner's close (once): after a clean one (flushed), the last checkpoint and
        the final accounting; the exit record either way."""
        if self.closed:
            return
        self.closed = True
        if clean:
            self.writer.save_now(self.checkpoint, self.state(learner))
            write_final_state(self.workdir, learner)
        else:
            self.writer.wait()
        steps = learner.local_step - self.log.first_step
        elapsed = time.time() - self.log.started
        self.log.exit(
            **learner.stats,
            loss=self.last_loss,
            steps_per_s=steps / max(elapsed, 1e-9),
        )

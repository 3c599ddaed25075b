"""``Learner.from_env``: a learner built from the environment ``diloco launch`` gives a copy.

``diloco launch --learners N train.py ARGS`` starts N copies of the script, each with:

    DILOCO_SYNCER            the syncer's address (every shard's, comma-separated)
    DILOCO_LEARNER_ID        this copy's learner id (the same across its restarts)
    DILOCO_LEARNER_INDEX     its index, 0 .. N-1 (e.g. to pick its share of the data)
    DILOCO_LEARNERS          N
    DILOCO_WORKDIR           its own work directory: checkpoint, journal, progress records
    DILOCO_TOKEN_FILE        its own token (a file, mode 0600)
    DILOCO_FRAGMENTS         P, the syncer's fragment count
    DILOCO_CHECKPOINT_EVERY  seconds between checkpoints, or ``auto``

so the script needs no flags: ``learner = diloco.Learner.from_env(model, optimizer)``. A
restarted copy finds its checkpoint in its work directory and resumes from it (the model,
the optimizer and the learner's state); its first ``wait_for_global`` then says, in
``learner.ahead_on_restore``, how many steps its previous life had delivered past the
checkpoint (the script skips that much of its data: ``learner.skip``). On SIGTERM or SIGINT
(the launcher stopping it, a preemption) or if the launcher dies, the next ``step`` flushes
the progress not yet sent, leaves the syncer and ends the script with exit status 0
(``SystemExit``: ``finally`` blocks run).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco.learner.workdir import (
    CHECKPOINT,
    DELIVERY_LOG,
    GENERATION_FILE,
    UPLOAD_JOURNAL,
    WorkdirReporter,
    load_checkpoint,
)
from diloco.runtime.cadence import AUTO

SYNCER = "DILOCO_SYNCER"
LEARNER_ID = "DILOCO_LEARNER_ID"
LEARNER_INDEX = "DILOCO_LEARNER_INDEX"
LEARNERS = "DILOCO_LEARNERS"
WORKDIR = "DILOCO_WORKDIR"
TOKEN_FILE = "DILOCO_TOKEN_FILE"
FRAGMENTS = "DILOCO_FRAGMENTS"
CHECKPOINT_EVERY = "DILOCO_CHECKPOINT_EVERY"
REQUIRED = (SYNCER, LEARNER_ID)


class NotLaunched(RuntimeError):
    """The environment does not say how to join (not started by ``diloco launch``): one line
    naming the variable."""


@dataclass(frozen=True)
class LaunchEnv:
    """What ``diloco launch`` told one copy (module docstring)."""

    syncer: str
    learner_id: str
    index: int = 0
    learners: int = 1
    workdir: Path | None = None
    token_file: str | None = None
    num_fragments: int | None = None
    checkpoint_every: float | str = AUTO

    def variables(self) -> dict[str, str]:
        """The environment that says this (what the launcher sets for the copy)."""
        out = {
            SYNCER: self.syncer,
            LEARNER_ID: self.learner_id,
            LEARNER_INDEX: str(self.index),
            LEARNERS: str(self.learners),
            CHECKPOINT_EVERY: str(self.checkpoint_every),
        }
        if self.workdir is not None:
            out[WORKDIR] = str(self.workdir)
        if self.token_file is not None:
            out[TOKEN_FILE] = self.token_file
        if self.num_fragments is not None:
            out[FRAGMENTS] = str(self.num_fragments)
        return out


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The copy's settings from ``env`` (default ``os.environ``); ``NotLaunched`` names the
    variable missing or malformed. Pure but for reading ``env``."""
    from diloco.runtime.cadence import parse_every

    env = os.environ if env is None else env
    for name in REQUIRED:
        if not env.get(name):
            raise NotLaunched(
                f"Learner.from_env: ${name} is not set: start this script with "
                f"`diloco launch --learners N {{script}}` (or set {', '.join(REQUIRED)})"
            )

    def number(name: str, default: int | None) -> int | None:
        text = env.get(name)
        if not text:
            return default
        try:
            return int(text)
        except ValueError:
            raise NotLaunched(f"Learner.from_env: ${name} is not a number: {text!r}") from None

    try:
        every = parse_every(env.get(CHECKPOINT_EVERY) or AUTO)
    except Exception:  # argparse's type error: say it as ours
        raise NotLaunched(
            f"Learner.from_env: ${CHECKPOINT_EVERY} wants seconds or auto, "
            f"got {env.get(CHECKPOINT_EVERY)!r}"
        ) from None
    return LaunchEnv(
        syncer=env[SYNCER],
        learner_id=env[LEARNER_ID],
        index=number(LEARNER_INDEX, 0),
        learners=number(LEARNERS, 1),
        workdir=Path(env[WORKDIR]) if env.get(WORKDIR) else None,
        token_file=env.get(TOKEN_FILE) or None,
        num_fragments=number(FRAGMENTS, None),
        checkpoint_every=every,
    )


def learner_from_env(cls, model, optimizer=None, env: Mapping[str, str] | None = None, **overrides):
    """``cls(model, optimizer, ...)`` (a ``Learner``) joined as the environment says, resumed
    from the checkpoint in its work directory if there is one, holding a
    ``WorkdirReporter`` there; ``overrides`` are ``LearnerConfig`` fields that win over the
    environment's. ``NotLaunched`` when the environment does not say how to join."""
    from diloco.runtime.modules import plain_module
    from diloco.runtime.training import stop_on_signals
    from diloco.wire.auth import load_token

    launch = read_launch_env(env)
    settings = {"learner_id": launch.learner_id}
    if launch.num_fragments is not None:
        settings["num_fragments"] = launch.num_fragments
    if launch.token_file is not None:
        settings["token"] = load_token(launch.token_file)
    saved = None
    if launch.workdir is not None:
        launch.workdir.mkdir(parents=True, exist_ok=True)
        settings["delivery_file"] = str(launch.workdir / DELIVERY_LOG)
        settings["journal_file"] = str(launch.workdir / UPLOAD_JOURNAL)
        settings["generation_file"] = str(launch.workdir / GENERATION_FILE)
        saved = load_checkpoint(launch.workdir / CHECKPOINT)
    if saved is not None:
        plain_module(model).load_state_dict(saved["model"])
        if optimizer is not None and "optimizer" in saved:
            optimizer.load_state_dict(saved["optimizer"])
    learner = cls(
        model,
        optimizer,
        syncer=launch.syncer,
        state=saved["learner"] if saved is not None else None,
        **{**settings, **overrides},
    )
    if saved is not None:
        print(f"learner {launch.learner_id}: resumed at step {learner.local_step}", flush=True)
    if launch.workdir is not None:
        in_main = threading.current_thread() is threading.main_thread()
        learner.reporter = WorkdirReporter(
            launch.workdir,
            first_step=learner.local_step,
            stop=stop_on_signals(exit_with_parent=True) if in_main else threading.Event(),
            checkpoint_every=launch.checkpoint_every,
            echo=f"learner {launch.learner_id}",
        )
    return learner

"""Whole-group checkpoints of the data-parallel baseline.

A checkpoint of step S in ``directory`` is one file per rank, ``step-S.rank-R.pt``: rank 0's
holds the model, the optimizer and its data position; every other rank's holds only its data
position (the model and the optimizer are the same on every rank). Rank 0 writes
``latest.json`` (``{"step": S}``) only after every rank has written its file, so a group killed
in the middle of a save restarts from the previous complete checkpoint. Files are written to a
temporary name, fsynced and renamed (``diloco.runtime.checkpoint_writer``); they are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from diloco.runtime.checkpoint_writer import write_atomic

FORMAT = 1


def rank_file(directory: Path, step: int, rank: int) -> Path:
    return Path(directory) / f"step-{step}.rank-{rank}.pt"


def rank_part(step: int, state: dict) -> dict:
    """A rank's part of the checkpoint of ``step``: its ``state`` with the format and step."""
    return {"format": FORMAT, "step": step, **state}


def write_rank_part(directory: Path, step: int, rank: int, part: dict) -> None:
    """Write this rank's ``rank_part`` of the checkpoint of ``step`` now (atomic)."""
    path = rank_file(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, part)


def write_rank_state(directory: Path, step: int, rank: int, state: dict) -> None:
    """Write this rank's part of the checkpoint of ``step`` from its ``state`` (atomic)."""
    write_rank_part(directory, step, rank, rank_part(step, state))


def commit(directory: Path, step: int, world: int) -> None:
    """Rank 0, after every rank wrote ``step``: point ``latest.json`` at it, drop older steps
    (only older: the other ranks may already be writing a newer one, e.g. the final one)."""
    directory = Path(directory)
    missing = [r for r in range(world) if not rank_file(directory, step, r).exists()]
    if missing:
        raise RuntimeError(f"checkpoint of step {step} lacks ranks {missing}")
    tmp = directory / "latest.json.tmp"
    tmp.write_text(json.dumps({"step": step, "world": world}))
    os.replace(tmp, directory / "latest.json")
    for old in directory.glob("step-*.rank-*.pt"):
        older = _step_of(old)
        if older is not None and older < step:
            old.unlink(missing_ok=True)


def latest_step(directory: Path, world: int) -> tuple[int, int] | None:
    """``(step, world it was written by)`` of the last complete checkpoint, or None (start
    from scratch).

    A group may resume a checkpoint of its own size, or of a smaller group (it grew: the
    added ranks take rank 0's model and optimizer and start their own data streams). One of a
    larger group is refused with ValueError: the data positions of the ranks that left would
    be lost.
    """
    path = Path(directory) / "latest.json"
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    written_by = int(meta.get("world", 0))
    if not 1 <= written_by <= world:
        raise ValueError(f"{path}: checkpoint of a {written_by}-rank group, this group has {world}")
    return int(meta["step"]), written_by


def read_rank_state(directory: Path, step: int, rank: int) -> dict:
    """Rank ``rank``'s part of the checkpoint of ``step`` (raises if missing or foreign)."""
    path = rank_file(directory, step, rank)
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("step") != step:
        raise ValueError(f"{path}: not a data-parallel checkpoint of step {step}")
    return state


def _step_of(path: Path) -> int | None:
    head = path.name.split(".", 1)[0]  # "step-S"
    try:
        return int(head.removeprefix("step-"))
    except ValueError:
        return None

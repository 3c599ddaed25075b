"""A finished run directory read back for its report: summary, configuration, loss curve,
event tape and progress records, and where each learner's provisioned time went. A
standalone syncer's state directory reads as a run whose summary its tape gives
(``diloco.report.state_dir``).

The tape and the progress records are read through the same tallies as the summary
(``diloco.report.tally``), so the report's numbers are the summary's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from diloco.report.goodput import schedule_down
from diloco.report.state_dir import (
    STATE_DIR_SOURCE,
    STATE_TAPE,
    is_state_dir,
    state_dir_config,
    tape_summary,
)
from diloco.report.tally import ProgressTally, TapeTally
from diloco.runtime.jsonl import read_jsonl
from diloco.runtime.metrics import METRICS_FILE
from diloco.wire.protocol import ProtocolConfig

TAPE = "syncer/events.jsonl"
"""The event tape's place in a run directory."""


class NotARun(ValueError):
    """A directory that is neither a finished run nor a bench folder."""


@dataclass
class RunFiles:
    """What a report needs of one run directory (see :func:`load_run`)."""

    path: Path
    summary: dict
    config: dict
    metrics: list[dict]
    tape: TapeTally
    progress: dict[str, ProgressTally]
    steps: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Each learner's (time, step) records (the data-parallel commit timeline)."""

    @property
    def from_state_dir(self) -> bool:
        """Whether this is a syncer's state directory (its summary built from its tape)."""
        return self.summary.get("source") == STATE_DIR_SOURCE

    @property
    def mode(self) -> str:
        return self.summary.get("mode", "decoupled")

    @property
    def started(self) -> float:
        """The run's time origin (epoch seconds): ``metrics.jsonl`` times are relative to it."""
        if self.summary.get("started_at"):
            return float(self.summary["started_at"])
        return self.tape.start or 0.0

    @property
    def train_end(self) -> float:
        return self.started + float(self.summary.get("train_s") or self.summary["wall_s"])


def load_run(path: str | Path, *, finished: bool = True) -> RunFiles:
    """Read a run directory: the one loader of what a run leaves.

    ``finished`` (a report): the run must have a readable ``summary.json``, else ``NotARun``;
    a missing ``config.json`` reads as ``{}``. A syncer's state directory (``meta.json``, no
    ``summary.json``) reads as a finished run: :func:`load_state_dir`. ``finished=False`` (the digital twin, which
    reads a run's configuration and tape): ``config.json`` and the event tape must be there,
    else ``NotARun``; a missing ``summary.json`` reads as ``{}``.
    """
    path = Path(path)
    summary = _read_json(path / "summary.json")
    config = _read_json(path / "config.json")
    tape_path = path / TAPE
    if finished and summary is None:
        if is_state_dir(path):
            return load_state_dir(path)
        raise NotARun(
            f"{path} is not a finished run (no readable summary.json), nor a syncer's state "
            "directory (no meta.json)"
        )
    if not finished and (config is None or not tape_path.is_file()):
        raise NotARun(f"{path}: not a diloco run directory (need config.json and {TAPE})")
    summary, config = summary or {}, config or {}
    protocol = (config.get("syncer") or {}).get("protocol") or {}
    fragments = int(protocol.get("num_fragments") or ProtocolConfig.num_fragments)
    tape = TapeTally(fragments)
    for record in read_jsonl(tape_path):
        tape.add(record)
    progress, steps = {}, {}
    for learner in summary.get("per_learner", {}):
        tally = ProgressTally()
        records = read_jsonl(path / "learners" / learner / "progress.jsonl")
        for record in records:
            tally.add(record)
        progress[learner] = tally
        steps[learner] = [(r["t"], r["step"]) for r in records if "event" not in r and "step" in r]
    return RunFiles(
        path=path,
        summary=summary,
        config=config,
        metrics=[m for m in read_jsonl(path / METRICS_FILE) if m.get("val_loss") is not None],
        tape=tape,
        progress=progress,
        steps=steps,
    )


def load_state_dir(path: Path) -> RunFiles:
    """A syncer's state directory as a run: its summary built from its event tape (every
    complete record; a line a kill cut short is skipped), no loss curve, no progress records
    (``diloco.report.state_dir``)."""
    config = state_dir_config(path)
    protocol = (config.get("syncer") or {}).get("protocol") or {}
    tape = TapeTally(int(protocol.get("num_fragments") or ProtocolConfig.num_fragments))
    records = read_jsonl(path / STATE_TAPE)
    for record in records:
        tape.add(record)
    return RunFiles(
        path=path,
        summary=tape_summary(path, tape, records),
        config=config,
        metrics=[],
        tape=tape,
        progress={},
    )


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None if it is missing, unreadable or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def time_split(run: RunFiles) -> dict[str, dict[str, float]]:
    """Where each learner's provisioned time went, in seconds: ``useful`` (compute whose work
    entered the global model), ``down`` (the failure schedule's own down time) and ``other``
    (restarts, work lost in a crash or refused, waiting); definitions in
    ``diloco.report.goodput``. For data-parallel ranks, useful work is the surviving steps."""
    end = run.train_end
    out = {}
    for learner, tally in run.progress.items():
        rate = tally.busy_rate or tally.speed
        if run.mode == "dp":
            start = tally.first_start if tally.first_start is not None else end
            useful_tokens = float(tally.latest.get("tokens", 0))
        else:
            start = run.tape.joins.get(learner, end)
            useful_tokens = run.tape.useful.get(learner, 0.0)
        provisioned = max(0.0, end - start)
        down = schedule_down(run.tape.chaos, {learner}, end).get(learner, 0.0)
        useful = min(provisioned - down, useful_tokens / rate) if rate else 0.0
        out[learner] = {
            "useful": max(0.0, useful),
            "down": down,
            "other": max(0.0, provisioned - down - max(0.0, useful)),
        }
    return out

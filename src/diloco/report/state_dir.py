"""A syncer's state directory read as a run, for ``diloco report STATE_DIR``.

A standalone ``diloco syncer --state-dir S`` (the learners being the user's own scripts)
leaves ``S/meta.json`` (the layout and the syncer's configuration) and its event tape
``S/events.jsonl``, and no ``summary.json``: the summary is built from the tape each time the
report is made, so a syncer that was killed (no ``stop`` record, a last line cut short) is
reported as well as one that stopped. What only the learners or an evaluator know is not
there (:data:`STATE_DIR_LIMITS`); the report says so.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from diloco.report.goodput import commit_gaps, uptime
from diloco.report.summary import contributors_summary
from diloco.report.tally import TapeTally

STATE_META = "meta.json"
"""What makes a directory a syncer's state directory (``diloco.syncer.store``)."""

STATE_TAPE = "events.jsonl"
"""The event tape's place in a state directory."""

STATE_DIR_SOURCE = "syncer state directory"
"""``summary["source"]`` of a summary built from a state directory's tape."""

NO_STOP_RECORD = "no stop record: the syncer was killed, or it still runs"
"""``stopped_by`` of a tape that does not end with the syncer's ``stop`` record."""

LEARNER_EVENTS = ("join", "round", "leave")
"""Tape records that mark the learners' time (uptime is measured up to the last of them)."""

STATE_DIR_LIMITS = (
    "no held-out loss: a syncer evaluates nothing (diloco launch --eval or diloco run measure it)",
    "no learner's own progress (its steps, speed, training loss and the bytes it sent and "
    "received): the learners keep those, not the syncer; the steps and tokens below are "
    "those the global model merged, averaged over the fragments",
    "no goodput and no provisioned time: both need the learners' speed",
)
"""What a report of a state directory cannot show, said on the report."""


def is_state_dir(path: Path) -> bool:
    """Whether ``path`` is a syncer's state directory (it holds ``meta.json``)."""
    return (path / STATE_META).is_file()


def state_dir_config(path: Path) -> dict:
    """The run configuration a report reads, from ``meta.json``: ``{"syncer": the syncer's
    configuration, "shard": [i, S]}`` (``{}`` if ``meta.json`` is unreadable)."""
    try:
        meta = json.loads((path / STATE_META).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(meta, dict):
        return {}
    return {"syncer": meta.get("config") or {}, "shard": meta.get("shard") or [0, 1]}


def tape_summary(path: Path, tape: TapeTally, records: list[dict]) -> dict:
    """A ``summary.json``-shaped dict of a state directory from its tape (``tape``: the
    records already added; ``records``: the same records, for what the tally does not keep).

    Keys as a run's summary where the tape knows them (``rounds``, ``contributors_per_round``,
    ``uptime``, ``max_commit_gap_s``, ``failures_injected``, ``bytes.up``: the delta bytes
    merged); ``val_loss`` is unknown (None); ``per_learner`` holds for every learner that
    joined its ``contributions``, the ``steps`` and ``tokens`` merged (sums over its
    contributions divided by the fragments), ``staleness_mean``/``staleness_max`` of its
    merged contributions, ``rejoins``, ``left`` (the reason of its last leave, None if it
    never left); ``limits``: :data:`STATE_DIR_LIMITS`. ``uptime`` runs from the first join
    to the learners' last record (:data:`LEARNER_EVENTS`), ``wall_s`` over the whole tape.
    """
    steps: dict[str, float] = defaultdict(float)
    staleness: dict[str, list[int]] = defaultdict(list)
    left: dict[str, str | None] = {}
    rejoins: Counter[str] = Counter()
    starts = 0
    for r in records:
        event = r.get("event")
        if event == "round":
            for i, learner in enumerate(r.get("participants", ())):
                steps[learner] += _at(r.get("steps"), i) / tape.fragments
                staleness[learner].append(int(_at(r.get("staleness"), i)))
        elif event == "join" and not r.get("observer"):
            left[r["learner"]] = None
            rejoins[r["learner"]] += bool(r.get("rejoin"))
        elif event == "leave" and r.get("learner") in left:
            left[r["learner"]] = r.get("reason", "left")
        elif event == "start":
            starts += 1
    times = [float(r["t"]) for r in records if isinstance(r.get("t"), (int, float))]
    start, end = (min(times), max(times)) if times else (0.0, 0.0)
    stopped = bool(records) and records[-1].get("event") == "stop"
    gaps = commit_gaps(list(tape.commit_times))
    first_join = min(tape.joins.values(), default=end)
    trained_until = max(  # the learners' last sign on the tape (a syncer lingers after it)
        (float(r["t"]) for r in records if r.get("event") in LEARNER_EVENTS and "t" in r),
        default=end,
    )
    per_learner = {
        learner: {
            "steps": round(steps[learner]),
            "tokens": round(tape.useful.get(learner, 0.0)),
            "contributions": tape.contributions[learner],
            "staleness_mean": round(statistics.fmean(staleness[learner]), 3)
            if staleness[learner]
            else None,
            "staleness_max": max(staleness[learner], default=None),
            "rejoins": rejoins[learner],
            "restarts": rejoins[learner],
            "left": left[learner],
            "exit_code": None,
        }
        for learner in tape.joins
    }
    return {
        "mode": "decoupled",
        "source": STATE_DIR_SOURCE,
        "run_dir": str(path),
        "stopped_by": "the syncer's stop record" if stopped else NO_STOP_RECORD,
        "learners": len(tape.joins),
        "started_at": start,
        "wall_s": round(end - start, 2),
        "tokens": round(sum(tape.useful.values())),
        "val_loss": {"initial": None, "final": None},
        "rounds": tape.rounds,
        "contributors_per_round": contributors_summary(tape.contributors),
        "uptime": uptime(list(tape.commit_times), first_join, trained_until)
        if tape.joins
        else None,
        "max_commit_gap_s": max(gaps) if gaps else None,
        "failures_injected": [
            {k: r[k] for k in ("t", "kind", "target", "down_s") if k in r} for r in tape.chaos
        ],
        "syncer_restarts": max(0, starts - 1),
        "bytes": {"up": tape.bytes_up, "down": None, "per_token": None},
        "per_learner": per_learner,
        "limits": list(STATE_DIR_LIMITS),
    }


def _at(values, i: int) -> float:
    """``values[i]`` as a number (0 where a record lacks it)."""
    try:
        return float(values[i])
    except (TypeError, IndexError, ValueError):
        return 0.0

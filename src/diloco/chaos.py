"""Chaos: a failure taxonomy, a spec syntax and a seeded schedule of failures.

Pure functions only; the supervisor of ``diloco run`` carries the events out with real signals.

Spec syntax (``diloco run --chaos SPEC``): clauses separated by ``;``, each ``KIND:key=value,...``.
Durations take ``ms``, ``s``, ``m`` or no suffix (seconds); ranges are ``LOW-HIGH``.

=====================================  ==================================================
``kill:mtbf=60s,down=5-15s``           every learner is SIGKILLed with exponential
                                       inter-arrival times (mean ``mtbf``) and restarted
                                       after a down time drawn uniformly from ``down``
``hang:mtbf=90s,down=3-8s``            SIGSTOP a learner, SIGCONT it after the down time
``partition:mtbf=90s,down=5-10s``      cut a learner's network (a TCP relay drops its
                                       connections and refuses new ones); it keeps training
``drop:mtbf=30s``                      cut a learner's open connections once: messages in
                                       flight are lost, it may reconnect at once
``delay:mtbf=60s,down=5-10s,latency=300ms``
                                       add one-way latency to a learner's network for the
                                       down time (default latency 200 ms)
``syncer-kill:at=120s,down=2s``        SIGKILL the syncer at ``at``, restart it after ``down``
``syncer-hang:at=60s,down=3s``         SIGSTOP the syncer at ``at``, SIGCONT it after ``down``
``disk-full:at=60s,down=10s``          fill the syncer's disk (a small tmpfs under its
                                       fragment files; root only) at ``at``, free it after
                                       ``down``: its commits fail, it fails and is restarted
                                       until the disk has room again
``lose-replies:mtbf=60s,down=10s,p=0.5``
                                       for the down time, lose the syncer's reply to each of a
                                       learner's uploads with probability ``p`` (default 0.5;
                                       the syncer handled it, the learner never hears; its
                                       relay cuts the connection)
``kill:at=20s,down=3s,learners=1``     one failure at a fixed time (any learner kind)
``corrupt:learners=1,how=huge``        silent data corruption: from ``start`` (for ``down``
                                       seconds, default the whole run) the learner damages
                                       every delta it uploads: ``huge`` (x1000), ``flip``
                                       (sign), ``nan``, or ``hostile`` (sign flipped and
                                       100x the tokens claimed; ``diloco.learner.corrupt``)
=====================================  ==================================================

Any clause may add ``learners=0+2`` to restrict it to those learner indices, and
``start=10s`` to leave the first seconds alone (default 5 s). Times count from the moment
every learner is training (the supervisor's chaos clock), not from the launch. Slow learners are
set with ``--slow I=F``, which is not a failure but a permanent property.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from diloco.runtime.units import parse_duration

KINDS = (
    "kill",
    "hang",
    "partition",
    "drop",
    "delay",
    "lose-replies",
    "syncer-kill",
    "syncer-hang",
    "disk-full",
    "corrupt",
)
SYNCER_KINDS = ("syncer-kill", "syncer-hang", "disk-full")
#: Kinds carried out on a learner's network through its relay (see diloco.launch.relay).
NETWORK_KINDS = ("partition", "drop", "delay", "lose-replies")
#: ``lose-replies``: the probability of losing each reply when ``p=`` is not given.
DEFAULT_REPLY_LOSS = 0.5
CORRUPT_HOWS = ("huge", "flip", "nan", "hostile")


class ChaosSpecError(ValueError):
    """The chaos spec does not parse; the message says where and why."""


@dataclass(frozen=True)
class Clause:
    kind: str
    mtbf_s: float = 0.0
    down_s: tuple[float, float] = (5.0, 15.0)
    at_s: float = 0.0
    learners: tuple[int, ...] | None = None
    start_s: float = 5.0
    latency_s: float = 0.2
    how: str = ""
    """``corrupt`` only: how deltas are damaged (one of ``CORRUPT_HOWS``)."""
    probability: float = DEFAULT_REPLY_LOSS
    """``lose-replies`` only: the probability of losing each reply (``p=``)."""


@dataclass(frozen=True, order=True)
class ChaosEvent:
    """At ``t`` seconds into the run, do ``kind`` to ``target`` for ``down_s`` seconds
    (``latency_s``: the added one-way latency of a ``delay``; ``probability``: the chance
    of losing each reply of a ``lose-replies``)."""

    t: float
    kind: str
    target: str
    down_s: float
    latency_s: float = 0.0
    probability: float = 0.0


def parse_range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition("-")
    lo = parse_duration(low)
    hi = parse_duration(high) if sep else lo
    if hi < lo:
        raise ValueError(f"range {text!r} is reversed")
    return lo, hi


def parse_spec(spec: str) -> list[Clause]:
    """Parse a chaos spec; raises :class:`ChaosSpecError` naming the bad clause."""
    clauses = []
    for raw in filter(None, (c.strip() for c in spec.split(";"))):
        kind, _, rest = raw.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ChaosSpecError(
                f"{raw!r}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}"
            )
        fields: dict = {"kind": kind}
        try:
            for item in filter(None, (x.strip() for x in rest.split(","))):
                key, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"{item!r} is not key=value")
                if key == "mtbf":
                    fields["mtbf_s"] = parse_duration(value)
                elif key == "down":
                    fields["down_s"] = parse_range(value)
                elif key == "at":
                    fields["at_s"] = parse_duration(value)
                elif key == "start":
                    fields["start_s"] = parse_duration(value)
                elif key == "latency":
                    fields["latency_s"] = parse_duration(value)
                elif key == "learners":
                    fields["learners"] = tuple(int(i) for i in value.split("+"))
                elif key == "how" and kind == "corrupt":
                    fields["how"] = value.strip()
                elif key == "p" and kind == "lose-replies":
                    fields["probability"] = float(value)
                    if not 0.0 < fields["probability"] <= 1.0:
                        raise ValueError(f"p={value} is not a probability in (0, 1]")
                else:
                    raise ValueError(f"unknown key {key!r}")
        except ValueError as exc:
            raise ChaosSpecError(f"{raw!r}: {exc}") from None
        if kind == "corrupt":
            if fields.get("how") not in CORRUPT_HOWS:
                raise ChaosSpecError(f"{raw!r}: corrupt needs how={'|'.join(CORRUPT_HOWS)}")
            fields.setdefault("down_s", (float("inf"), float("inf")))  # default: whole run
        clause = Clause(**fields)
        if kind not in (*SYNCER_KINDS, "corrupt") and clause.mtbf_s <= 0 and clause.at_s <= 0:
            raise ChaosSpecError(f"{raw!r}: {kind} needs mtbf=DURATION or at=DURATION")
        if kind in SYNCER_KINDS and clause.at_s <= 0:
            raise ChaosSpecError(f"{raw!r}: {kind} needs at=DURATION > 0")
        clauses.append(clause)
    return clauses


def schedule(clauses: list[Clause], learners: int, horizon_s: float, seed: int) -> list[ChaosEvent]:
    """Every failure of the run up to ``horizon_s``, sorted by time; a pure function of its inputs.

    Per learner and clause, failures arrive with exponential inter-arrival times of mean
    ``mtbf``; the clock for the next one starts when the learner is back up.
    """
    rng = random.Random(seed)
    events: list[ChaosEvent] = []
    for clause in clauses:
        if clause.kind == "corrupt":  # not an event: a window, see ``corruptions``
            continue
        if clause.kind in SYNCER_KINDS:
            if clause.at_s <= horizon_s:
                events.append(
                    ChaosEvent(clause.at_s, clause.kind, "syncer", rng.uniform(*clause.down_s))
                )
            continue
        targets = clause.learners if clause.learners is not None else range(learners)
        for index in targets:
            if not 0 <= index < learners:
                raise ChaosSpecError(f"learner {index} does not exist (M = {learners})")
            target = f"learner-{index}"
            if clause.at_s > 0:  # one failure at a fixed time
                if clause.at_s <= horizon_s:
                    events.append(_event(clause, clause.at_s, target, rng))
                continue
            t = clause.start_s
            while True:
                t += rng.expovariate(1.0 / clause.mtbf_s)
                if t > horizon_s:
                    break
                event = _event(clause, round(t, 3), target, rng)
                events.append(event)
                t += event.down_s
    return sorted(events)


def _event(clause: Clause, t: float, target: str, rng: random.Random) -> ChaosEvent:
    """One failure of ``clause`` at ``t``; a ``drop`` is instantaneous (no down time)."""
    if clause.kind == "drop":
        return ChaosEvent(t, "drop", target, 0.0)
    latency = clause.latency_s if clause.kind == "delay" else 0.0
    loss = clause.probability if clause.kind == "lose-replies" else 0.0
    return ChaosEvent(t, clause.kind, target, rng.uniform(*clause.down_s), latency, loss)


@dataclass(frozen=True)
class CorruptWindow:
    """Learner ``index`` corrupts its uploads as ``how`` from ``start_s`` to ``end_s`` (run time)."""

    index: int
    how: str
    start_s: float
    end_s: float


def corruptions(clauses: list[Clause], learners: int) -> list[CorruptWindow]:
    """The ``corrupt`` clauses as one window per targeted learner (a pure function)."""
    out = []
    for clause in clauses:
        if clause.kind != "corrupt":
            continue
        for index in clause.learners if clause.learners is not None else range(learners):
            if not 0 <= index < learners:
                raise ChaosSpecError(f"learner {index} does not exist (M = {learners})")
            end = clause.start_s + clause.down_s[0]
            out.append(CorruptWindow(index, clause.how, clause.start_s, end))
    return out

"""The torture run's schedule: what faults hit which process when, a pure function of a seed.

``diloco.launch.torture`` carries the schedule out against real processes and audits the
run; the fault kinds are described there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_KINDS = (
    "syncer-kill",
    "disk-full",
    "learner-kill",
    "learner-resume",
    "partition",
    "long-partition",
    "second-syncer",
    "clock-step",
    "rollback",
    "zombie",
)


COMMIT_LOGS_KEPT = 72
"""The syncer's ``--commit-logs-kept`` in a torture run: 3 commits of each of the 24
fragments. While faults hit 3 tiny learners the syncer commits 5-10 times a second (a
fragment every 2.5-5 s), so a long partition (12-16 s) outlasts the kept logs and a short
fault (1-4 s, a lost reply's resends) mostly does not; either way nothing is guessed."""
CLOCK_STEP_S = -40.0
"""The ``clock-step`` fault: the syncer's wall clock goes back this far."""


@dataclass(frozen=True)
class TortureSpec:
    seed: int = 0
    learners: int = 3
    seconds: float = 40.0
    """Training time; faults fall in [5 s, seconds − 12 s], the rest is quiet."""
    syncer_kills: int = 2
    disk_fulls: int = 1
    learner_kills: int = 2
    partitions: int = 2
    learner_resumes: int = 1
    long_partitions: int = 1
    long_partition_s: tuple[float, float] = (12.0, 16.0)
    """How long a long partition lasts (a syncer kill falls inside it)."""
    second_syncers: int = 1
    clock_steps: int = 1
    rollbacks: int = 1
    zombies: int = 1
    reply_loss: float = 0.1
    """Probability that the reply to an upload is lost."""
    disk_full_s: tuple[float, float] = (2.0, 6.0)
    """How long the disk stays full (drawn uniformly): shorter than the syncer's retries
    (about 3 s) it is ridden out, longer it fails the syncer."""
    comms: str = "default"
    """The syncer's ``--comms`` setting (its H and codecs)."""
    up_codec: str | None = None
    """The syncer's ``--up-codec`` (None: the setting's; the relays tell an upload by its
    gRPC method, so the default's one-bit uploads have their replies lost too)."""
    down_codec: str | None = None
    """The syncer's ``--down-codec`` (None: the setting's)."""


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the learners started."""
    kind: str
    target: int = -1
    """The learner (-1: the syncer)."""
    down_s: float = 0.0


def fault_schedule(spec: TortureSpec) -> list[Fault]:
    """The faults of ``spec``, in time order: a pure function of it (same spec, same
    schedule). Learner faults of one learner do not overlap, and at most M − 1 learners are
    down at once."""
    rng = random.Random(spec.seed)
    first, last = 5.0, max(6.0, spec.seconds - 12.0)
    faults = [
        Fault(rng.uniform(first, last), "syncer-kill", -1, rng.uniform(0.5, 3.0))
        for _ in range(spec.syncer_kills)
    ]
    faults += [
        Fault(rng.uniform(first, last), "disk-full", -1, rng.uniform(*spec.disk_full_s))
        for _ in range(spec.disk_fulls)
    ]
    faults += [
        Fault(rng.uniform(first, last), kind)
        for kind, count in (
            ("second-syncer", spec.second_syncers),
            ("clock-step", spec.clock_steps),
        )
        for _ in range(count)
    ]
    for _ in range(spec.rollbacks):  # a backup, restored a few seconds later
        at = rng.uniform(first + 4.0, last)
        faults += [Fault(at - rng.uniform(2.0, 4.0), "backup"), Fault(at, "rollback", -1, 1.0)]
    busy: dict[int, list[tuple[float, float]]] = {i: [] for i in range(spec.learners)}
    learner_faults = (
        ("long-partition", spec.long_partitions),
        ("zombie", spec.zombies),
        ("learner-kill", spec.learner_kills),
        ("learner-resume", spec.learner_resumes),
        ("partition", spec.partitions),
    )
    for kind, count in learner_faults:
        for _ in range(count):
            for _attempt in range(50):
                if kind == "long-partition":
                    down = rng.uniform(*spec.long_partition_s)
                    at = rng.uniform(first, max(first, spec.seconds - 2.0 - down))
                else:
                    at, down = rng.uniform(first, last), rng.uniform(1.0, 4.0)
                target = rng.randrange(spec.learners)
                span = (at, at + down + 1.0)
                if any(a < span[1] and span[0] < b for a, b in busy[target]):
                    continue
                others = sum(
                    any(a < span[1] and span[0] < b for a, b in spans)
                    for i, spans in busy.items()
                    if i != target
                )
                if others >= spec.learners - 1:
                    continue
                busy[target].append(span)
                faults.append(Fault(at, kind, target, down))
                if kind == "long-partition":  # the syncer restarts while it is cut off
                    kill_at = at + rng.uniform(2.0, max(2.5, down - 6.0))
                    faults.append(Fault(kill_at, "syncer-kill", -1, rng.uniform(0.5, 2.0)))
                break
    return sorted(faults, key=lambda f: f.at)

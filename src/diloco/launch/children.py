"""What each child process of ``diloco run`` is asked to do: derived from the ``RunConfig``.

The launcher writes each child's configuration as a file (``runs/<name>/config/syncer.json``,
``runs/<name>/config/<learner id>.json``) and starts it with ``--config FILE``: nothing is
rebuilt as command-line text, and a child reads the same dataclasses the launcher wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from diloco.config import to_dict
from diloco.config.common import ClientSecurityConfig, ServerSecurityConfig
from diloco.config.run import RunConfig
from diloco.config.service import ServiceConfig
from diloco.config.worker import LearnerProtocolConfig, WorkerConfig


@dataclass
class LearnerPlan:
    """What one learner process is asked to do."""

    id: str
    index: int
    batch_size: int
    slow: float
    start_at: float = 0.0
    """Seconds into the run at which it starts (``--add-learners``; 0: at the start)."""


def parse_assignments(values: list[str], flag: str, learners: int, cast) -> dict[int, float]:
    """``["1=3", "0=2.5"]`` -> ``{1: 3, 0: 2.5}``; raises ValueError with the flag's name."""
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        try:
            index, parsed = int(key), cast(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: expected INDEX=VALUE, e.g. {flag} 1=3") from None
        if not sep or not 0 <= index < learners:
            raise ValueError(f"{flag} {item!r}: learner index must be in [0, {learners})")
        out[index] = parsed
    return out


def parse_additions(values: list[str]) -> list[tuple[float, int]]:
    """``["90s:2", "3m:1"]`` -> ``[(90.0, 2), (180.0, 1)]`` (seconds, learners), sorted by
    time; ``ValueError`` naming ``--add-learners`` for anything else."""
    from diloco.runtime.units import parse_duration

    out = []
    for item in values:
        at, sep, count = item.rpartition(":")
        try:
            seconds, n = parse_duration(at), int(count)
        except ValueError:
            raise ValueError(
                f"--add-learners {item!r}: expected AT:N, e.g. --add-learners 90s:2"
            ) from None
        if not sep or n < 1 or seconds <= 0:
            raise ValueError(f"--add-learners {item!r}: AT must be > 0 and N >= 1")
        out.append((seconds, n))
    return sorted(out)


def plan_learners(config: RunConfig, default_batch: int) -> list[LearnerPlan]:
    """One plan per learner: its id, data stream, batch size, slowdown and start time, the
    M first then those ``--add-learners`` adds (``ValueError`` on a bad ``--batch``,
    ``--slow``, ``--jitter`` or ``--add-learners``)."""
    starts = [0.0] * config.learners
    for at, n in parse_additions(config.add_learners):
        starts += [at] * n
    batches = parse_assignments(config.batch, "--batch", len(starts), int)
    slows = parse_assignments(config.slow, "--slow", len(starts), float)
    if not 0.0 <= config.jitter < 1.0:
        raise ValueError(f"--jitter must be in [0, 1), got {config.jitter}")
    plans = []
    for i, start_at in enumerate(starts):
        b = batches.get(i, config.batch_size or default_batch)
        f = slows.get(i, 1.0)
        if b < 1:
            raise ValueError(f"learner {i}: batch size must be >= 1, got {b}")
        if f < 1.0:
            raise ValueError(f"learner {i}: --slow factor must be >= 1, got {f}")
        plans.append(LearnerPlan(f"learner-{i}", i, b, f, start_at))
    return plans


def sync_lag(config: RunConfig) -> int:
    """``--mode sync``: a learner does not start the step that would send a fragment again
    while that fragment's previous round is still open (``H − 1`` steps after the send; -1
    otherwise: never wait). So every learner contributes once to every round, and a fast
    learner runs at most one cycle of H steps ahead of the slowest one.

    Why this lag and no smaller one: with P ≥ H (the default: 24 fragments over 16 steps, one
    or two at each step) a learner sends every other fragment in the H − 1 steps before it
    waits, so whatever round it waits for, its peers owe a fragment that
    they send before they wait themselves, and no two learners can wait for each other. A
    restarted learner resumes at another phase of the schedule; with a lag of 1 it and its
    peers each waited for a fragment the other sends later (a deadlock, seen in a test).
    """
    return config.syncer.protocol.sync_every - 1 if config.mode == "sync" else -1


def service_config(config: RunConfig) -> ServiceConfig:
    """The syncer's configuration (every shard's: each gets its own ``--shard``, state
    directory and port file on its command line). ``--mode sync`` makes every round wait
    for all M learners on the learners' schedule, without a grace window."""
    syncer = config.syncer
    if config.mode == "sync":
        syncer = replace(syncer, schedule="learner", wait_for_all=config.learners, gamma=0.0)
    return ServiceConfig(
        recipe=config.recipe,
        syncer=syncer,
        security=ServerSecurityConfig(
            token_file=config.token_file, learner_tokens=config.token_file is not None
        ),
    )


def corrupt_settings(window, started: float, tape) -> dict:
    """``WorkerConfig`` fields for a ``corrupt`` chaos window (and its ``chaos`` record on the
    tape); ``{}`` without one."""
    if window is None:
        return {}
    end = started + window.end_s
    tape.append(
        {
            "event": "chaos",
            "t": started + window.start_s,
            "kind": "corrupt",
            "target": f"learner-{window.index}",
            "how": window.how,
            "down_s": None if window.end_s == float("inf") else window.end_s - window.start_s,
        }
    )
    return {
        "corrupt": window.how,
        "corrupt_start": started + window.start_s,
        "corrupt_end": 0.0 if end == float("inf") else end,
    }


def worker_config(
    config: RunConfig,
    plan: LearnerPlan,
    *,
    syncer: str,
    started: float,
    workdir: Path,
    corrupt: dict,
    token_file: str | None = None,
) -> WorkerConfig:
    """One learner's configuration. The lr schedule fits the time budget; a learner the
    launcher may not be able to signal (Ray backend) also gets the budget as a deadline.
    ``token_file``: the learner's own token (default: the run's shared one)."""
    budget_s = config.minutes * 60 if config.minutes else 0.0
    signal_free = config.ray.backend == "ray" and config.minutes
    return WorkerConfig(
        recipe=config.recipe,
        # the run's syncer owns the exchange (H, codecs): no budget check against them
        protocol=LearnerProtocolConfig(num_fragments=config.syncer.protocol.num_fragments),
        security=ClientSecurityConfig(token_file=token_file or config.token_file),
        device=config.device,
        syncer=syncer,
        id=plan.id,
        index=plan.index,
        batch_size=plan.batch_size,
        slow=plan.slow,
        jitter=config.jitter,
        total_steps=config.steps,
        schedule_seconds=budget_s,
        run_started_epoch_s=started,
        deadline_epoch_s=started + budget_s if signal_free else 0.0,
        checkpoint_every_s=config.checkpoint_every_s,
        workdir=str(workdir),
        join_timeout_s=config.start_timeout_s,
        wait_for_merge=sync_lag(config),
        overwrite_own=config.overwrite_own,
        max_stretch=config.max_stretch,
        flush_timeout_s=config.flush_timeout_s,
        drain_timeout_s=config.drain_timeout_s,
        exit_with_parent=True,
        **corrupt,
    )


def write_config(path: Path, config) -> Path:
    """Write a configuration dataclass as JSON (atomically); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(to_dict(config), indent=1))
    tmp.replace(path)
    return path

"""A warm spare: a process that has already imported torch, waiting to become a restarted child.

A fresh learner spends most of its start in imports: ``torch``, then ``torch._dynamo``, which
``torch.optim`` pulls in when the first optimizer is built (the measured start-up is in
``docs/resilience.md``, "Warm spares"). The supervisor can keep spares
(``diloco run --spares``): each runs ``python -m diloco.cli.spare``, imports all that and
blocks on its stdin. A restart hands a
spare the child's command line and log; the spare points its stdout and stderr at that log and
runs the command in the same interpreter. The restart then costs what the learner does
itself (checkpoint, data, join), not the interpreter's start. A spare warms up at a lower CPU
priority (niceness +10) when it may raise it back afterwards, so its imports use idle CPU
rather than the training learners'; it runs the command at the priority it started with.

The handover is one JSON line on a pipe only the supervisor holds (never pickle):
``{"argv": [...the diloco sub-command and flags...], "log": "path"}``. End of file on stdin
(the supervisor went away) makes an idle spare exit 0.
"""

from __future__ import annotations

import json
import os
import resource


def parse_assignment(line: str) -> tuple[list[str], str]:
    """``(argv, log path)`` from a handover line; ``ValueError`` if it is not one."""
    try:
        job = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(job, dict) or set(job) != {"argv", "log"}:
        raise ValueError('expected {"argv": [...], "log": "..."}')
    argv, log = job["argv"], job["log"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a non-empty list of strings")
    if not isinstance(log, str) or not log:
        raise ValueError("log must be a path")
    return argv, log


def assignment(argv: list[str], log: str) -> bytes:
    """The handover line for ``argv`` (a diloco sub-command and its flags) and ``log``."""
    return (json.dumps({"argv": argv, "log": log}) + "\n").encode()


#: Niceness of a spare while it warms up: it should use idle CPU, not the learners'.
WARM_UP_NICE = 10


def can_restore_priority(nice_now: int) -> bool:
    """Whether this process may lower its niceness back to ``nice_now`` after raising it
    (root, or an ``RLIMIT_NICE`` that allows it; an unprivileged process usually may not)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice_now


def spare_count(asked: int, chaos, *, restart_together: int, learners: int) -> int:
    """Warm spares to keep: ``asked`` if given (>= 0). By default (-1), none unless the chaos
    schedule kills learners (a spare costs an idle interpreter's memory); then the whole group
    for data-parallel (``restart_together`` ranks restart at once), and for DiLoCo modes two
    (at most ``learners``): one for a restart and one for a second learner killed while the
    first's replacement spare is still warming up (~9 s), which left 2, 6 and 3 of 8, 16 and
    11 restarts cold with a single spare (benchmarks/RESULTS.md)."""
    if asked >= 0:
        return asked
    if not any(e.kind == "kill" for e in chaos):
        return 0
    return restart_together if restart_together > 1 else min(2, learners)

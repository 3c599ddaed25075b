"""``python -m diloco.cli.spare``: a warm spare process (``diloco.runtime.spare`` says why).

It imports what a learner or a data-parallel rank imports, at a lower CPU priority when it
may raise it back, then blocks on its stdin for one handover line and runs that ``diloco``
command in this interpreter, with its stdout and stderr pointed at the command's log.
"""

from __future__ import annotations

import os
import sys

from diloco.runtime.spare import WARM_UP_NICE, can_restore_priority, parse_assignment


def warm_up() -> None:
    """Import what a learner or a data-parallel worker imports, including ``torch._dynamo``."""
    import torch._dynamo  # noqa: F401  (torch.optim imports it on the first optimizer)

    import diloco.baselines.dp.worker  # noqa: F401
    import diloco.cli  # noqa: F401
    import diloco.launch.learner_worker  # noqa: F401
    import diloco.learner.learner  # noqa: F401
    import diloco.recipes.language  # noqa: F401  (the text recipes: their model, data, optimizer)
    import diloco.recipes.moe  # noqa: F401


def main() -> int:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = can_restore_priority(base)
    if lowered:  # else warm up at full priority: a spare must not become a slow learner
        os.setpriority(os.PRIO_PROCESS, 0, min(19, base + WARM_UP_NICE))
    warm_up()
    line = sys.stdin.readline()
    if lowered:
        os.setpriority(os.PRIO_PROCESS, 0, base)
    if not line:
        return 0  # the supervisor is gone before it needed us
    try:
        argv, log = parse_assignment(line)
    except ValueError as exc:
        print(f"diloco spare: bad assignment: {exc}", file=sys.stderr)
        return 2
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from diloco.cli import main as diloco_main

    return diloco_main(argv)


if __name__ == "__main__":
    sys.exit(main())

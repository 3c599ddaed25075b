"""``python -m diloco.cli.spare``: a warm spare process (``diloco.runtime.spare`` says why).

It imports what a learner or a data-parallel rank imports, at a lower CPU priority when it
may raise it back, then takes one handover line from its stdin and runs that ``diloco``
command in this interpreter, with its stdout and stderr pointed at the command's log. The
line is read on its own thread from the start: a restart handed over while the imports still
run raises the priority back at once, so a busy machine never leaves a restarted learner
importing at the spare's priority (Linux keeps a niceness per thread: the main thread's is
the one lowered and restored).
"""

from __future__ import annotations

import os
import sys
import threading

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


class Handover:
    """The supervisor's handover line, read on a thread of its own while the main thread warms
    up at ``base`` + ``WARM_UP_NICE`` (``base`` None: at its own priority, which it may not
    raise back). The main thread's priority is back at ``base`` once the line has come."""

    def __init__(self, base: int | None) -> None:
        self._base = base
        self._main_thread = threading.get_native_id()
        self._lock = threading.Lock()
        self._line: str | None = None
        self._reader = threading.Thread(target=self._read, name="spare-handover", daemon=True)
        self._reader.start()  # (before the main thread lowers its own priority)
        with self._lock:
            if base is not None and self._line is None:
                os.setpriority(os.PRIO_PROCESS, self._main_thread, min(19, base + WARM_UP_NICE))

    def _read(self) -> None:
        line = sys.stdin.readline()
        with self._lock:
            self._line = line
            if self._base is not None:
                os.setpriority(os.PRIO_PROCESS, self._main_thread, self._base)

    def line(self) -> str:
        """The handover line; empty at the end of stdin (the supervisor is gone)."""
        self._reader.join()
        return self._line or ""


def main() -> int:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    handover = Handover(base if can_restore_priority(base) else None)
    warm_up()
    line = handover.line()
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

"""Child processes of the supervisor: started with their own log, always stopped in bounded time.

Children are separate ``python -m diloco.cli`` commands (never forked from a process that holds
a gRPC channel: gRPC's threads do not survive a fork), each in its own session so that a Ctrl+C in the terminal reaches
only the supervisor, which then stops them in order. Every child gets ``--exit-with-parent`` so
it also exits if the supervisor is killed outright.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MAX_UNPLANNED_RESTARTS = 5
"""A supervised process that exits on its own (not by chaos) more often than this fails the
run (``diloco launch --max-restarts``'s default)."""


def diloco_command(*args: str) -> list[str]:
    """The command line that runs ``diloco ARGS`` with this interpreter."""
    return [sys.executable, "-m", "diloco.cli", *args]


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a child: one BLAS/OpenMP thread unless told otherwise, unbuffered output."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """One child process with its stdout and stderr appended to ``log_path`` (run in ``cwd``,
    default this process's working directory)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        threads: int = 1,
        cwd: str | None = None,
        stdin=subprocess.DEVNULL,
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: variables set for this child on top of ``child_env``."""
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**child_env(threads), **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
        self.started_at = time.time()

    @classmethod
    def spare(cls, log_path: Path, *, threads: int = 1, cwd: str | None = None) -> Child:
        """A warm spare (:mod:`diloco.runtime.spare`) importing torch, waiting for :meth:`assign`."""
        argv = [sys.executable, "-m", "diloco.cli.spare"]
        return cls("spare", argv, log_path, threads=threads, cwd=cwd, stdin=subprocess.PIPE)

    def assign(self, name: str, argv: list[str], log_path: Path) -> None:
        """Make this spare run ``argv`` (a :func:`diloco_command`) as ``name``, its output
        appended to ``log_path``. ``RuntimeError`` if the spare cannot take it (it died)."""
        from diloco.runtime.spare import assignment

        prefix = diloco_command()
        if self.proc.stdin is None or argv[: len(prefix)] != prefix:
            raise ValueError(f"a spare runs diloco commands only, not {argv[:3]}")
        if not self.running:
            raise RuntimeError(f"spare {self.pid} exited with code {self.poll()}")
        try:
            self.proc.stdin.write(assignment(argv[len(prefix) :], str(log_path)))
            self.proc.stdin.close()
        except OSError as exc:  # broken pipe: it died just now
            raise RuntimeError(f"spare {self.pid} did not take the assignment: {exc}") from exc
        self.close_log()
        self.name, self.argv, self.log_path = name, argv, Path(log_path)
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait(5)
        self.close_log()
        return code

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def close_log(self) -> None:
        if not self._log.closed:
            self._log.close()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop_all(children: list[Child], timeout: float = 15.0) -> dict[str, int]:
    """Stop children in parallel (SIGTERM, bounded wait, SIGKILL); name -> exit code."""
    for c in children:
        c.signal(signal.SIGTERM)
        c.signal(signal.SIGCONT)  # a stopped (hung) process handles SIGTERM only once resumed
    codes: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    for c in children:
        left = max(0.0, deadline - time.monotonic())
        try:
            codes[c.name] = c.proc.wait(left)
        except subprocess.TimeoutExpired:
            c.kill()
            codes[c.name] = c.proc.wait(5)
        c.close_log()
    return codes


def wait_for_file(path: Path, timeout: float, alive: Child | None = None) -> str:
    """Contents of ``path`` once it exists; raises TimeoutError, or RuntimeError if ``alive`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if alive is not None and not alive.running:
            raise RuntimeError(f"{alive.name} exited with code {alive.poll()}:\n{alive.tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")


def exit_with_parent(stop: threading.Event, poll_s: float = 0.5) -> None:
    """Set ``stop`` when this process's parent goes away (for ``--exit-with-parent``)."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                stop.set()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()

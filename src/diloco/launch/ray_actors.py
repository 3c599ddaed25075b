"""The two halves of a Ray-backed process (see ``diloco.launch.ray_backend``).

:class:`ProcActor` lives in a Ray actor and runs one ``diloco`` command as its child process;
:class:`RayChild` is the supervisor's handle on such an actor. Neither imports Ray: the actor
class is wrapped with ``ray.remote`` by the backend, and RayChild is given the ``ray`` module.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from diloco.runtime.procs import Child, diloco_command

NODE_HOST = "ray-node-ip"
"""In a ``--bind`` flag given to :class:`ProcActor`: the IP of the node it runs on (the
address its raylet was started with: ``ray start --node-ip-address``, loopback for a test
cluster started on 127.0.0.1)."""
PLACED_ON = "[ray] placed on node"
"""What :class:`ProcActor` writes to its log when it starts, before the node's id and IP."""


class ProcActor:
    """One ``diloco`` command run as a child process of this Ray actor (see the module doc).

    ``command`` is the ``diloco`` sub-command and its flags, ``log`` the log file, ``cwd`` the
    working directory of the child (the driver's, for relative paths). With ``rebind_file``
    (the syncer's port file), a ``--bind=HOST:0`` flag is replaced by the address in that file
    when it exists, i.e. from the second incarnation on. A ``--bind=NODE_HOST:PORT`` flag binds
    the IP of the node the actor runs on (a syncer Ray may restart on another node). ``wrap``
    is a command the child runs under, one that execs the command it is given (e.g. ``ip netns
    exec NS``: a learner behind its site's network namespace), so that signals and the exit
    code stay the child's own.

    Contract: while the actor is alive its child runs or has exited 0 or was stopped through
    :meth:`stop`; any other exit ends the actor's process (``os._exit``), which Ray treats as
    a failure and restarts.
    """

    def __init__(
        self,
        name: str,
        command: list[str],
        log: str,
        cwd: str,
        rebind_file: str | None = None,
        wrap: list[str] | None = None,
    ) -> None:
        if rebind_file and Path(rebind_file).exists():
            address = Path(rebind_file).read_text().strip()
            command = [f"--bind={address}" if _binds_port_0(a) else a for a in command]
        import ray  # in an actor: this node, wherever Ray placed it

        host = ray.util.get_node_ip_address()  # the IP its raylet was started with
        command = [a.replace(f"--bind={NODE_HOST}:", f"--bind={host}:") for a in command]
        with open(log, "a") as f:  # which node each incarnation ran on
            f.write(f"{PLACED_ON} {ray.get_runtime_context().get_node_id()} ({host})\n")
        self.name = name
        self.stopping = False
        _priority_of_the_node(log)  # (the child inherits it)
        self.child = Child(name, [*(wrap or []), *diloco_command(*command)], Path(log), cwd=cwd)
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def _watch(self) -> None:
        code = self.child.proc.wait()
        if code != 0 and not self.stopping:
            with open(self.child.log_path, "a") as f:  # the child's log has closed: append
                f.write(f"\n[ray] {self.name} exited with code {code}; Ray restarts it\n")
            os._exit(1)

    def status(self) -> dict:
        """pid and start time of this incarnation's child, and its exit code (None: running)."""
        return {
            "pid": self.child.pid,
            "started_at": self.child.started_at,
            "code": self.child.poll(),
        }

    def signal(self, sig: int) -> None:
        self.child.signal(sig)

    def kill(self) -> None:
        """SIGKILL the child as a failure would (Ray then restarts this actor)."""
        self.child.kill()

    def stop(self, timeout: float) -> int:
        """Stop the child for good (SIGCONT, SIGTERM, bounded wait, SIGKILL); its exit code."""
        self.stopping = True
        self.child.signal(signal.SIGCONT)
        return self.child.stop(timeout)

    def terminate(self) -> None:
        """Kill the child for good (cleanup: the actor is killed next)."""
        self.stopping = True
        self.child.signal(signal.SIGCONT)
        self.child.kill()


def _priority_of_the_node(log: str) -> None:
    """Give this thread (and so the child it starts) the niceness of the raylet that started
    this worker: Ray starts its workers at niceness 15 (``RAY_worker_niceness``), and a learner
    or syncer inheriting it starves beside anything else on the node (a learner trained not
    one step in 90 s beside two busy processes). Raising a priority needs root or an
    ``RLIMIT_NICE`` that allows it: without, the child keeps Ray's and the log says so."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        node = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if node < now:
            os.setpriority(os.PRIO_PROCESS, 0, node)  # (Linux: this thread's)
    except OSError as exc:
        with open(log, "a") as f:
            f.write(
                f"[ray] runs at Ray's worker niceness {now} ({exc.strerror}); start the "
                "cluster with RAY_worker_niceness=0 to run it at the node's\n"
            )


def _binds_port_0(arg: str) -> bool:
    return arg.startswith("--bind=") and arg.endswith(":0")


class RayChild:
    """The supervisor's view of one actor: what :class:`~diloco.runtime.procs.Child` offers
    (``running``, ``poll``, ``signal``, ``kill``, ``tail``) plus the incarnations seen.

    Status is polled without blocking: one ``status`` call is kept in flight and read when it
    is ready, then the next one is sent. While Ray restarts the actor, calls fail with
    ``ActorUnavailableError`` and are repeated; ``DEAD_AFTER`` other failures in a row
    (``ActorDiedError``: Ray has given up, ``max_restarts``) make the actor ``dead``.
    """

    DEAD_AFTER = 3

    def __init__(self, ray, name: str, actor, log: Path) -> None:
        self.ray = ray
        self.name = name
        self.actor = actor
        self.log_path = log
        self.info: dict | None = None
        self.failures = 0
        self.launches: list[tuple[int, float]] = []  # (pid, started_at) of each incarnation seen
        # Ray < 2.32 has no ActorUnavailableError; an empty tuple catches nothing.
        self._restarting = getattr(ray.exceptions, "ActorUnavailableError", ())
        self._pending = actor.status.remote()

    def refresh(self, timeout: float = 0.0) -> None:
        ready, _ = self.ray.wait([self._pending], timeout=timeout)
        if not ready:
            return
        try:
            self.info = self.ray.get(self._pending)
            self.failures = 0
            launch = (self.info["pid"], self.info["started_at"])
            if not self.launches or self.launches[-1] != launch:
                self.launches.append(launch)
        except self._restarting:
            pass  # Ray is restarting the actor: it answers again once the actor is back
        except self.ray.exceptions.RayError:  # ActorDiedError: Ray has given up on it
            self.failures += 1
        self._pending = self.actor.status.remote()

    @property
    def dead(self) -> bool:
        return self.failures >= self.DEAD_AFTER

    @property
    def running(self) -> bool:
        self.refresh()
        return not self.dead and (self.info is None or self.info["code"] is None)

    def poll(self) -> int | None:
        if self.dead:
            return -1
        return None if self.info is None else self.info["code"]

    @property
    def pid(self) -> int | None:
        return self.info["pid"] if self.info else None

    def signal(self, sig: int) -> None:
        self.actor.signal.remote(sig)

    def kill(self) -> None:
        self.actor.kill.remote()

    def close_log(self) -> None:
        pass  # the actor owns the log

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

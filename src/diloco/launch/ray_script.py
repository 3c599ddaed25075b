"""``diloco launch --backend ray``: the copies of the user's script as Ray actors.

The syncer is started as ``diloco run --backend ray`` starts it (``RaySupervisor``: an actor
pinned to this node, restarted always, bound to ``--ray-syncer-host``: loopback for a local
Ray instance). Each copy of the script is a :class:`ScriptActor`: a Ray actor that runs
``python SCRIPT ARGS`` as its child process, in the launcher's working directory, with the
environment ``diloco.Learner.from_env`` reads (the same variables as the local backend), and
asks for ``--ray-learner-cpus/--ray-learner-gpus`` and ``--ray-learner-resources`` as a learner
of ``diloco run`` does. A copy that exits non-zero (or is killed) ends its actor's worker, and
Ray starts the actor again with the same arguments: the same id, environment and work
directory, so the copy resumes from its checkpoint. Ray restarts it at most ``--max-restarts``
times; one more failure fails the run (exit 1), as with the local backend. A copy that exits
0 has finished; the run ends when every copy has. The syncer stops by itself once every copy
has left; if it does while a copy is still down (Ray restarting it after the others had
finished), it is started again, so the copy finds it (``RaySupervisor.poll``).

Requirements are ``diloco run --backend ray``'s: ``diloco launch`` runs on a node of the
cluster, and the working directory (the script, ``--runs-dir``) is at the same path on every
node the copies may run on.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from diloco.launch.ray_actors import ProcActor, RayChild
from diloco.launch.ray_backend import RaySupervisor, learner_resources
from diloco.launch.supervisor import ProcessSlot
from diloco.runtime.procs import Child


class ScriptActor(ProcActor):
    """One copy of the user's script run as the child process of this Ray actor.

    ``script`` is the script and its arguments (run with this worker's Python), ``env`` the
    variables set for it; ``log`` and ``cwd`` as :class:`ProcActor`'s, and so is the contract
    (a non-zero exit not asked for through :meth:`stop` ends the actor's process: Ray restarts
    the actor, which runs the copy again)."""

    def __init__(  # (ProcActor's starts a diloco command: this one starts the script)
        self, name: str, script: list[str], log: str, cwd: str, env: dict[str, str]
    ) -> None:
        self.name = name
        self.stopping = False
        self.child = Child(name, [sys.executable, *script], Path(log), cwd=cwd, env=env)
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()


class LaunchRaySupervisor(RaySupervisor):
    """``RaySupervisor`` that also starts copies of a script (``add`` with ``env``).

    ``config`` is the ``LaunchConfig`` (its ``ray`` options checked by
    ``ray_backend.check_config``). An actor Ray no longer restarts fails the run (exit 1),
    as a copy failing more than ``--max-restarts`` times does with the local backend."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.script_actor_class = self.ray.remote(ScriptActor)

    def add(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> ProcessSlot:
        """Start a ``diloco`` command (the syncer: no ``env``) as ``RaySupervisor`` does, or
        the copy ``argv`` (``[python, SCRIPT, ARGS...]``) with its variables ``env``."""
        if env is None:
            return super().add(name, argv, log)
        ray_options = self.config.ray
        index = len([n for n in self.slots if n != "syncer"])
        options = {
            "num_cpus": ray_options.ray_learner_cpus,
            "num_gpus": ray_options.ray_learner_gpus,
            "max_restarts": self.config.max_restarts,
            "resources": learner_resources(ray_options.ray_learner_resources, index),
        }
        script = argv[1:] if argv and argv[0] == sys.executable else list(argv)
        actor = self.script_actor_class.options(max_concurrency=4, **options).remote(
            name, script, str(log), os.getcwd(), dict(env)
        )
        self.actors[name] = actor
        slot = ProcessSlot(name, argv, log, env=env)
        slot.child = RayChild(self.ray, name, actor, Path(log))
        self.slots[name] = slot
        return slot

    def poll(self) -> None:
        """``RaySupervisor.poll``; ``RuntimeError`` (the run fails) once Ray has given up on
        an actor: a copy that failed once more after ``--max-restarts`` restarts (a copy
        that fails at once may fail before any of its lives was seen)."""
        super().poll()
        for slot in self.slots.values():
            if slot.child is not None and slot.child.dead:
                raise RuntimeError(
                    f"{slot.name} keeps failing: Ray restarted it up to --max-restarts "
                    f"{self.config.max_restarts} times and it failed again:\n{slot.child.tail()}"
                )


def make_launch_supervisor(config, **kwargs):
    """The supervisor of ``diloco launch``'s ``--backend``: local processes, or Ray actors."""
    if config.backend == "ray":
        return LaunchRaySupervisor(config, **kwargs)
    from diloco.launch.supervisor import Supervisor

    return Supervisor(**kwargs)

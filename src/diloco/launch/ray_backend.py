"""``diloco run --backend ray``: the syncer and the learners as Ray actors.

Each process of the run (``diloco syncer``, ``diloco learner``) is the same command as with the
local backend, started as a child process by a small Ray actor (:class:`ProcActor`) that holds
the process's resource request (``--ray-learner-cpus/--ray-learner-gpus``). When the child dies
with a non-zero code (a crash, ``kill -9``, a chaos kill), the actor ends its own worker process
so that **Ray restarts the actor** (``max_restarts``); the new incarnation starts the same
command again: a learner keeps its id and work directory, resumes from its own checkpoint and
rejoins; the syncer reloads its state directory and binds the address its first incarnation got
(read back from its port file), or with ``--ray-syncer-resource`` the address of the node Ray
placed it on, which learners follow through its port file. With ``--shards S`` each shard is
an actor of its own (slots ``syncer-0`` .. ``syncer-{S-1}``, shard i on a node labelled
``NAME[i mod k]``), restarted alone. A child that exits 0 has finished and stays down.

:class:`RaySupervisor` keeps the local supervisor's bookkeeping (``diloco run`` draws the same
view, keeps the same stop conditions and writes the same run directory): it observes the
actors, writes a ``restart`` record on the event tape for every incarnation Ray starts, carries
out the chaos kinds that need no local relay and stops everything in bounded time.

Ray is an optional dependency (``pip install 'diloco[ray]'``), imported only here and only when
the Ray backend is used. Requirements on a cluster: ``diloco run`` runs on a node of the cluster
(without ``--ray-syncer-resource`` the syncer is pinned to that node so that a restart can bind
the same address), and the runs
directory is on a filesystem every node sees at the same path (logs, progress, checkpoints).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.launch.ray_actors import NODE_HOST, ProcActor, RayChild
from diloco.launch.supervisor import ProcessSlot, Supervisor
from diloco.launch.syncers import is_syncer, syncer_names
from diloco.runtime.procs import diloco_command

if TYPE_CHECKING:
    from diloco.config.run import RunConfig

MISSING = "the Ray backend needs Ray: pip install 'diloco[ray]'"
#: Chaos kinds the Ray backend cannot carry out: network faults need a TCP relay next to each
#: learner; a syncer hang and a full disk (a tmpfs under its state) are not implemented for
#: Ray actors.
UNSUPPORTED_CHAOS = ("partition", "drop", "delay", "lose-replies", "syncer-hang", "disk-full")
LOOPBACK = "127.0.0.1"


LOOPBACK_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set before Ray is imported to join a cluster whose nodes run on the loopback (``ray start
--node-ip-address 127.0.0.1``, a test cluster): Ray then takes this host's address to be
127.0.0.1 instead of rewriting ``--address 127.0.0.1:PORT`` to the machine's network address
(where such a cluster does not listen). The name is Ray's; on Linux it changes only that."""


def on_loopback(address: str) -> bool:
    """Whether a Ray cluster address ``HOST:PORT`` names this host's loopback.

    >>> on_loopback("127.0.0.1:6379"), on_loopback("localhost:6379"), on_loopback("auto")
    (True, True, False)
    """
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class RayBackendError(RuntimeError):
    """The Ray backend cannot run as asked; the message says why and what to do."""


def import_ray():
    """``ray``, or RayBackendError telling how to install it."""
    try:
        import ray
    except ImportError:
        raise RayBackendError(MISSING) from None
    return ray


RAY_DEFAULTS = {
    "ray_learner_cpus": 1.0,
    "ray_learner_gpus": 0.0,
    "ray_syncer_cpus": 1.0,
    "ray_max_restarts": -1,
}


def check_config(config: RunConfig, chaos_kinds: set[str]) -> None:
    """Refuse what the chosen backend cannot do (ValueError); fill in the Ray defaults."""
    ray_flags = [
        *RAY_DEFAULTS,
        "address",
        "ray_syncer_host",
        "ray_learner_resources",
        "ray_syncer_resource",
    ]
    if config.ray.backend != "ray":
        given = [
            f"--{k.replace('_', '-')}" for k in ray_flags if getattr(config.ray, k) is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --backend ray")
        return
    for key, value in RAY_DEFAULTS.items():
        if getattr(config.ray, key) is None:
            setattr(config.ray, key, value)
    if importlib.util.find_spec("ray") is None:
        raise ValueError(MISSING)
    if config.mode == "dp":
        raise ValueError("--mode dp: not supported with --backend ray (a static gloo group)")
    if getattr(config, "spares", -1) > 0:
        raise ValueError("--spares: local backend only (Ray restarts its own actors)")
    bad = sorted(chaos_kinds & set(UNSUPPORTED_CHAOS))
    if bad:
        raise ValueError(
            f"--chaos {', '.join(bad)}: not supported with --backend ray "
            "(network faults need a local relay per learner); use --backend local"
        )
    if config.ray.address and config.ray.address.startswith("ray://"):
        raise ValueError(
            "--address ray://...: run diloco on a node of the cluster (--address auto)"
        )
    if (
        min(config.ray.ray_learner_cpus, config.ray.ray_learner_gpus, config.ray.ray_syncer_cpus)
        < 0
    ):
        raise ValueError("--ray-*-cpus/gpus must be >= 0")
    for flag, names in (
        ("--ray-learner-resources", config.ray.ray_learner_resources),
        ("--ray-syncer-resource", config.ray.ray_syncer_resource),
    ):
        if names is not None and not all(n.strip() for n in names.split(",")):
            raise ValueError(f"{flag} {names!r}: a resource name is empty")
    if config.ray.ray_syncer_resource:
        names = config.ray.ray_syncer_resource.split(",")
        if len(names) > config.shards:
            raise ValueError(
                f"--ray-syncer-resource {config.ray.ray_syncer_resource!r}: more "
                f"--ray-syncer-resource names than --shards ({config.shards}); shard i runs "
                "on a node with NAME[i mod k]"
            )


LABEL_AMOUNT = 0.001
"""What an actor asks of a custom resource used as a node's label (``--ray-*-resource*``):
little enough that every learner placed there fits."""


def learner_resources(names: str | None, index: int) -> dict[str, float]:
    """The custom resources learner ``index`` asks for: ``NAME[index mod k]`` of
    ``--ray-learner-resources`` (none without it).

    >>> learner_resources("site-a,site-b", 3)
    {'site-b': 0.001}
    """
    return label_for(names, index)


def syncer_resources(names: str | None, shard: int) -> dict[str, float]:
    """The custom resources syncer shard ``shard`` asks for: ``NAME[shard mod k]`` of
    ``--ray-syncer-resource`` (none without it: the shard is pinned to the node of ``diloco
    run``). One name per shard puts each shard on its own node.

    >>> syncer_resources("hub-0,hub-1", 1)
    {'hub-1': 0.001}
    """
    return label_for(names, shard)


def label_for(names: str | None, index: int) -> dict[str, float]:
    """``{NAME[index mod k]: LABEL_AMOUNT}`` for a comma-separated list of labels, ``{}``
    for none."""
    if not names:
        return {}
    chosen = [n.strip() for n in names.split(",")]
    return {chosen[index % len(chosen)]: LABEL_AMOUNT}


class RaySupervisor(Supervisor):
    """:class:`~diloco.launch.supervisor.Supervisor` whose slots are Ray actors.

    Joins the Ray cluster at ``config.ray.address`` or starts a local Ray instance sized to the
    run's requests (:meth:`close` shuts that one down). ``add`` starts an actor per process:
    the syncer (each shard) pinned to this node or placed by its label and restarted always,
    learners wherever their
    ``--ray-learner-cpus/--ray-learner-gpus`` fit, restarted up to ``--ray-max-restarts``
    times. Restarts are Ray's; ``poll`` records each new incarnation it sees (``restart`` on
    the tape, with the time the new child started, and ``crash`` unless chaos caused it).
    """

    def __init__(self, config: RunConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        if not config.ray.address or on_loopback(config.ray.address):
            # (read when Ray is imported, next): an instance of our own is on the loopback too
            os.environ.update(LOOPBACK_CLUSTER_ENV)
        self.ray = ray = import_ray()
        self.config = config
        self.owns_ray = not config.ray.address
        # ray.init installs a SIGTERM handler that exits at once; the run's own handler stops
        # the run in order (learners, final evaluation, summary): put it back afterwards.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        if self.owns_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            cpus = (
                config.learners * config.ray.ray_learner_cpus
                + config.shards * config.ray.ray_syncer_cpus
            )
            ray.init(
                address="local",
                num_cpus=max(1, int(cpus + 0.999)),
                num_gpus=None if config.ray.ray_learner_gpus else 0,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=100 * 1024 * 1024,  # nothing of ours goes through it
                _node_ip_address=LOOPBACK,  # it serves this host only: bind nothing else
            )
        else:
            ray.init(address=config.ray.address, log_to_driver=False)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
        # Ray's driver prints its notices (e.g. "a worker died", which each restart here
        # causes) to sys.stdout; divert them to stderr so that stdout stays the run's
        # (the view, ``--json``). ``close`` restores it.
        self._stdout = sys.stdout
        sys.stdout = sys.stderr
        self.actors: dict[str, object] = {}  # every actor started, for the cleanup
        self.given_up: set[str] = set()  # slots whose actor Ray no longer restarts
        try:
            self.node_id = ray.get_runtime_context().get_node_id()
            self.syncer_moves = bool(config.ray.ray_syncer_resource)
            """The syncer may restart on another node: learners follow its port file."""
            self.syncer_host = config.ray.ray_syncer_host or (
                LOOPBACK
                if self.owns_ray
                else NODE_HOST
                if self.syncer_moves
                else ray.util.get_node_ip_address()
            )
            self.actor_class = ray.remote(ProcActor)
            self._warn_if_short()
        except BaseException:
            self.close()
            raise

    def _warn_if_short(self) -> None:
        have = self.ray.cluster_resources()
        need = {
            "CPU": self.config.learners * self.config.ray.ray_learner_cpus
            + self.config.shards * self.config.ray.ray_syncer_cpus,
            "GPU": self.config.learners * self.config.ray.ray_learner_gpus,
        }
        for key, n in need.items():
            if n > have.get(key, 0.0):
                print(
                    f"diloco run: the run asks Ray for {n:g} {key} and the cluster has "
                    f"{have.get(key, 0.0):g} now; actors wait until it fits",
                    file=sys.stderr,
                )

    def add(self, name: str, argv: list[str], log: Path) -> ProcessSlot:
        """Start ``argv`` (a ``diloco_command``) in an actor; the slot's child is a RayChild."""
        prefix = diloco_command()
        command = argv[len(prefix) :] if argv[: len(prefix)] == prefix else list(argv)
        port_file = None
        shard = syncer_names(self.config.shards).index(name) if is_syncer(name) else None
        if shard is not None and self.syncer_moves:  # wherever its label is; rebinds anew
            options = {
                "num_cpus": self.config.ray.ray_syncer_cpus,
                "max_restarts": -1,
                "resources": syncer_resources(self.config.ray.ray_syncer_resource, shard),
            }
        elif shard is not None:  # on this node, where a restart binds the same address
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            port_file = next(
                (a.split("=", 1)[1] for a in command if a.startswith("--port-file=")), None
            )
            options = {
                "num_cpus": self.config.ray.ray_syncer_cpus,
                "max_restarts": -1,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            }
        else:
            index = len([n for n in self.slots if not is_syncer(n)])
            options = {
                "num_cpus": self.config.ray.ray_learner_cpus,
                "num_gpus": self.config.ray.ray_learner_gpus,
                "max_restarts": self.config.ray.ray_max_restarts,
                "resources": learner_resources(self.config.ray.ray_learner_resources, index),
            }
        actor = self.actor_class.options(max_concurrency=4, **options).remote(
            name, command, str(log), os.getcwd(), port_file
        )
        self.actors[name] = actor
        slot = ProcessSlot(name, argv, log)
        slot.child = RayChild(self.ray, name, actor, Path(log))
        self.slots[name] = slot
        return slot

    def _inject(self, event, now: float) -> None:
        slot = self.slots.get(event.target)
        if slot is None or slot.finished or slot.child is None or not slot.child.running:
            return
        if slot.resume_at is not None or slot.restart_at is not None:
            return  # hung, or killed and not back yet
        if event.kind not in ("kill", "syncer-kill", "hang"):
            return  # refused by check_args; nothing else reaches here
        kill = event.kind != "hang"
        # Ray restarts a killed process at once: the spec's down time applies to hangs only.
        down_s = 0.0 if kill else round(event.down_s, 3)
        self.tape(
            {
                "event": "chaos",
                "t": time.time(),
                "kind": event.kind,
                "target": event.target,
                "down_s": down_s,
            }
        )
        if kill:
            slot.expected_death = True
            slot.planned_deaths += 1
            slot.restart_at = now  # marks "down until Ray's restart is seen"
            slot.child.kill()
        else:
            slot.child.signal(signal.SIGSTOP)
            slot.resume_at = now + event.down_s

    def poll(self) -> None:
        """``Supervisor.poll``, then ``_restart_stopped_syncers``."""
        super().poll()
        self._restart_stopped_syncers(self.clock())

    def _restart_stopped_syncers(self, now: float) -> None:
        """Start again a syncer that stopped by itself (exit 0) while a learner is still to
        run. ``diloco launch`` starts its syncer with ``--stop-when-learners-leave``: it stops
        once every learner has been gone for a lease. Ray restarts a syncer's actor only when
        the syncer fails, so a learner that Ray was still restarting when the others had
        finished came back to no syncer, and failed until Ray gave up on it. The local
        supervisor starts a syncer again whatever its exit; this does the same."""
        if all(slot.finished for slot in self.learners()):
            return  # (the run is over: the syncer stopped as it should)
        for slot in self.slots.values():
            if not is_syncer(slot.name) or slot.child is None or slot.restart_at is not None:
                continue
            if slot.child.poll() != 0:
                continue
            slot.expected_death = True  # (its restart is not a crash)
            slot.planned_deaths += 1
            slot.restart_at = now  # down until Ray's restart of its actor is seen
            self.tape({"event": "syncer-stopped", "t": time.time(), "target": slot.name})
            self.ray.kill(slot.child.actor, no_restart=False)

    def _check(self, slot: ProcessSlot, now: float) -> None:
        child = slot.child
        if slot.resume_at is not None and now >= slot.resume_at:
            slot.resume_at = None
            child.signal(signal.SIGCONT)
            self.tape({"event": "resume", "t": time.time(), "target": slot.name})
        if child is None:
            return
        child.refresh()
        for _pid, started_at in child.launches[1 + slot.restarts :]:
            slot.restarts += 1
            slot.restart_at = None
            if slot.expected_death:
                slot.expected_death = False
                slot.exit_codes.append(-signal.SIGKILL)
            else:  # its exit code went down with the actor; its log has it
                slot.exit_codes.append(None)
                self.tape(
                    {"event": "crash", "t": started_at, "target": slot.name, "exit_code": None}
                )
            self.tape({"event": "restart", "t": started_at, "target": slot.name, "by": "ray"})
        if child.dead and slot.name not in self.given_up:  # kept polling: it may yet answer
            self.given_up.add(slot.name)
            self.tape({"event": "crash", "t": time.time(), "target": slot.name, "exit_code": None})
            print(
                f"diloco run: Ray stopped restarting {slot.name}:\n{child.tail()}", file=sys.stderr
            )
        elif not child.dead:
            self.given_up.discard(slot.name)
        if child.poll() == 0 and not is_syncer(slot.name):
            slot.finished = True
            slot.exit_codes.append(0)
            slot.child = None

    def stop(self, names: list[str], timeout: float) -> dict[str, int | None]:
        """Stop the named processes in parallel (bounded); as ``Supervisor.stop``."""
        refs = {}
        for name in names:
            slot = self.slots[name]
            slot.restart_at = None
            slot.resume_at = None
            if slot.child is not None:
                refs[name] = slot.child.actor.stop.remote(timeout)
        deadline = time.monotonic() + timeout + 10.0
        out: dict[str, int | None] = {}
        for name in names:
            slot = self.slots[name]
            if name in refs:
                try:
                    left = max(0.1, deadline - time.monotonic())
                    out[name] = self.ray.get(refs[name], timeout=left)
                except self.ray.exceptions.RayError:  # died meanwhile, or no answer in time
                    out[name] = None
                slot.exit_codes.append(out[name])
                slot.child = None
            else:
                out[name] = 0 if slot.finished else None
        return out

    def kill_everything(self) -> None:
        """Kill every child and every actor (no restart); bounded."""
        refs = [a.terminate.remote() for a in self.actors.values()]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=5.0)
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)
        for slot in self.slots.values():
            slot.child = None

    def close(self) -> None:
        """Disconnect from Ray; a local Ray instance that this run started shuts down."""
        try:
            if self.ray.is_initialized():
                self.ray.shutdown()
        finally:
            sys.stdout = self._stdout

#!/usr/bin/env python3
"""DiLoCo learners from a Ray cluster, for a syncer that runs elsewhere: the Ray site of a run
across clusters (docs/deploy.md, "Across clusters"). Run it on a node of the cluster:

    python deploy/ray/learners.py --address auto --syncer HOST:PORT --token-file token \\
        --learners 4 --first-index 8 --id-prefix ray- --workdir /shared/diloco/ray \\
        --resource site-b -- --recipe shakespeare --total-steps 20000

Learner ``k`` of this site is ``diloco learner --id ID_PREFIXk --index FIRST_INDEX+k
--workdir WORKDIR/k``, plus the flags after ``--``, run as the child process of a Ray actor
(``diloco.launch.ray_actors.ProcActor``, the actor ``diloco run --backend ray`` uses). Ray
places it (``--cpus``, ``--gpus``, ``--resource``) and restarts it when it fails or its node is
lost (``--max-restarts``); a restarted learner keeps its id and work directory, so it resumes
from its checkpoint and rejoins the syncer as the same learner (``--workdir`` must be on a
filesystem every node sees). Restarts have one owner here: Ray. ``--wrap`` runs each learner
under a command that execs it (for example ``ip netns exec NS``, or a container runtime).

The script ends when every learner has exited 0 (finished its ``--total-steps``); on SIGTERM or
SIGINT it stops them all (each flushes its progress to the syncer) and ends. Exit code: 0, or
1 if Ray gave up on a learner (``--max-restarts`` spent).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from diloco.launch.ray_actors import ProcActor, RayChild
from diloco.launch.ray_backend import learner_resources

STOP_TIMEOUT_S = 30.0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    at = argv.index("--") if "--" in argv else len(argv)
    own, learner_flags = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(
        description="DiLoCo learners from a Ray cluster for a syncer elsewhere "
        "(flags after -- go to every `diloco learner`)."
    )
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--syncer", required=True, help="HOST:PORT, shard list, or @FILE")
    p.add_argument("--token-file", required=True, help="the syncer's shared token")
    p.add_argument("--learners", type=int, required=True, help="learners of this site")
    p.add_argument("--first-index", type=int, default=0, help="--index of the first (data)")
    p.add_argument("--id-prefix", default="ray-", help="learner ids: PREFIX0, PREFIX1, ...")
    p.add_argument("--workdir", required=True, help="WORKDIR/k is learner k's (shared fs)")
    p.add_argument("--cpus", type=float, default=1.0, help="CPUs per learner")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs per learner")
    p.add_argument(
        "--resource",
        help="place learners on nodes with this custom resource (NAME[,NAME...]: learner k "
        "on NAME[k mod n]), asked as a label (0.001 of it)",
    )
    p.add_argument("--max-restarts", type=int, default=-1, help="per learner (-1: always)")
    p.add_argument("--wrap", default="", help="a command each learner runs under")
    args = p.parse_args(own)
    if args.learners < 1:
        p.error("--learners must be >= 1")
    if min(args.cpus, args.gpus) < 0:
        p.error("--cpus/--gpus must be >= 0")
    return args, learner_flags


def learner_command(args: argparse.Namespace, k: int, flags: list[str]) -> list[str]:
    """The ``diloco`` arguments of learner ``k`` of this site. Pure."""
    return [
        "learner",
        f"--syncer={args.syncer}",
        f"--token-file={os.path.abspath(args.token_file)}",
        f"--id={args.id_prefix}{k}",
        f"--index={args.first_index + k}",
        f"--workdir={Path(args.workdir).resolve() / str(k)}",
        *flags,
    ]


def main(argv: list[str] | None = None) -> int:
    args, flags = parse_args(sys.argv[1:] if argv is None else argv)
    import ray

    ray.init(address=args.address, log_to_driver=False)
    actor_class = ray.remote(ProcActor)
    wrap = shlex.split(args.wrap)
    children: list[RayChild] = []
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    try:
        for k in range(args.learners):
            name = f"{args.id_prefix}{k}"
            log = Path(args.workdir).resolve() / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            options = {
                "num_cpus": args.cpus,
                "num_gpus": args.gpus,
                "max_restarts": args.max_restarts,
                "max_concurrency": 4,
                "resources": learner_resources(args.resource, k),
            }
            actor = actor_class.options(**options).remote(
                name, learner_command(args, k, flags), str(log), os.getcwd(), None, wrap
            )
            children.append(RayChild(ray, name, actor, log))
            print(f"{name}: started (log {log})", flush=True)
        seen: dict[str, int] = {}
        while not stopping:
            for child in children:
                child.refresh()
                if len(child.launches) > seen.get(child.name, 1):
                    seen[child.name] = len(child.launches)
                    print(
                        f"{child.name}: restarted by Ray (life {len(child.launches)})", flush=True
                    )
            if all(child.poll() is not None for child in children):
                break
            time.sleep(0.5)
        given_up = [c.name for c in children if c.dead]
        for name in given_up:
            print(f"{name}: Ray stopped restarting it", file=sys.stderr, flush=True)
        refs = [c.actor.stop.remote(STOP_TIMEOUT_S) for c in children if c.poll() is None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S + 10)
        return 1 if given_up else 0
    finally:
        for child in children:
            ray.kill(child.actor, no_restart=True)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

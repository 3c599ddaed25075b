"""``diloco syncer``: run the syncer service standalone (the supervisor uses it too)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def add_syncer_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``diloco syncer`` and the launchers that start one."""
    p.add_argument(
        "--quorum", type=int, default=1, help="K: contributions a round needs (default 1)"
    )
    p.add_argument(
        "--wait-for-all",
        type=int,
        default=0,
        metavar="M",
        help="synchronous DiLoCo: every round waits for M contributions",
    )
    p.add_argument(
        "--gamma", type=float, default=1.0, help="grace window scale γ (0: close at quorum)"
    )
    p.add_argument("--tau", type=float, default=2.0, help="overlap τ in steps (default 2)")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=2,
        help="accept contributions up to this many versions behind",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=5.0,
        help="seconds without heartbeat before a learner is not live",
    )
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--up-codec", default="int4", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--down-codec", default="bf16", choices=["fp32", "bf16", "int8", "int4"])


def config_from_args(args: argparse.Namespace):
    from diloco.syncer.config import SyncerConfig

    return SyncerConfig(
        quorum=args.quorum,
        wait_for_all=args.wait_for_all,
        gamma=args.gamma,
        tau=args.tau,
        max_staleness=args.max_staleness,
        lease_s=args.lease,
        heartbeat_s=min(1.0, args.lease / 4),
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        up_codec=args.up_codec,
        down_codec=args.down_codec,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from diloco.algorithm.fragments import balanced_fragments
    from diloco.recipes import get_recipe
    from diloco.syncer.server import SyncerServer
    from diloco.syncer.store import StateError

    torch.set_num_threads(args.threads)
    recipe = get_recipe(args.recipe, data_path=args.data)
    model = recipe.build_model(args.seed)
    layout = balanced_fragments(model.named_parameters(), args.fragments)
    named = dict(model.named_parameters())
    params = [layout.gather(p, named) for p in range(layout.num_fragments)]
    try:
        server = SyncerServer(
            layout,
            params,
            config_from_args(args),
            bind=args.bind,
            state_dir=args.state_dir,
            tape_path=args.tape
            or (Path(args.state_dir) / "events.jsonl" if args.state_dir else None),
        )
    except (StateError, ValueError, OSError) as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_parent:
        from diloco.launch.procs import exit_with_parent

        exit_with_parent(stop)
    server.start()
    if args.port_file:
        tmp = Path(str(args.port_file) + ".tmp")
        tmp.write_text(server.address)
        os.replace(tmp, args.port_file)
    print(
        f"diloco syncer serving on {server.address} ({layout.num_fragments} fragments, versions from {args.state_dir or 'memory'})",
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.stop(grace=1.0)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("syncer", help="run the syncer service")
    p.add_argument(
        "--bind", default="127.0.0.1:7000", help="address to listen on (port 0 picks a free port)"
    )
    p.add_argument("--port-file", help="write the bound host:port here once serving")
    p.add_argument("--state-dir", help="durable state directory (restored on restart)")
    p.add_argument("--tape", help="event tape path (default STATE_DIR/events.jsonl)")
    p.add_argument(
        "--recipe",
        default="shakespeare",
        help="model recipe: gives the layout and the initial parameters",
    )
    p.add_argument("--data", help="UTF-8 text file for the recipe instead of Shakespeare")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial model")
    p.add_argument(
        "--fragments", type=int, default=24, help="P: fragments (must match the learners)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop (cleanly) if the parent process dies"
    )
    add_syncer_arguments(p)
    p.set_defaults(func=run)

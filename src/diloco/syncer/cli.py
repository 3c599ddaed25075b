"""``diloco syncer``: run the syncer service standalone (the supervisor uses it too)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def add_syncer_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``diloco syncer`` and the launchers that start one (H, ``--sync-every``,
    is each command's own: the launchers give it to learners and syncer alike)."""
    from diloco.syncer.config import SyncerConfig

    p.add_argument(
        "--schedule",
        choices=["syncer", "learner"],
        default=SyncerConfig.schedule,
        help="who drives the rounds: syncer (default: the syncer's clock asks every live "
        "learner for each fragment in turn) or learner (each learner sends on its own step "
        "count; synchronous mode uses it); docs/algorithm.md",
    )
    p.add_argument(
        "--merge",
        dest="merge_rule",
        choices=["rda", "mean"],
        default=SyncerConfig.merge_rule,
        help="rda (default): radial-directional averaging, embeddings by weighted mean; mean: "
        "weighted mean for every tensor (an ablation)",
    )
    p.add_argument(
        "--weighting",
        choices=["tokens", "uniform"],
        default=SyncerConfig.weighting,
        help="tokens (default): weight tokens^2/steps; uniform: every contribution 1 (ablation)",
    )
    p.add_argument(
        "--weight-cap",
        type=float,
        default=SyncerConfig.weight_cap,
        help="no contribution weighs more than this x the round's lower median weight "
        f"(default {SyncerConfig.weight_cap}; 0: off)",
    )
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
        "--gamma",
        type=float,
        default=SyncerConfig.gamma,
        help=f"grace window scale γ (default {SyncerConfig.gamma}; 0: close at quorum)",
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
    p.add_argument(
        "--outer-scale",
        default="share",
        choices=["share", "none"],
        help="share (default): scale each round's merged delta by the share of the live "
        "learners' tokens it holds, so the outer lr does not depend on M; none: full lr per "
        "round (see docs/algorithm.md)",
    )
    p.add_argument("--up-codec", default="int4", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument(
        "--down-codec",
        default=SyncerConfig.down_codec,
        choices=["fp32", "bf16", "int8", "int4"],
        help="codec of the merged deltas the syncer sends down (keyframes are fp32; default "
        f"{SyncerConfig.down_codec})",
    )
    p.add_argument(
        "--norm-guard",
        type=float,
        default=20.0,
        metavar="K",
        help="refuse contributions whose norm per step exceeds K x the fragment's running "
        "median (default 20; 0: off; see docs/security.md)",
    )


def config_from_args(args: argparse.Namespace):
    from diloco.syncer.config import SyncerConfig

    return SyncerConfig(
        schedule=args.schedule,
        sync_every=args.sync_every,
        weight_cap=args.weight_cap,
        merge_rule=args.merge_rule,
        weighting=args.weighting,
        quorum=args.quorum,
        wait_for_all=args.wait_for_all,
        gamma=args.gamma,
        tau=args.tau,
        max_staleness=args.max_staleness,
        lease_s=args.lease,
        heartbeat_s=min(1.0, args.lease / 4),
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_scale=args.outer_scale,
        up_codec=args.up_codec,
        down_codec=args.down_codec,
        norm_guard_k=args.norm_guard,
    )


def add_security_arguments(p: argparse.ArgumentParser, *, server: bool) -> None:
    """Token and TLS flags (docs/security.md); ``server`` adds the syncer-only ones."""
    p.add_argument(
        "--token-file",
        help="file holding the shared secret token (default: $DILOCO_TOKEN if set); "
        "required to bind a non-loopback address",
    )
    if server:
        p.add_argument(
            "--tls-cert", help="PEM certificate (chain) the syncer presents; enables TLS"
        )
        p.add_argument("--tls-key", help="PEM private key of --tls-cert")
        p.add_argument(
            "--tls-client-ca",
            help="PEM CA bundle: require client certificates signed by it (mutual TLS)",
        )
        p.add_argument(
            "--allow-learners",
            metavar="ID,ID,...",
            help="only these learner ids (and observer ids) may join",
        )
    else:
        p.add_argument("--tls-ca", help="PEM CA bundle to verify the syncer with; enables TLS")
        p.add_argument("--tls-cert", help="PEM client certificate for mutual TLS")
        p.add_argument("--tls-key", help="PEM private key of --tls-cert")


def security_from_args(args: argparse.Namespace) -> dict:
    """``SyncerServer`` keyword arguments (``token``, ``credentials``, ``allowed_learners``)."""
    from diloco.wire import auth

    kwargs: dict = {"token": auth.load_token(args.token_file)}
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise auth.AuthConfigError("TLS needs both --tls-cert and --tls-key")
        kwargs["credentials"] = auth.server_credentials(
            args.tls_cert, args.tls_key, args.tls_client_ca
        )
    elif args.tls_client_ca:
        raise auth.AuthConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.allow_learners:
        kwargs["allowed_learners"] = [
            x.strip() for x in args.allow_learners.split(",") if x.strip()
        ]
    return kwargs


def run(args: argparse.Namespace) -> int:
    import torch

    from diloco.algorithm.fragments import balanced_fragments
    from diloco.algorithm.shards import ShardError, parse_shard
    from diloco.recipes import get_recipe
    from diloco.syncer.server import SyncerServer
    from diloco.syncer.store import StateError

    try:
        shard = parse_shard(args.shard)
    except ShardError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
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
            shard=shard,
            state_dir=args.state_dir,
            tape_path=args.tape
            or (Path(args.state_dir) / "events.jsonl" if args.state_dir else None),
            **security_from_args(args),
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
    owns = f"shard {shard[0]}/{shard[1]}: {len(server.state.served)} of " if shard[1] > 1 else ""
    print(
        f"diloco syncer serving on {server.address} ({owns}{layout.num_fragments} fragments, "
        f"versions from {args.state_dir or 'memory'})",
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
    p.add_argument(
        "--sync-every",
        type=int,
        default=24,
        help="H: with --schedule syncer, each fragment's round opens once per H fleet steps",
    )
    p.add_argument(
        "--shard",
        default="0/1",
        metavar="I/S",
        help="serve only shard I of S: the fragments p with p mod S == I (default 0/1: all); "
        "start S syncers with 0/S .. S-1/S and give learners every address (docs/deploy.md)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop (cleanly) if the parent process dies"
    )
    add_syncer_arguments(p)
    add_security_arguments(p, server=True)
    p.set_defaults(func=run)

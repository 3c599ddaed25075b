"""``python -m diloco.cli.torchft_replica lighthouse|replica ...``: the processes of the torchft
peer (``diloco.baselines.torchft.replica`` says what each does)."""

from __future__ import annotations

import argparse
import os
import sys

from diloco.baselines.torchft.replica import lighthouse_main, replica_main
from diloco.config.common import ProtocolConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m diloco.cli.torchft_replica")
    sub = p.add_subparsers(dest="role", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--port-file", required=True)
    lh.add_argument("--bind", default="[::]:0")
    lh.add_argument("--min-replicas", type=int, required=True)
    lh.add_argument("--join-timeout-ms", type=int, default=60000)
    lh.add_argument("--quorum-tick-ms", type=int, default=100)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    lh.set_defaults(func=lighthouse_main)
    r = sub.add_parser("replica")
    r.add_argument("--index", type=int, required=True)
    r.add_argument("--replicas", type=int, required=True, help="M: replica groups in the run")
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--lighthouse", help="lighthouse address")
    where.add_argument("--lighthouse-file", help="file the lighthouse writes its address to")
    r.add_argument("--workdir", required=True)
    r.add_argument("--recipe", default="tiny")
    r.add_argument("--data")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=None)
    r.add_argument("--slow", type=float, default=1.0)
    r.add_argument("--sync-every", type=int, default=ProtocolConfig.sync_every)
    r.add_argument("--fragments", type=int, default=1)
    r.add_argument("--sync-delay", type=int, default=0)
    r.add_argument("--outer-lr", type=float, default=1.0)
    r.add_argument("--outer-momentum", type=float, default=0.0)
    r.add_argument("--rounds", type=int, default=0, help="stop at this committed step (0: none)")
    r.add_argument("--schedule-steps", type=int, default=0)
    r.add_argument("--schedule-seconds", type=float, default=0.0)
    r.add_argument("--run-started", type=float, default=0.0, help="epoch s (lr schedule clock)")
    r.add_argument("--min-replica-size", type=int, default=1)
    r.add_argument("--timeout-s", type=float, default=60.0)
    r.add_argument("--quorum-timeout-s", type=float, default=120.0)
    r.add_argument("--hard-deadline", type=float, default=0.0)
    r.add_argument("--threads", type=int, default=1)
    r.set_defaults(func=replica_main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code = args.func(args)
    # Everything is written and flushed; skip interpreter teardown, which spends seconds
    # (measured 2-3 s on a loaded machine) tearing down torch, gloo and torchft's Rust runtime.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

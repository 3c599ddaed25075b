"""``python -m diloco.cli.torchft_peer``: train a recipe with torchft's DiLoCo, the external
peer of ``diloco bench`` (``diloco.baselines.torchft.peer``)."""

from __future__ import annotations

import argparse
import json
import sys

from diloco.baselines.torchft.peer import (
    PeerUnavailable,
    format_torchft,
    parse_slow,
    run_torchft,
)
from diloco.config.common import ProtocolConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m diloco.cli.torchft_peer",
        description="Train a recipe with torchft's DiLoCo (the external peer of diloco bench).",
    )
    p.add_argument("--learners", "-m", type=int, default=2)
    p.add_argument("--minutes", type=float, default=1.0, help="wall-clock budget (0: none)")
    p.add_argument("--tokens", type=int, default=0, help="token budget over all replicas")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many committed syncs")
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--data", help="UTF-8 text file instead of Shakespeare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=0)
    p.add_argument(
        "--sync-every",
        type=int,
        default=ProtocolConfig.sync_every,
        help=f"H in inner steps (default {ProtocolConfig.sync_every})",
    )
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments (default 1)")
    p.add_argument("--sync-delay", type=int, default=0, help="τ: steps the all-reduce overlaps")
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--slow", action="append", default=[], metavar="I=F")
    p.add_argument("--run-dir", help="keep logs, progress and final models here")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = run_torchft(
            learners=args.learners,
            recipe=args.recipe,
            data=args.data,
            seed=args.seed,
            minutes=args.minutes,
            tokens=args.tokens,
            rounds=args.rounds,
            sync_every=args.sync_every,
            fragments=args.fragments,
            sync_delay=args.sync_delay,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            slow=parse_slow(args.slow),
            batch_size=args.batch_size,
            run_dir=args.run_dir,
        )
    except (PeerUnavailable, ValueError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_torchft(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

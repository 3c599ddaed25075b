"""``python -m diloco.cli.torchft_peer``: train a recipe with torchft's DiLoCo, the external
peer of ``diloco bench`` (``diloco.baselines.torchft.peer``)."""

from __future__ import annotations

import argparse
import json
import sys

from diloco.baselines.torchft.peer import (
    PeerSettings,
    PeerUnavailable,
    format_torchft,
    parse_slow,
    run_torchft,
)
from diloco.wan.fabric import WanUnavailable


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m diloco.cli.torchft_peer",
        description="Train a recipe with torchft's DiLoCo (the external peer of diloco bench).",
    )
    d = PeerSettings  # every default is PeerSettings'
    p.add_argument("--learners", "-m", type=int, default=d.learners)
    p.add_argument("--minutes", type=float, default=d.minutes, help="wall-clock budget (0: none)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="token budget over all replicas")
    p.add_argument("--rounds", type=int, default=d.rounds, help="stop after this many syncs")
    p.add_argument("--recipe", default=d.recipe)
    p.add_argument("--data", default=d.data, help="UTF-8 text file instead of Shakespeare")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--sync-every", type=int, default=d.sync_every, help="H in inner steps")
    p.add_argument("--fragments", type=int, default=d.fragments, help="streaming fragments")
    p.add_argument("--sync-delay", type=int, default=d.sync_delay, help="τ: steps it overlaps")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr)
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    p.add_argument("--slow", action="append", default=[], metavar="I=F")
    p.add_argument("--wan", action="append", default=list(d.wan), metavar="SPEC")
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
            wan=tuple(args.wan),
        )
    except (PeerUnavailable, WanUnavailable, ValueError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_torchft(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

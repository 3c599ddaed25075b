"""``diloco run``: a syncer, M learners and an evaluator on this machine (the embedded default).

Every setting is a field of ``diloco.config.run.RunConfig`` (its sections: the recipe, P and
H, the syncer's ``SyncerConfig`` and the Ray backend) and a flag; ``--config FILE`` reads
them from a JSON file (a run's ``config.json`` repeats that run; change ``--name``) and flags
given beside it override the file.
"""

from __future__ import annotations

import argparse
import sys

from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.run import RunConfig, load_run_config


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a syncer, M learners and an evaluator on this machine (the embedded default)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="read the settings from this JSON file, e.g. a run's config.json (flags override)",
    )
    add_options(p, RunConfig, sparse=True)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.launch.run import run

    try:
        base = load_run_config(args.config) if args.config else None
        config = from_namespace(RunConfig, args, base=base)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    return run(config)

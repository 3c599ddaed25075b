"""``diloco learner``: one learner process (``diloco.learner.worker``).

Every setting is a field of ``diloco.config.worker.WorkerConfig`` and a flag; ``--config FILE``
reads them from a JSON file (as ``diloco run`` writes one per learner) and flags given beside
it override the file.
"""

from __future__ import annotations

import argparse
import sys

from diloco.cli.common import load_config_file
from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.worker import WorkerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "learner", help="run one learner process", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--config", metavar="FILE", help="read the settings from this JSON file (flags override)"
    )
    add_options(p, WorkerConfig, sparse=True)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.learner.worker import run

    try:
        base = load_config_file(args.config, WorkerConfig) if args.config else None
        config = from_namespace(WorkerConfig, args, base=base)
    except ConfigError as exc:
        print(f"diloco learner: {exc}", file=sys.stderr)
        return 2
    return run(config)

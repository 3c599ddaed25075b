"""``diloco run``: a syncer, M learners and an evaluator on this machine (the embedded default).

Every setting is a field of ``diloco.config.run.RunConfig`` (its sections: the recipe, P and
H, the syncer's ``SyncerConfig`` and the Ray backend) and a flag.
"""

from __future__ import annotations

import argparse
import sys

from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.run import RunConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a syncer, M learners and an evaluator on this machine (the embedded default)",
        description=__doc__.split("\n\n")[0],
    )
    add_options(p, RunConfig)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.launch.run import run

    try:
        config = from_namespace(RunConfig, args)
    except ConfigError as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    return run(config)

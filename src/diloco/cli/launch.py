"""``diloco launch``: a syncer for your model and N copies of your own training script.

    diloco launch --learners 4 --model model:build train.py --steps 300

Every option is a field of ``diloco.config.launch.LaunchConfig`` (its ``syncer`` section is
``SyncerConfig``: P, H, the codecs); the script and its own arguments come last. Each copy
joins with ``diloco.Learner.from_env(model, optimizer)`` (docs/own-model.md).
"""

from __future__ import annotations

import argparse
import sys

from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.launch import LaunchConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start a syncer for your model and N copies of your training script",
        description=__doc__.split("\n\n")[0],
    )
    add_options(p, LaunchConfig, sparse=True)
    p.add_argument("script", metavar="SCRIPT", help="your training script (run with python)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        config = from_namespace(LaunchConfig, args, script=args.script, args=list(args.args))
    except (ConfigError, ValueError) as exc:
        print(f"diloco launch: {exc}", file=sys.stderr)
        return 2
    from diloco.launch.script import launch

    return launch(config)

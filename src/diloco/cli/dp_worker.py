"""``diloco dp-worker``: one rank of the data-parallel baseline (``diloco run --mode dp``
starts them). Every setting is a field of ``diloco.config.dp_worker.DpWorkerConfig`` and a
flag; ``--config FILE`` reads them from a JSON file and flags given beside it override it
(the supervisor passes ``--generation`` that way when it restarts the group)."""

from __future__ import annotations

import argparse
import sys

from diloco.cli.common import load_config_file
from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.dp_worker import DpWorkerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "dp-worker", help="one rank of the data-parallel baseline (started by diloco run)"
    )
    p.add_argument(
        "--config", metavar="FILE", help="read the settings from this JSON file (flags override)"
    )
    add_options(p, DpWorkerConfig, sparse=True)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.baselines.dp.worker import run

    try:
        base = load_config_file(args.config, DpWorkerConfig) if args.config else None
        config = from_namespace(DpWorkerConfig, args, base=base)
    except ConfigError as exc:
        print(f"diloco dp-worker: {exc}", file=sys.stderr)
        return 2
    return run(config)

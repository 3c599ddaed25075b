"""``diloco dp-worker``: one rank of the data-parallel baseline (``diloco run --mode dp``
starts them; every setting is a field of ``diloco.config.dp_worker.DpWorkerConfig``)."""

from __future__ import annotations

import argparse
import sys

from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.dp_worker import DpWorkerConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "dp-worker", help="one rank of the data-parallel baseline (started by diloco run)"
    )
    add_options(p, DpWorkerConfig)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.baselines.dp.worker import run

    try:
        config = from_namespace(DpWorkerConfig, args)
    except ConfigError as exc:
        print(f"diloco dp-worker: {exc}", file=sys.stderr)
        return 2
    return run(config)

"""``diloco syncer``: run the syncer service standalone (``diloco run`` starts it too).

Every setting is a field of ``diloco.config.service.ServiceConfig`` (its ``syncer`` section is
``diloco.syncer.config.SyncerConfig``) and a flag; ``--config FILE`` reads them from a JSON
file (as ``diloco run`` writes one) and flags given beside it override the file.
"""

from __future__ import annotations

import argparse
import sys

from diloco.cli.common import load_config_file
from diloco.config import ConfigError, add_options, from_namespace
from diloco.config.service import ServiceConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "syncer", help="run the syncer service", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--config", metavar="FILE", help="read the settings from this JSON file (flags override)"
    )
    add_options(p, ServiceConfig, sparse=True)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.syncer.process import serve
    from diloco.wire.auth import AuthConfigError

    try:
        base = load_config_file(args.config, ServiceConfig) if args.config else None
        config = from_namespace(ServiceConfig, args, base=base)
    except ConfigError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(config)
    except AuthConfigError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2

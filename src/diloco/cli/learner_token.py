"""``diloco learner-token``: print a learner's own token, derived from the syncer's secret."""

from __future__ import annotations

import argparse
import sys

from diloco.config import add_options
from diloco.config.common import ClientSecurityConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "learner-token",
        help="print a learner's own token (for a syncer started with --learner-tokens)",
        description=(
            "Print the token of learner ID, derived from the syncer's shared secret "
            "(docs/security.md, 'Learner tokens'). Give it to that learner only "
            "(--token-file); the syncer needs no list of them."
        ),
    )
    p.add_argument("learner_id", metavar="ID", help="the learner's id (its --id)")
    add_options(p, ClientSecurityConfig, only=("token_file",))  # the syncer's shared secret
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.syncer.records import Refused, check_id  # at run time: they import torch
    from diloco.wire.auth import AuthConfigError, learner_token, load_token

    try:
        check_id(args.learner_id)
        secret = load_token(args.token_file)
    except (Refused, AuthConfigError) as exc:
        print(f"diloco learner-token: error: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print(
            "diloco learner-token: error: no secret: pass --token-file or set $DILOCO_TOKEN",
            file=sys.stderr,
        )
        return 2
    print(learner_token(secret, args.learner_id))
    return 0

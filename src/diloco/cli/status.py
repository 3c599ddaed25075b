"""``diloco status ADDRESS``: what a running syncer says of itself (its ``Status`` RPC).

The fields are documented in docs/own-model.md ("The syncer's status"); ``--json`` prints
them as one JSON object (the .proto's field names), the default a few readable lines;
``--watch SECONDS`` prints them again every SECONDS until Ctrl-C. The exit status is 0 while
the syncer serves, 1 if it does not answer, refuses the call (a missing or wrong token) or
has failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from diloco.config import add_options
from diloco.config.common import ClientSecurityConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "status",
        help="what a running syncer says: versions, rounds, learners, health",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("address", metavar="HOST:PORT", help="the syncer (or every shard, a,b)")
    add_options(p, ClientSecurityConfig, only=("token_file",))
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="print the status again every SECONDS until Ctrl-C",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.launch.syncers import StatusClient
    from diloco.wire.auth import AuthConfigError, load_token

    if args.watch is not None and not args.watch > 0:
        print(f"diloco status: --watch must be > 0 seconds (got {args.watch:g})", file=sys.stderr)
        return 2
    try:
        client = StatusClient(args.address, load_token(args.token_file))
    except (AuthConfigError, ValueError, OSError) as exc:
        print(f"diloco status: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C ends a --watch with the last status's exit code. It only sets a flag: raised
    # inside a gRPC call (most of a watch's time on a slow link) the interrupt could leave
    # the call's threads hanging and the process up; a call ends within its deadline.
    ctrl_c = threading.Event()
    if args.watch is not None:
        signal.signal(signal.SIGINT, lambda signum, frame: ctrl_c.set())
    try:
        code = show(client, args)
        while args.watch is not None and not ctrl_c.wait(args.watch):
            code = show(client, args)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return code


def show(client, args: argparse.Namespace) -> int:
    """Fetch and print the status once; its exit code."""
    from google.protobuf.json_format import MessageToDict

    reply = client.fetch()
    if reply is None:
        if client.refusal is not None:
            print(
                f"diloco status: {client.refusal} (give the syncer's token: --token-file or "
                "$DILOCO_TOKEN)",
                file=sys.stderr,
            )
        else:
            print(f"diloco status: {args.address} does not answer", file=sys.stderr)
        return 1
    if args.json:
        doc = MessageToDict(
            reply,
            always_print_fields_with_no_presence=True,
            preserving_proto_field_name=True,
            unquote_int64_if_possible=True,
        )
        print(json.dumps(doc, indent=1), flush=True)
        return 0
    health = f"FAILED: {reply.failure}" if reply.failure else "serving"
    print(
        f"syncer {reply.syncer_id} {health}, up {reply.uptime_s:.0f} s: {reply.rounds} rounds, "
        f"versions {list(reply.versions)}, {reply.waiting} contributions waiting for their "
        f"commit, {reply.refused} refused uploads"
    )
    for ls in reply.learners:
        live = "live" if ls.live else "gone"
        print(
            f"  {ls.learner_id}: {live} ({ls.state}), step {ls.step}, {ls.tokens:,} tokens, "
            f"{ls.contributions} contributions"
        )
    sys.stdout.flush()
    return 1 if reply.failure else 0

"""``python -m diloco.cli.torchft_replica lighthouse|replica ...``: the processes of the torchft
peer (``diloco.baselines.torchft.replica`` says what each does; their settings are
``diloco.config.torchft``'s dataclasses, and the peer hands a replica its settings as a file:
``replica --config FILE``)."""

from __future__ import annotations

import argparse
import sys

from diloco.cli.common import configured_command
from diloco.config.torchft import LighthouseConfig, ReplicaConfig
from diloco.runtime.exit import exit_now


def _lighthouse():
    from diloco.baselines.torchft.replica import lighthouse_main

    return lighthouse_main


def _replica():
    from diloco.baselines.torchft.replica import replica_main

    return replica_main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m diloco.cli.torchft_replica")
    sub = p.add_subparsers(dest="role", required=True)
    configured_command(sub, "lighthouse", LighthouseConfig, _lighthouse, help="torchft lighthouse")
    configured_command(sub, "replica", ReplicaConfig, _replica, help="one torchft replica group")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code = args.func(args)
    # Everything is written; skip interpreter teardown, which spends seconds (measured 2-3 s
    # on a loaded machine) tearing down torch, gloo and torchft's Rust runtime.
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())

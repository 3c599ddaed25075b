"""``python -m diloco.cli.wan_bridge A B --delay-ms D``: the delay line of one wide-area link
(``diloco.wan.bridge``), started by the harness inside the syncer's namespace."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diloco.cli.wan_bridge")
    p.add_argument("a", help="one interface")
    p.add_argument("b", help="the other")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    args = p.parse_args(argv)
    from diloco.wan.bridge import run_bridge

    return run_bridge(args.a, args.b, args.delay_ms / 1e3)


if __name__ == "__main__":
    sys.exit(main())

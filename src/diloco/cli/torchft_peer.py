"""``python -m diloco.cli.torchft_peer``: train a recipe with torchft's DiLoCo, the external
peer of ``diloco bench`` (``diloco.baselines.torchft.peer``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from diloco.baselines.torchft.peer import PeerUnavailable, format_torchft, run_torchft
from diloco.config.torchft import PeerSettings
from diloco.runtime.schema import add_options, from_namespace
from diloco.wan.fabric import WanUnavailable


def parser() -> argparse.ArgumentParser:
    """Every ``PeerSettings`` option as a flag, and ``--json``."""
    p = argparse.ArgumentParser(
        prog="python -m diloco.cli.torchft_peer",
        description="Train a recipe with torchft's DiLoCo (the external peer of diloco bench).",
    )
    add_options(p, PeerSettings)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = from_namespace(PeerSettings, args)
        summary = run_torchft(
            **{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
        )
    except (PeerUnavailable, WanUnavailable, ValueError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"torchft peer: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_torchft(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

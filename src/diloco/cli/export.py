"""``diloco export``: a run's global model as an ordinary ``state_dict`` (safetensors)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a run's global model as the model's own state_dict (safetensors)",
        description=(
            "Write the global model of a run directory (diloco run) as the recipe model's "
            "state_dict, which model.load_state_dict(..., strict=True) accepts."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/demo")
    p.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="where to write (.safetensors)"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from diloco.launch.export import export_run
    from diloco.syncer.export import ExportError

    try:
        done = export_run(args.run_dir, args.output)
    except (ExportError, OSError) as exc:
        print(f"diloco export: error: {exc}", file=sys.stderr)
        return 2
    where = f"versions {done['versions']}" if "versions" in done else f"step {done['step']}"
    print(f"wrote {args.output}: {done['keys']} tensors ({done['mode']}, {where})")
    return 0

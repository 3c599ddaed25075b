"""``diloco export``: a run's global model as an ordinary ``state_dict`` (safetensors, a
``torch.save`` file, shards with an index, or a transformers ``save_pretrained`` directory)."""

from __future__ import annotations

import argparse
import sys

from diloco.config import add_options, from_namespace
from diloco.config.export import ExportConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a run's (or a syncer's) global model as the model's own state_dict",
        description=(
            "Write the global model of a run directory (diloco run), or of a syncer's state "
            "directory with --model (diloco syncer --model, or SyncerServer(state_dir=...)), "
            "as the model's state_dict, which model.load_state_dict(..., strict=True) accepts "
            "(or, --format hf, as the transformers model's save_pretrained directory)."
        ),
    )
    p.add_argument(
        "run_dir",
        metavar="DIR",
        help="a run directory (runs/demo) or a syncer's state directory (with --model)",
    )
    p.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help="the model the syncer served, built as its learners build it (a state directory)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="where to write: a file (.safetensors, .pt), or a directory (--format hf, "
        "--max-shard-size)",
    )
    add_options(p, ExportConfig)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from diloco.launch.export import export_run, export_state_dir
    from diloco.runtime.model_ref import ModelRefError, load_model
    from diloco.syncer.export import ExportError

    path = Path(args.run_dir)
    try:
        options = from_namespace(ExportConfig, args)
        options.resolve(args.output)  # (a name that says another format: before any work)
    except ValueError as exc:
        print(f"diloco export: error: {exc}", file=sys.stderr)
        return 2
    try:
        if (path / "config.json").is_file():
            if args.model:
                raise ExportError(f"{path} is a run directory: its recipe builds the model")
            done = export_run(path, args.output, options)
        elif (path / "meta.json").is_file():
            if not args.model:
                raise ExportError(f"{path} is a syncer's state directory: give --model")
            done = export_state_dir(path, load_model(args.model), args.output, options)
        elif args.model:
            raise ExportError(
                f"{path} is neither a run directory (config.json) nor a syncer's state "
                "directory (meta.json)"
            )
        else:
            done = export_run(path, args.output, options)  # (says why it is not a run)
    except (ExportError, ModelRefError, OSError) as exc:
        print(f"diloco export: error: {exc}", file=sys.stderr)
        return 2
    where = f"versions {done['versions']}" if "versions" in done else f"step {done['step']}"
    print(
        f"wrote {args.output}: {done['keys']} tensors as {done['format']} ({done['mode']}, {where})"
    )
    return 0

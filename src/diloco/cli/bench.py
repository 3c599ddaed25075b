"""``diloco bench``: decoupled, synchronous DiLoCo and data-parallel, side by side.

Runs the matrix of :mod:`diloco.bench.matrix` one ``diloco run`` at a time (runs share the
machine, so never in parallel), then writes to ``--out``:

    runs/<name>/     every run directory, as ``diloco run`` leaves it
    results.json     one entry per run (spec, numbers, loss curve)
    table.md         medians over seeds per (mode, condition), the targets, the sweep
    *.png            loss vs tokens and vs wall time, goodput, bytes/token, tokens/s, sweep

A run whose ``summary.json`` already exists is not run again, so an interrupted or extended
benchmark picks up where it stopped (``--seeds 0,1,2`` after ``--seeds 0`` adds two seeds).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from diloco.bench import matrix as mx
from diloco.runtime.schema import add_options, from_namespace


def parse_list(text: str, cast=str) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def run_one(spec: mx.RunSpec, runs_dir: Path, budget: mx.Budget, log) -> dict | None:
    """Run ``spec`` unless its summary exists; returns the summary (None if the run failed)."""
    run_dir = runs_dir / spec.name
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    if run_dir.exists():  # a run cut short earlier: start it afresh
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.time()
    if spec.peer:
        from diloco.baselines.torchft.bench_peer import run_peer

        try:
            summary = run_peer(spec, run_dir, budget)
        except Exception as exc:  # a peer that fails is a failed cell, not a failed bench
            log(f"  {spec.name}: failed: {exc}")
            return None
    else:
        argv = [
            sys.executable,
            "-m",
            "diloco.cli",
            "run",
            *spec.flags,
            f"--runs-dir={runs_dir}",
            f"--name={spec.name}",
            "--json",
            "--no-view",
        ]
        cap = budget.minutes * 600 + 600
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=cap)
        if not summary_path.exists():
            log(f"  {spec.name}: failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            return None
        summary = json.loads(summary_path.read_text())
    log(
        f"  {spec.name}: {time.time() - t0:.0f}s, loss {summary['val_loss']['final']:.3f}, "
        f"{summary['tokens']:,} tokens"
    )
    return summary


def read_curve(run_dir: Path) -> list[dict]:
    from diloco.runtime.jsonl import read_jsonl

    return [
        {k: rec.get(k) for k in ("t", "tokens", "val_loss")}
        for rec in read_jsonl(run_dir / "metrics.jsonl")
    ]


def run(args: argparse.Namespace) -> int:
    from diloco.report import bench as rp

    try:
        budget = from_namespace(mx.Budget, args)
        seeds = parse_list(args.seeds, int)
        specs = mx.matrix(
            parse_list(args.modes),
            parse_list(args.conditions),
            seeds,
            budget,
            parse_list(args.peer),
        )
        only = [mx.parse_setting(t) for t in parse_list(args.sweep_only)] or None
        sweep_seeds = parse_list(args.sweep_seeds, int) or seeds[:1]
        wanted = args.sweep or only is not None
        sweep = [r for s in sweep_seeds for r in mx.sweep(budget, s, only=only)] if wanted else []
    except ValueError as exc:
        print(f"diloco bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    results, failed = [], []
    todo = specs + sweep
    log(f"diloco bench: {len(todo)} runs into {out}")
    for i, spec in enumerate(todo, 1):
        log(f"[{i}/{len(todo)}] {spec.name}")
        summary = run_one(spec, runs_dir, budget, log)
        if summary is None:
            failed.append(spec.name)
            continue
        meta = {"name": spec.name, "mode": spec.mode, "condition": spec.condition}
        meta |= {"seed": spec.seed, **spec.sweep}
        results.append(rp.result_of(meta, summary, read_curve(runs_dir / spec.name)))
    command = shlex.join(["diloco", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else None
    text, figures = rp.write_report(out, budget, results, failed, command)
    print(text)
    log(f"figures: {', '.join(str(f) for f in figures if f)}")
    return 1 if failed else 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="decoupled vs synchronous DiLoCo vs data-parallel: one harness, one table",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--out", default="bench", help="output directory")
    p.add_argument("--modes", default=",".join(mx.MODES), help="comma list of decoupled,sync,dp")
    p.add_argument("--conditions", default=",".join(mx.CONDITIONS), help="clean,chaos,slow")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    p.add_argument("--peer", default="", help="also run an external peer: torchft")
    p.add_argument("--sweep", action="store_true", help="add the H x upload-codec sweep")
    p.add_argument(
        "--sweep-seeds", default="", help="seeds of the sweep (default: the first of --seeds)"
    )
    p.add_argument(
        "--sweep-only",
        default="",
        metavar="SETTINGS",
        help="sweep just these settings, comma list of mode:H:up:down (e.g. sync:96:int4:int4)",
    )
    add_options(p, mx.Budget)
    p.set_defaults(func=run)

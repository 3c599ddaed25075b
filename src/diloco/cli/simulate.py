"""``diloco simulate``: goodput under chip failures, the paper's grid, and the digital twin.

    diloco simulate --table [--json] [--plot goodput.png]    # dp, dp-elastic, decoupled M=2..16
    diloco simulate --chips 1.2M --mode decoupled --learners 8 --quorum 2
    diloco simulate --twin runs/<run>                         # predicted vs measured goodput

Every knob has the fitted or documented default (docs/simulate.md). Invalid input exits 2
with a message that says what to change.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from diloco.runtime.schema import add_options, flat_values, from_namespace
from diloco.sim.config import SimConfig
from diloco.sim.defaults import DEFAULT_SEEDS, GRID_LEARNERS, MODES, PAPER_CHIPS


def parse_chips(text: str) -> int:
    """``150000``, ``150k``, ``1.2M`` → a chip count (≥ 1)."""
    t = text.strip().lower()
    scale = 1.0
    if t.endswith("k"):
        scale, t = 1e3, t[:-1]
    elif t.endswith("m"):
        scale, t = 1e6, t[:-1]
    try:
        value = int(round(float(t) * scale))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a chip count (e.g. 150k, 1.2M)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least one chip")
    return value


def register(subparsers) -> None:
    """Add ``simulate`` (imports no numpy: every ``diloco`` process builds this parser)."""
    p = subparsers.add_parser(
        "simulate",
        help="goodput under chip failures (dp, dp-elastic, decoupled); the paper's grid; digital twin",
        description=__doc__.splitlines()[0],
    )
    what = p.add_argument_group("what to simulate")
    what.add_argument("--table", action="store_true", help="the full grid at 150k..2.4M chips")
    what.add_argument(
        "--chips",
        type=parse_chips,
        nargs="+",
        default=None,
        help="chip counts (default: the paper's five)",
    )
    what.add_argument(
        "--mode", choices=(*MODES, "all"), default="all", help="which training mode to simulate"
    )
    what.add_argument(
        "--learners",
        type=int,
        nargs="+",
        default=list(GRID_LEARNERS),
        help="M for decoupled (default 2 4 8 16)",
    )
    what.add_argument(
        "--twin", metavar="RUN_DIR", help="predict a real `diloco run --chaos` run's goodput"
    )
    what.add_argument(
        "--calibrate-from",
        metavar="RUN_DIR",
        help="twin: measure machine constants from this (other) run",
    )
    model = p.add_argument_group(
        "failure model (defaults: fitted on the paper's dp rows, docs/simulate.md)"
    )
    # the defaults of SimConfig's own instance: its recovery is the fitted one
    fitted = flat_values(SimConfig())
    add_options(model, SimConfig, exclude=("horizon_s",), defaults=fitted)
    run = p.add_argument_group("run")
    add_options(run, SimConfig, only=("horizon_s",))
    run.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds for the confidence intervals (default 8; --twin: 200 chaos seeds)",
    )
    run.add_argument("--seed", type=int, default=0, help="first seed")
    run.add_argument("--json", action="store_true", help="print the results as JSON")
    run.add_argument("--plot", metavar="PNG", help="write goodput against chip count per mode")
    p.set_defaults(func=main)


def _error(msg: str) -> int:
    print(f"diloco simulate: error: {msg}", file=sys.stderr)
    return 2


def config_from_args(args: argparse.Namespace):
    """The :class:`~diloco.sim.config.SimConfig` the flags describe (``ValueError`` if
    invalid)."""
    return from_namespace(SimConfig, args)


def main(args: argparse.Namespace) -> int:
    from diloco.sim.grid import Row, format_table, grid_rows, simulate, summarize

    if args.twin:
        return _twin(args)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        return _error(str(exc))
    if args.seeds is None:
        args.seeds = DEFAULT_SEEDS
    if args.seeds < 2:
        return _error("--seeds must be >= 2 (the confidence interval needs two)")
    if any(m < 1 for m in args.learners):
        return _error("--learners must be >= 1")
    if args.quorum > min(args.learners) and args.mode in ("decoupled", "all"):
        return _error(
            f"--quorum {args.quorum} exceeds the smallest --learners {min(args.learners)}"
        )
    chips = tuple(args.chips) if args.chips else PAPER_CHIPS
    if args.table or args.mode == "all":
        rows = grid_rows(tuple(args.learners))
    elif args.mode == "decoupled":
        rows = [Row("decoupled", m) for m in args.learners]
    else:
        rows = [Row(args.mode, 1)]
    t0 = time.perf_counter()
    try:
        results = simulate(chips, rows, cfg, args.seeds, args.seed)
    except ValueError as exc:
        return _error(str(exc))
    seconds = time.perf_counter() - t0
    cells = summarize(results)
    if args.plot:
        from diloco.sim.plot import plot_goodput

        plot_goodput(cells, args.plot)
    if args.json:
        out = {
            "config": cfg.as_dict(),
            "seeds": args.seeds,
            "seconds": round(seconds, 2),
            "cells": cells,
        }
        print(json.dumps(out, indent=1))
    else:
        print(format_table(cells, chips))
        print()
        print(format_table(cells, chips, metric="uptime"))
        print(f"{args.seeds} seeds x {cfg.horizon_s / 86400:g} days per cell, {seconds:.1f} s")
    return 0


def _twin(args: argparse.Namespace) -> int:
    from diloco.sim.twin import REFERENCE_CONSTANTS, measure_constants, twin_report

    try:
        constants = (
            measure_constants(args.calibrate_from) if args.calibrate_from else REFERENCE_CONSTANTS
        )
        report = twin_report(args.twin, constants, seeds=args.seeds or 200)
    except (OSError, ValueError, KeyError) as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    other = report["predicted_goodput_other_seeds"]
    print(
        f"run {report['run_dir']}: {report['learners']} learners, {report['minutes']} min, chaos {report['spec']!r}, seed {report['seed']}"
    )
    c = report["constants"]
    print(
        f"  machine constants (from {c['source']}): start-up {c['startup_s']} s, restart {c['restart_s']} s, {c['steps_per_s']} steps/s"
    )
    print(f"  predicted goodput {100 * report['predicted_goodput']:.1f}% (this seed's failures)")
    print(
        f"  same spec, {other['seeds']} other seeds: {100 * other['mean']:.1f}% ± {100 * other['ci95']:.1f} (sd {100 * other['sd']:.1f})"
    )
    if report["measured_goodput"] is not None:
        print(
            f"  measured goodput  {100 * report['measured_goodput']:.1f}%  (error {report['error_points']:+.1f} points)"
        )
    return 0

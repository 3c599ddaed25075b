"""Outer-optimizer sweep: held-out loss after a fixed number of steps per (outer lr, momentum).

Run: ``.venv/bin/python benchmarks/bench_outer.py [--steps 500] [--learners 2] [--mode sync]``

Each configuration is one ``diloco run`` of the default recipe where every learner does
``--steps`` steps (same data, same seed, same tokens), so the final held-out loss of the global
model compares the outer optimizers at equal tokens. Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

GRID = [(1.0, 0.0), (1.0, 0.5), (0.7, 0.9), (0.7, 0.0), (1.3, 0.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--mode", default="decoupled", choices=["decoupled", "sync"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--outer-scale", default="share", choices=["share", "none"], help="see diloco run"
    )
    parser.add_argument(
        "--grid",
        help="LR:MOMENTUM pairs separated by commas (default: "
        + ",".join(f"{a}:{b}" for a, b in GRID)
        + ")",
    )
    args = parser.parse_args()
    grid = GRID
    if args.grid:
        grid = [tuple(float(x) for x in pair.split(":")) for pair in args.grid.split(",")]
    with tempfile.TemporaryDirectory() as runs:
        for lr, mu in grid:
            argv = [
                sys.executable,
                "-m",
                "diloco.cli",
                "run",
                f"--steps={args.steps}",
                f"--learners={args.learners}",
                f"--mode={args.mode}",
                f"--seed={args.seed}",
                f"--outer-scale={args.outer_scale}",
                "--minutes=0",
                "--eval-every=0",
                f"--outer-lr={lr}",
                f"--outer-momentum={mu}",
                f"--runs-dir={runs}",
                f"--name=lr{lr}-mu{mu}",
                "--json",
            ]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            s = json.loads(proc.stdout)
            row = {
                "mode": args.mode,
                "learners": args.learners,
                "outer_scale": args.outer_scale,
                "outer_lr": lr,
                "momentum": mu,
                "tokens": s["tokens"],
                "val_loss_final": round(s["val_loss"]["final"], 4),
                "wall_s": round(s.get("wall_s", 0.0), 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Scavenging: does adding learners mid-run shorten the time to a held-out loss?

    python benchmarks/bench_scavenging.py [--minutes 4] [--seeds 0] [--slow 3] [--target 2.2] [--dp]

Per seed, two decoupled runs of the default recipe, one after the other:

- ``static``: 2 learners for ``--minutes``;
- ``added``: 2 learners, and 2 more from the middle of the run (``--add-learners``);

and with ``--dp`` the same two for data-parallel (``dp-static``, ``dp-added``: the group stops
at the midpoint and starts again with 4 ranks, as a static group must).

Every learner is slowed ``--slow`` times (``--slow I=F``: each step sleeps for the rest), so
that four single-threaded learners fit this 2-core machine's CPUs as four machines would:
without it the added learners would only take cores from the first two. Reported per run:
the wall time at which the global model's held-out loss first reached ``--target``, the final
held-out loss, tokens and goodput (from each run's ``summary.json`` and ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def time_to(metrics: list[dict], target: float) -> float | None:
    """Seconds until the held-out loss first reached ``target`` (None: never)."""
    return next((m["t"] for m in metrics if m.get("val_loss") is not None and m["val_loss"] <= target), None)  # fmt: skip


def run(out: Path, name: str, args, extra: list[str], learners: int) -> dict:
    run_dir = out / name
    if not (run_dir / "summary.json").exists():
        slow = [f"--slow={i}={args.slow}" for i in range(learners)]
        subprocess.run(
            [sys.executable, "-m", "diloco.cli", "run", "--learners=2", f"--minutes={args.minutes}",
             f"--seed={args.seed}", "--eval-every=5", "--no-view", "--dashboard=off",
             f"--runs-dir={out}", f"--name={name}", *slow, *extra],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "run": name,
        "time_to_target_s": time_to(metrics, args.target),
        "final_loss": summary["val_loss"]["final"],
        "tokens": summary["tokens"],
        "goodput": summary.get("goodput"),
        "learners": summary["learners"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/scavenging")
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--seeds", default="0")
    p.add_argument("--slow", type=float, default=3.0)
    p.add_argument("--target", type=float, default=2.2, help="held-out loss to reach")
    p.add_argument("--dp", action="store_true", help="also data-parallel, grown by restarting")
    args = p.parse_args()
    out = Path(args.out)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed = seed
        half = f"{args.minutes * 30:.0f}s"
        modes = [("", [])] + ([("dp-", ["--mode=dp"])] if args.dp else [])
        for prefix, mode in modes:
            rows.append({"seed": seed, **run(out, f"{prefix}static-s{seed}", args, mode, 2)})
            grown = [*mode, f"--add-learners={half}:2"]
            rows.append({"seed": seed, **run(out, f"{prefix}added-s{seed}", args, grown, 4)})
            for row in rows[-2:]:
                print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

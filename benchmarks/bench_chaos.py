"""Chaos soak: the default recipe under failures against the same run without them.

Run: ``.venv/bin/python benchmarks/bench_chaos.py [--minutes 10] [--learners 2]``

Two ``diloco run`` runs of ``--minutes`` each on the default recipe: one with
``kill:mtbf=60s,down=5-15s;syncer-kill:at=<half>,down=2s`` (every learner SIGKILLed with a
60 s mean time between failures and restarted after 5-15 s; the syncer SIGKILLed once, half
way) and one without. Prints goodput, uptime, the longest gap between commits, reintegration
times and the final held-out loss of both, as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile


def diloco_run(minutes: float, learners: int, runs: str, name: str, *extra: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "diloco.cli",
        "run",
        f"--minutes={minutes}",
        f"--learners={learners}",
        f"--runs-dir={runs}",
        f"--name={name}",
        "--eval-every=30",
        "--json",
        *extra,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=minutes * 60 + 600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def digest(s: dict) -> dict:
    times = [r["reintegration_s"] for r in s["reintegrations"] if r["reintegration_s"] is not None]
    kills = [f for f in s["failures_injected"] if f["kind"] == "kill"]
    learner_seconds = s["learners"] * s["wall_s"]
    return {
        "tokens": s["tokens"],
        # The ceiling on goodput that failures alone set: learner time spent down (the
        # schedule's down times), and down plus rejoining until the first commit again.
        "down_fraction": sum(f["down_s"] for f in kills) / learner_seconds,
        "down_and_rejoin_fraction": (sum(f["down_s"] for f in kills) + sum(times))
        / learner_seconds,
        "val_loss_final": s["val_loss"]["final"],
        "goodput": s["goodput"],
        "uptime": s["uptime"],
        "max_commit_gap_s": s["max_commit_gap_s"],
        "failures_injected": len(s["failures_injected"]),
        "learner_restarts": sum(ln["restarts"] for ln in s["per_learner"].values()),
        "syncer_restarts": s["syncer_restarts"],
        "reintegration_s_median": statistics.median(times) if times else None,
        "reintegration_s_max": max(times) if times else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="write the two run directories here (default: a temp dir)")
    args = parser.parse_args()
    half = args.minutes * 30
    spec = f"kill:mtbf=60s,down=5-15s;syncer-kill:at={half}s,down=2s"
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.keep or tmp
        chaos = diloco_run(
            args.minutes, args.learners, runs, "chaos", f"--chaos={spec}", f"--seed={args.seed}"
        )
        clean = diloco_run(args.minutes, args.learners, runs, "clean", f"--seed={args.seed}")
    print(json.dumps({"spec": spec, "chaos": digest(chaos), "clean": digest(clean)}, indent=1))


if __name__ == "__main__":
    main()

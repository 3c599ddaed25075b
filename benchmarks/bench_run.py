"""The main job's benchmarks: sync overhead, a slow learner's effect, bytes per token.

Run: ``.venv/bin/python benchmarks/bench_run.py [--steps 300] [--repeats 3]``.

(a) overhead: steps/s of one learner training the ``shakespeare`` recipe with the syncer
    attached (``diloco run --learners 1``: syncer, evaluator and learner on this machine) against
    the same learner with syncing disabled (``diloco learner --no-sync``).
(b) slow learner: steps/s of learner 0 in ``diloco run --learners 1`` against learner 0 in
    ``diloco run --learners 2 --slow 1=3`` (a second learner that takes 3x as long per step).
    One fast learner keeps the comparison about the protocol, not about CPU contention: on
    2 cores, one learner + one slowed learner + the syncer still fit.
(c) bytes: bytes on the wire per token (up + down, counted by the syncer per learner) against
    data-parallel fp32 ring all-reduce for the same workers (formula in
    ``diloco.report.summary.data_parallel_bytes_per_token``), from the runs of (b).

The runs of (a) and (b) evaluate the global model only at the start and the end
(``--eval-every 0``): the periodic evaluator of ``diloco run`` shares the machine's second core
with the syncer and is not part of what a learner pays for syncing (on 2 cores it costs
the learner about 10% at the default of one evaluation every 5 s).

Each configuration runs ``--repeats`` times; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def diloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco.cli", *args]


def run_json(argv: list[str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def alone(steps: int, workdir: Path) -> float:
    subprocess.run(
        diloco(
            "learner",
            "--no-sync",
            "--id=alone",
            f"--total-steps={steps}",
            f"--workdir={workdir}",
        ),
        check=True,
        capture_output=True,
        timeout=900,
    )
    last = (workdir / "progress.jsonl").read_text().splitlines()[-1]
    return json.loads(last)["steps_per_s"]


def diloco_run(steps: int, runs: Path, name: str, *extra: str) -> dict:
    return run_json(
        diloco(
            "run",
            f"--steps={steps}",
            f"--runs-dir={runs}",
            f"--name={name}",
            "--json",
            "--minutes=0",
            "--eval-every=0",
            *extra,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict = {"steps": args.steps, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, synced, one, with_slow, summaries = [], [], [], [], []
        for r in range(args.repeats):
            base.append(alone(args.steps, tmp / f"alone{r}"))
            s = diloco_run(args.steps, tmp, f"one{r}", "--learners=1")
            synced.append(s["per_learner"]["learner-0"]["steps_per_s"])
            one.append(synced[-1])
            s = diloco_run(args.steps, tmp, f"slow{r}", "--learners=2", "--slow=1=3")
            with_slow.append(s["per_learner"]["learner-0"]["steps_per_s"])
            summaries.append(s)
            print(
                f"repeat {r}: alone {base[-1]:.3f}  synced {synced[-1]:.3f}  "
                f"with slow peer {with_slow[-1]:.3f} steps/s",
                file=sys.stderr,
            )
    med = statistics.median
    results["a_overhead"] = {
        "alone_steps_per_s": med(base),
        "synced_steps_per_s": med(synced),
        "ratio": med(synced) / med(base),
        "runs": {"alone": base, "synced": synced},
    }
    results["b_slow_peer"] = {
        "alone_with_syncer_steps_per_s": med(one),
        "with_3x_slow_peer_steps_per_s": med(with_slow),
        "ratio": med(with_slow) / med(one),
        "runs": {"one": one, "with_slow": with_slow},
    }
    bpt = [s["bytes"]["per_token"] for s in summaries]
    dp = [s["bytes"]["data_parallel_per_token"] for s in summaries]
    results["c_bytes"] = {
        "bytes_per_token": med(bpt),
        "data_parallel_bytes_per_token": med(dp),
        "reduction": med(dp) / med(bpt),
        "params": summaries[0]["params"],
        "learners": 2,
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Torture: N seeded schedules of syncer kills, a full disk, learner kills and restarts from
checkpoints, partitions (one longer than the syncer's kept commit logs), a second syncer on the
state directory, a wall-clock step, a restored backup, a zombie learner and lost replies
against real processes, each audited for exactly-once accounting.

Run (as root: the syncer's disk is a tmpfs that fills up):
``.venv/bin/python benchmarks/bench_torture.py --seeds 0-49 --out /tmp/torture``
(``--comms NAME``, ``--up-codec``, ``--down-codec``: the syncer's exchange, for the audit
with other codecs)

Each seed is one ``diloco.launch.torture.Torture`` run (a ``diloco syncer`` process and three
``diloco learner`` processes of the tiny recipe, each behind its own relay; ``--seconds`` of
training with faults, then every fault healed and everyone stopped cleanly) followed by the
audit of ``diloco.report.exactly_once``. Writes ``SEED/result.json`` per seed and
``summary.json``, prints one Markdown table row per seed and the totals, and exits 1 if any
audit found a problem.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from diloco.launch.torture import STALL_BOUND_S, Torture, TortureSpec


def seeds_of(text: str) -> list[int]:
    """``"0-49"`` or ``"1,5,7"``."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


NEW_FAULTS = (
    "learner-resume",
    "long-partition",
    "second-syncer",
    "clock-step",
    "rollback",
    "zombie",
)
"""The faults added to the schedules by issue 46 ("Nothing guessed")."""


def row(seed: int, r: dict) -> str:
    a = r["audit"]
    kinds = [f["kind"] for f in r["faults"]]
    return (
        f"| {seed} | {r['syncer_kills']} | {r['syncer_failures']} | "
        f"{r['learner_kills']} | {r['learner_resumes']} | {kinds.count('partition')} | "
        f"{kinds.count('long-partition')} | {r['second_syncers_refused']} | "
        f"{kinds.count('clock-step')} | {r['rollbacks']} | {r['zombies_fenced']} | "
        f"{r['replies_lost']} | {a['commits']} | {a['uploads_merged']} | "
        f"{a['steps_trained']} | {a['steps_lost_at_kills']} | {a['steps_unknown']} | "
        f"{a['steps_rolled_back']} | {a['longest_stall_s']:.1f} | "
        f"{'exact' if a['ok'] else 'FAILED'} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-49", help="a range LOW-HIGH or a list a,b,c")
    parser.add_argument("--seconds", type=float, default=30.0, help="training time per run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="keep every run's files")
    parser.add_argument("--comms", default="default", help="the syncer's --comms setting")
    parser.add_argument(
        "--up-codec",
        default=TortureSpec.up_codec,
        help="the syncer's --up-codec (default: the --comms setting's)",
    )
    parser.add_argument("--down-codec", help="the syncer's --down-codec (default: the setting's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        "| seed | syncer kills | syncer failed (disk) | learner kills | of them resumed | "
        "partitions | long partitions | second syncers refused | clock steps | rollbacks | "
        "zombies fenced | replies lost | commits | uploads merged | steps (clean lives) | "
        "steps lost at kills | steps unknown | steps rolled back | longest stall s | audit |"
    )
    print("|" + "---|" * 20)
    results = {}
    harness_failures: dict[int, str] = {}
    for seed in seeds_of(args.seeds):
        workdir = args.out / str(seed)
        spec = TortureSpec(
            seed=seed,
            seconds=args.seconds,
            comms=args.comms,
            up_codec=args.up_codec,
            down_codec=args.down_codec,
        )
        try:
            result = Torture(spec, workdir).run()
        except RuntimeError as exc:  # the run itself could not go on: this seed failed
            print(f"| {seed} | the run stopped: {exc} |", flush=True)
            harness_failures[seed] = str(exc)
            continue
        r = result.to_dict()
        (workdir / "result.json").write_text(json.dumps(r, indent=1))
        results[seed] = r
        print(row(seed, r), flush=True)
        if r["audit"]["ok"] and not args.keep:  # a failed run's files are kept
            for name in ("learners", "state"):
                shutil.rmtree(workdir / name, ignore_errors=True)
    failed = sorted([s for s, r in results.items() if not r["audit"]["ok"]] + [*harness_failures])
    stalls = [r["audit"]["longest_stall_s"] for r in results.values()]
    summary = {
        "seeds": len(results) + len(harness_failures),
        "exact": len(results) + len(harness_failures) - len(failed),
        "failed_seeds": failed,
        "runs_stopped": harness_failures,
        "syncer_kills": sum(r["syncer_kills"] for r in results.values()),
        "syncer_failures": sum(r["syncer_failures"] for r in results.values()),
        "learner_kills": sum(r["learner_kills"] for r in results.values()),
        "replies_lost": sum(r["replies_lost"] for r in results.values()),
        "commits": sum(r["audit"]["commits"] for r in results.values()),
        "uploads_merged": sum(r["audit"]["uploads_merged"] for r in results.values()),
        "longest_stall_s": {"median": statistics.median(stalls), "max": max(stalls)}
        if stalls
        else None,
        "schedules_with_new_faults": sum(
            any(f["kind"] in NEW_FAULTS for f in r["faults"]) for r in results.values()
        ),
        "new_faults": {
            kind: sum(sum(f["kind"] == kind for f in r["faults"]) for r in results.values())
            for kind in NEW_FAULTS
        },
        "second_syncers_refused": sum(r["second_syncers_refused"] for r in results.values()),
        "rollbacks": sum(r["rollbacks"] for r in results.values()),
        "zombies_fenced": sum(r["zombies_fenced"] for r in results.values()),
        "steps_unknown": sum(r["audit"]["steps_unknown"] for r in results.values()),
        "steps_rolled_back": sum(r["audit"]["steps_rolled_back"] for r in results.values()),
        "stall_bound_s": STALL_BOUND_S,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The decoupled protocol's own mechanisms, switched on and off: quorum and grace window on a
mixed fleet, RDA against the weighted mean, token weights against uniform ones.

Run: ``.venv/bin/python benchmarks/bench_protocol.py mixed|ablation|hostile [--seeds 0]
[--out DIR]``.

``mixed`` (the paper's heterogeneous table): M = 4 learners, learners 2 and 3 take 1.5x as
long per step, every step varies by up to +-20% (``--slow 2=1.5 --slow 3=1.5 --jitter 0.2``),
a fixed wall time (``--minutes``, default 2). Three settings: K = M (every round waits for all
four), K = 1 without grace (``--gamma 0``: a round closes at its first answer) and K = 1 with
the adaptive grace window (the default). Reported: goodput, held-out loss at equal wall time,
tokens, learners per round.

``ablation``: the clean budget of ``diloco bench`` (every learner 800 steps) at M = 4 and
M = 8 (``--learners``), default against ``--merge mean`` (weighted mean for every tensor
instead of RDA) and against ``--weighting uniform`` (every contribution weighs 1 instead of
tokens²/steps). Reported: held-out loss at equal tokens.

``hostile`` (docs/security.md "A hostile learner"): a two-site run, M = 4, learners 0 and 1
on one site's link (``--wan 0,1:rate=1gbit``), learners 2 and 3 on the other's
(``2,3:rate=50mbit,rtt=20ms``; needs root), every learner ``--steps`` steps (default 500:
equal honest work; at equal wall time the fourth process would slow the honest ones down on a
2-core machine). Learner 3 is hostile from the start (``--chaos
corrupt:learners=3,how=hostile,start=0s``: every delta's sign flipped, 100x the tokens
declared and claimed), against the same run with learner 3 absent (M = 3, learner 2 alone on
the second site) and, for scale, the hostile run without the direction check
(``--direction-floor=-1``). Reported: held-out loss at equal honest steps, and how many of the
hostile learner's contributions the direction check left out.

Every setting runs once per seed; the table gives each run and the median over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MIXED = {
    "K=M": ["--quorum=4"],
    "K=1, no grace": ["--gamma=0"],
    "K=1 + grace": [],
}
MIXED_FLEET = ["--learners=4", "--slow", "2=1.5", "--slow", "3=1.5", "--jitter=0.2"]
SITES = ["--wan=0,1:rate=1gbit", "--wan=2,3:rate=50mbit,rtt=20ms"]
HOSTILE = {
    "learner 3 absent (M = 3)": [
        "--learners=3",
        "--wan=0,1:rate=1gbit",
        "--wan=2:rate=50mbit,rtt=20ms",
    ],
    "learner 3 hostile": [
        "--learners=4",
        *SITES,
        "--chaos=corrupt:learners=3,how=hostile,start=0s",
    ],
    "learner 3 hostile, no direction check": [
        "--learners=4",
        *SITES,
        "--chaos=corrupt:learners=3,how=hostile,start=0s",
        "--direction-floor=-1",
    ],
}
ABLATION = {
    "default (RDA, token weights)": [],
    "weighted mean, no RDA": ["--merge=mean"],
    "uniform weights": ["--weighting=uniform"],
}


def run(out: Path, name: str, flags: list[str]) -> dict:
    """One ``diloco run`` (reused if its summary exists); returns its summary."""
    summary = out / name / "summary.json"
    if not summary.exists():
        argv = [sys.executable, "-m", "diloco.cli", "run", "--no-view", "--json"]
        argv += [f"--runs-dir={out}", f"--name={name}", *flags]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(summary.read_text())


def row(label: str, seed: int, s: dict) -> dict:
    per_round = s.get("contributors_per_round") or {}
    return {
        "setting": label,
        "seed": seed,
        "loss": s["val_loss"]["final"],
        "goodput": s.get("goodput"),
        "tokens": s["tokens"],
        "learners_per_round": per_round.get("mean"),
        "at_least_3": per_round.get("at_least_3"),
        "bytes_per_token": s["bytes"]["per_token"],
    }


def excluded(run_dir: Path) -> dict:
    """Rounds the hostile learner (learner-3) was in, and how many left it out."""
    rounds = [
        r
        for line in (run_dir / "syncer" / "events.jsonl").read_text().splitlines()
        if (r := json.loads(line))["event"] == "round"
    ]
    merged = sum("learner-3" in r["participants"] for r in rounds)
    left_out = sum("learner-3" in r.get("excluded", {}) for r in rounds)
    return {"hostile_merged": merged, "hostile_excluded": left_out}


def table(rows: list[dict]) -> str:
    cols = ["loss", "goodput", "tokens", "learners_per_round", "at_least_3", "bytes_per_token"]
    lines = ["| setting | seeds | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for label in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == label]
        cells = []
        for c in cols:
            vals = [r[c] for r in rs if r[c] is not None]
            med = statistics.median(vals) if vals else None
            cells.append("" if med is None else f"{med:,.3f}" if med < 100 else f"{med:,.0f}")
        lines.append(f"| {label} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["mixed", "ablation", "hostile"])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", default="/tmp/bench-protocol")
    ap.add_argument("--minutes", type=float, default=2.0, help="mixed: wall time per run")
    ap.add_argument("--learners", type=int, default=4, help="ablation: M")
    ap.add_argument(
        "--steps", type=int, default=None, help="ablation (800), hostile (500): steps per learner"
    )
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 500 if args.what == "hostile" else 800
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        if args.what == "mixed":
            base = [*MIXED_FLEET, f"--minutes={args.minutes}", f"--seed={seed}", "--eval-every=10"]
            settings = MIXED
        elif args.what == "hostile":
            base = [f"--steps={args.steps}", "--minutes=20", f"--seed={seed}", "--eval-every=10"]
            settings = HOSTILE
        else:
            # as `diloco bench`'s clean condition: the run ends when every learner did its steps
            base = [f"--learners={args.learners}", f"--steps={args.steps}", "--minutes=40"]
            base += [f"--seed={seed}", "--eval-every=10"]
            settings = ABLATION
        for label, flags in settings.items():
            tag = "".join(c if c.isalnum() else "-" for c in label).strip("-")
            name = f"{args.what}-m{args.learners}-{tag}-s{seed}"
            summary = run(out, name, [*base, *flags])
            rows.append(row(label, seed, summary))
            if args.what == "hostile":
                rows[-1].update(excluded(out / name))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    (out / f"{args.what}-m{args.learners}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

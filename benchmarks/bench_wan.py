"""Training over shaped wide-area links: tokens/s, loss and bytes against the link rate.

    python benchmarks/bench_wan.py --out bench/wan                       # the sweep (root)
    python benchmarks/bench_wan.py --rates none,1mbit --modes decoupled --minutes 0.5  # smoke
    python benchmarks/bench_wan.py --out bench/wan --report              # tables and figures

**What runs.** For every (mode, rate, seed): ``diloco run --mode MODE -m M --minutes T
--wan rate=RATE,rtt=RTT`` (every learner, or data-parallel rank, in its own network
namespace; the kernel's ``tbf`` shapes each link in both directions; ``diloco.wan``), with
the default recipe and settings of each mode; ``torchft``: ``python -m
diloco.cli.torchft_peer`` with the same flags (torchft's DiLoCo at our default H and our
syncer's outer optimizer, lr 0.6 and Nesterov momentum 0.7, one fragment, every replica group
on its link); ``lowest``: decoupled with ``--comms lowest`` and Muon
(``--inner-optimizer muon --inner-lr 6e-3``, the setting's measured use). Fixed wall time,
so every mode spends the same
seconds; ``rate=none`` is the harness unshaped (the same namespaces and routing).

**Measures** (from each run's ``summary.json``): tokens/s over the training time; held-out
loss of the final global model (equal wall time); bytes at the learners' interfaces (the
kernel's counters) per token, beside the transport's own count. Per mode, the **knee**: the
lowest rate that keeps 90% of the mode's own unshaped tokens/s, interpolated on a log scale
between the two grid rates around it (the median over seeds at each rate).

Outputs under ``--out``: ``runs/<cell>/`` (each run), ``wan.json`` (every cell), ``wan.md``
(tables), ``figures/wan_tokens_per_s.png`` (tokens/s against rate, log scale) and
``figures/wan_loss_slowest.png`` (loss against wall time at the slowest rate).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("dp", "sync", "decoupled", "torchft", "lowest")
MODE_FLAGS = {  # a mode that is a setting of another: its diloco run flags
    "lowest": ["--mode=decoupled", "--comms=lowest", "--inner-optimizer=muon", "--inner-lr=6e-3"]
}
RATES = ("none", "1gbit", "300mbit", "100mbit", "30mbit", "10mbit", "3mbit", "1mbit", "300kbit")
KNEE_SHARE = 0.9


def cell_name(mode: str, rate: str, rtt: str, seed: int) -> str:
    return f"{mode}-{rate}-rtt{rtt}-s{seed}"


def run_cell(out: Path, mode: str, rate: str, rtt: str, seed: int, args) -> dict | None:
    """One ``diloco run`` (skipped when its summary exists); its row, or None if it failed."""
    name = cell_name(mode, rate, rtt, seed)
    run_dir = out / "runs" / name
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        common = [
            f"--learners={args.learners}",
            f"--minutes={args.minutes}",
            f"--seed={seed}",
            f"--recipe={args.recipe}",
            f"--wan=rate={rate},rtt={rtt}",
        ]
        if mode == "torchft":  # the external peer: its summary is printed as JSON
            command = [sys.executable, "-m", "diloco.cli.torchft_peer", *common]
            command += [f"--run-dir={run_dir}", "--json"]
        else:
            flags = MODE_FLAGS.get(mode, [f"--mode={mode}"])
            command = [sys.executable, "-m", "diloco.cli", "run", *flags, *common]
            command += [f"--runs-dir={out / 'runs'}", f"--name={name}", "--no-view"]
        t0 = time.time()
        log_path = out / "logs" / f"{name}.log"
        with log_path.open("w") as log, (out / "logs" / f"{name}.out").open("w") as stdout:
            code = subprocess.run(command, stdout=stdout, stderr=log).returncode
        print(f"{name}: exit {code} in {time.time() - t0:.0f}s", flush=True)
        if mode == "torchft" and code == 0:
            summary_path.write_text((out / "logs" / f"{name}.out").read_text())
        if not summary_path.exists():
            return None
    return row(json.loads(summary_path.read_text()), mode, rate, rtt, seed, run_dir)


def row(summary: dict, mode: str, rate: str, rtt: str, seed: int, run_dir: Path) -> dict:
    wan = summary.get("wan", {})
    train_s = summary.get("train_s") or summary.get("wall_s")
    return {
        "mode": mode,
        "rate": rate,
        "rate_bps": rate_bps(rate),
        "rtt": rtt,
        "seed": seed,
        "tokens": summary["tokens"],
        "train_s": train_s,
        "tokens_per_s": summary["tokens"] / train_s if train_s else 0.0,
        "val_loss": summary["val_loss"]["final"],
        "iface_bytes": (wan.get("iface_up", 0) + wan.get("iface_down", 0)),
        "iface_bytes_per_token": wan.get("iface_bytes_per_token"),
        "transport_bytes_per_token": summary["bytes"].get("per_token"),
        "up_ratio": wan.get("up_ratio"),
        "down_ratio": wan.get("down_ratio"),
        "metrics": str(run_dir / "metrics.jsonl"),
    }


def rate_bps(rate: str) -> float | None:
    from diloco.wan.spec import parse_rate

    return parse_rate(rate)


def knee(points: list[tuple[float | None, float]]) -> float | None:
    """The lowest rate (bits/s) that keeps ``KNEE_SHARE`` of the unshaped (None) tokens/s,
    interpolated on log(rate) between the grid rates around it; None when no shaped rate
    falls below the share (the knee is under the grid), inf when even the fastest does."""
    unshaped = [tps for r, tps in points if r is None]
    shaped = sorted((r, tps) for r, tps in points if r is not None)
    if not unshaped or not shaped:
        return None
    target = KNEE_SHARE * unshaped[0]
    above = [(r, t) for r, t in shaped if t >= target]
    if not above:
        return math.inf
    r_hi, t_hi = min(above)
    below = [(r, t) for r, t in shaped if r < r_hi]
    if not below:
        return None  # every grid rate keeps it: the knee is below the slowest
    r_lo, t_lo = max(below)
    if t_hi == t_lo:
        return r_hi
    f = (target - t_lo) / (t_hi - t_lo)
    return math.exp(math.log(r_lo) + f * (math.log(r_hi) - math.log(r_lo)))


def medians(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    """Median of every numeric field over seeds, per (mode, rate, rtt)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["rate"], r["rtt"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        med = {"seeds": len(rs), "rate_bps": rs[0]["rate_bps"]}
        for field in ("tokens_per_s", "val_loss", "iface_bytes_per_token", "up_ratio"):
            values = [r[field] for r in rs if r[field] is not None]
            med[field] = statistics.median(values) if values else None
        out[key] = med
    return out


def report(out: Path, rows: list[dict], rtt: str) -> str:
    med = medians(rows)
    modes = [m for m in MODES if any(k[0] == m for k in med)]
    rates = sorted({k[1] for k in med}, key=lambda r: -(rate_bps(r) or math.inf))
    lines = [
        f"Link rate sweep, rtt {rtt}: tokens/s (held-out loss, interface B/token), median of seeds",
        "",
        "| rate | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for rate in rates:
        cells = []
        for m in modes:
            c = med.get((m, rate, rtt))
            cells.append(
                f"{c['tokens_per_s']:,.0f} ({c['val_loss']:.3f}, {c['iface_bytes_per_token']:.1f})"
                if c and c["val_loss"] is not None and c["iface_bytes_per_token"] is not None
                else "-"
            )
        lines.append(f"| {rate} | " + " | ".join(cells) + " |")
    grid = sorted(c["rate_bps"] for c in med.values() if c["rate_bps"])

    def text(k: float | None) -> str:
        if k is None:
            return f"below the slowest rate measured ({grid[0] / 1e6:g} Mbit/s)" if grid else "-"
        if math.isinf(k):
            return f"above the fastest rate measured ({grid[-1] / 1e6:g} Mbit/s)"
        return f"{k / 1e6:.3g} Mbit/s"

    for field, what in (
        ("tokens_per_s", "tokens/s"),
        ("iface_bytes_per_token", "interface bytes/token (it still sends all it would)"),
    ):
        lines += ["", f"Knee: the lowest rate keeping 90% of the mode's unshaped {what}:", ""]
        for m in modes:
            pts = [(c["rate_bps"], c[field]) for k, c in med.items() if k[0] == m and k[2] == rtt]
            lines.append(f"- {m}: {text(knee([(r, v) for r, v in pts if v is not None]))}")
    (out / "wan.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def figures(out: Path, rows: list[dict], rtt: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    med = medians(rows)
    shaped = [c["rate_bps"] for c in med.values() if c["rate_bps"]]
    unshaped_x = max(shaped) * 3 if shaped else 1e10
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in MODES:
        pts = sorted(
            (c["rate_bps"] or unshaped_x, c["tokens_per_s"])
            for k, c in med.items()
            if k[0] == m and k[2] == rtt
        )
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per learner (bit/s; rightmost: unshaped)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"M = 4, rtt {rtt}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figs / "wan_tokens_per_s.png", dpi=120)
    plt.close(fig)
    # the slowest rate every mode with a loss curve ran at (torchft's peer keeps none)
    curves = [r for r in rows if r["rtt"] == rtt and r["rate_bps"] and Path(r["metrics"]).exists()]
    per_mode = [{r["rate_bps"] for r in curves if r["mode"] == m} for m in MODES]
    common = set.intersection(*[rates for rates in per_mode if rates]) if curves else set()
    slowest = min(common) if common else None
    fig, ax = plt.subplots(figsize=(6, 4))
    first_seed = min((x["seed"] for x in rows), default=0)
    for r in curves:
        if r["rate_bps"] == slowest and r["seed"] == first_seed:
            recs = [json.loads(ln) for ln in Path(r["metrics"]).read_text().splitlines() if ln]
            ax.plot([x["t"] for x in recs], [x["val_loss"] for x in recs], label=r["mode"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"slowest link: {slowest / 1e6:g} Mbit/s, rtt {rtt}" if slowest else "")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figs / "wan_loss_slowest.png", dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/wan")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--rtt", default="0ms", help="round trip of every link (default 0ms)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--minutes", type=float, default=1.5)
    p.add_argument("--recipe", default="shakespeare")
    p.add_argument("--skip", default="dp@300kbit", help="mode@rate cells not to run")
    p.add_argument("--report", action="store_true", help="only tables and figures")
    args = p.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for rate in args.rates.split(","):
            for mode in args.modes.split(","):
                if f"{mode}@{rate}" in skip:
                    continue
                name = cell_name(mode, rate, args.rtt, seed)
                if args.report and not (out / "runs" / name / "summary.json").exists():
                    continue
                r = run_cell(out, mode, rate, args.rtt, seed, args)
                if r is not None:
                    rows.append(r)
    if not rows:
        print("no runs")
        return 1
    previous = json.loads((out / "wan.json").read_text()) if (out / "wan.json").exists() else []
    keep = {(r["mode"], r["rate"], r["rtt"], r["seed"]) for r in rows}
    merged = [r for r in previous if (r["mode"], r["rate"], r["rtt"], r["seed"]) not in keep]
    (out / "wan.json").write_text(json.dumps(merged + rows, indent=1))
    print(report(out, merged + rows, args.rtt))
    figures(out, merged + rows, args.rtt)
    return 0


if __name__ == "__main__":
    sys.exit(main())

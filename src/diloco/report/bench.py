"""From run summaries to the benchmark's table: medians over seeds, one row per cell. Pure.

A *result* is what ``diloco bench`` keeps of one run: its spec (mode, condition, seed, sweep
settings), the run's ``summary.json`` fields that the table needs, and the held-out loss
curve from ``metrics.jsonl`` (``t`` in seconds, ``tokens``, ``val_loss``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from diloco.bench.matrix import SWEEP_REFERENCE

COLUMNS = (
    ("val_loss", "held-out loss", "{:.3f}"),
    ("tokens", "tokens", "{:,.0f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("goodput", "goodput", "{:.1%}"),
    ("goodput_speed", "goodput (tokens)", "{:.1%}"),
    ("down_share", "down (schedule)", "{:.1%}"),
    ("goodput_up", "goodput while up", "{:.1%}"),
    ("bytes_per_token", "bytes/token", "{:,.1f}"),
    ("at_least_3", "rounds with >=3 learners", "{:.1%}"),
    ("wall_s", "wall s", "{:.0f}"),
)


def result_of(spec: dict, summary: dict, curve: list[dict]) -> dict:
    """The numbers of one run. ``tokens_per_s`` is tokens over the whole wall time (start-up,
    training, shutdown: the one span every mode and every peer measures the same way)."""
    seconds = summary["wall_s"]
    return {
        **spec,
        "val_loss": summary["val_loss"]["final"],
        "val_loss_initial": summary["val_loss"]["initial"],
        "tokens": summary["tokens"],
        "wall_s": summary["wall_s"],
        "tokens_per_s": summary["tokens"] / seconds if seconds else None,
        "goodput": summary.get("goodput"),
        "goodput_speed": summary.get("goodput_speed"),
        "down_share": summary.get("down_share"),
        "goodput_up": summary.get("goodput_up"),
        "bytes_per_token": summary["bytes"]["per_token"],
        "dp_bytes_per_token": summary["bytes"].get("data_parallel_per_token"),
        "at_least_3": (summary.get("contributors_per_round") or {}).get("at_least_3"),
        "contributors": (summary.get("contributors_per_round") or {}).get("histogram", {}),
        "curve": curve,
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cells(results: list[dict], keys=("mode", "condition")) -> list[dict]:
    """Group results by ``keys`` and take the median of every column over the seeds."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[tuple(str(r.get(k, "")) for k in keys)].append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(keys, key, strict=True))
        row["seeds"] = sorted({r["seed"] for r in rs})
        for name, _, _ in COLUMNS:
            row[name] = _median(r.get(name) for r in rs)
        row["val_loss_spread"] = (
            max(r["val_loss"] for r in rs) - min(r["val_loss"] for r in rs) if len(rs) > 1 else 0
        )
        out.append(row)
    return out


def markdown_table(rows: list[dict], keys=("mode", "condition")) -> str:
    head = [*keys, "seeds"] + [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [str(row[k]) for k in keys] + [str(len(row["seeds"]))]
        for name, _, fmt in COLUMNS:
            v = row.get(name)
            values.append("–" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(str(r.get(k)) == str(v) for k, v in match.items())), None)


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with the measured numbers and whether it is met.

    A target whose cells were not run is reported as ``None`` (not measured).
    """
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "met": ok, "measured": detail})

    dec, syn, dp = (find(rows, mode=m, condition="clean") for m in ("decoupled", "sync", "dp"))
    if dec and syn:
        gap = dec["val_loss"] / syn["val_loss"] - 1
        add("clean: decoupled within 2% of sync DiLoCo", gap <= 0.02, f"{gap:+.1%}")
    if dp and (dec or syn):
        best = min(r["val_loss"] for r in (dec, syn) if r)
        gap = best / dp["val_loss"] - 1
        add("clean: DiLoCo family's gap to data-parallel below +14%", gap < 0.14, f"{gap:+.1%}")
    cd, cs, cp = (find(rows, mode=m, condition="chaos") for m in ("decoupled", "sync", "dp"))
    if cd and cd["goodput"] is not None:
        others = [r["goodput"] for r in (cs, cp) if r and r["goodput"] is not None]
        ok = cd["goodput"] >= 0.90 and all(cd["goodput"] > g for g in others)
        detail = f"decoupled {cd['goodput']:.1%}" + "".join(
            f", {r['mode']} {r['goodput']:.1%}" for r in (cs, cp) if r and r["goodput"] is not None
        )
        if cd.get("down_share") is not None:  # what no system could have used
            detail += f" (the schedule's own down time: {cd['down_share']:.1%} of provisioned)"
        add("chaos: decoupled goodput >= 90% and above dp and sync", ok, detail)
    if cd and cp:
        add(
            "chaos: decoupled loss below data-parallel's at equal wall time",
            cd["val_loss"] < cp["val_loss"],
            f"{cd['val_loss']:.3f} vs {cp['val_loss']:.3f}",
        )
    sd = find(rows, mode="decoupled", condition="slow")
    for other in ("sync", "torchft"):
        so = find(rows, mode=other, condition="slow")
        if sd and so and so["tokens_per_s"]:
            ratio = sd["tokens_per_s"] / so["tokens_per_s"]
            add(f"slow: decoupled tokens/s >= 1.5x {other}'s", ratio >= 1.5, f"{ratio:.2f}x")
    return out


def bandwidth_target(
    sweep_rows: list[dict], dp_bytes_per_token: float | None, base_setting: dict | None = None
) -> dict | None:
    """>= 200x fewer bytes/token than data-parallel with loss within 5% of the sweep's
    reference setting's (``base_setting``; by default ``matrix.SWEEP_REFERENCE``, the
    default until 2026-11-27: decoupled, H=24, int4 up / int8 down)."""
    base = find(sweep_rows, **(base_setting or SWEEP_REFERENCE))
    if not base or not dp_bytes_per_token:
        return None
    target = ">= 200x fewer bytes/token than dp, loss within 5% of the former default H=24"

    def label(r: dict) -> str:
        return (
            f"{r.get('mode', 'decoupled')} H={r['H']} {r['up_codec']}/{r.get('down_codec', 'bf16')}"
        )

    best = None
    for r in sweep_rows:
        ratio = dp_bytes_per_token / r["bytes_per_token"] if r["bytes_per_token"] else 0
        loss_gap = r["val_loss"] / base["val_loss"] - 1
        if ratio >= 200 and loss_gap <= 0.05 and (best is None or ratio > best[0]):
            best = (ratio, loss_gap, r)
    if best is None:
        top = max(sweep_rows, key=lambda r: dp_bytes_per_token / (r["bytes_per_token"] or 1e18))
        return {
            "target": target,
            "met": False,
            "measured": f"best ratio {dp_bytes_per_token / top['bytes_per_token']:.0f}x at "
            f"{label(top)} (loss {top['val_loss'] / base['val_loss'] - 1:+.1%})",
        }
    ratio, gap, r = best
    return {
        "target": target,
        "met": True,
        "measured": f"{ratio:.0f}x at {label(r)} (loss {gap:+.1%})",
    }


def write_report(
    out: Path, budget, results: list[dict], failed: list[str], command: str | None = None
):
    """Write ``results.json`` (with ``command``, the command line that made it, if given),
    ``table.md`` and the figures of a ``diloco bench`` into ``out``; returns the table's text
    and the figures' paths."""
    from diloco.bench import matrix as mx
    from diloco.report import plots

    main = [r for r in results if "H" not in r]
    swept = [r for r in results if "H" in r]
    rows = cells(main)
    sweep_rows = cells(swept, keys=mx.SWEEP_KEYS) if swept else []
    dp_bpt = next((r["dp_bytes_per_token"] for r in results if r.get("dp_bytes_per_token")), None)
    goals = targets(rows)
    band = bandwidth_target(sweep_rows, dp_bpt)
    if band:
        goals.append(band)
    (out / "results.json").write_text(
        json.dumps(
            {"budget": vars(budget), "results": results, "targets": goals, "command": command},
            indent=1,
        )
    )
    figures = plots.loss_curves(main, out) + plots.bars(rows, out)
    figures.append(plots.contributors(main, out))
    if sweep_rows:
        figures.append(plots.sweep_tradeoff(sweep_rows, out))
    text = [
        f"# diloco bench ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Budget: {json.dumps(vars(budget))}",
        "",
        markdown_table(rows),
        "",
    ]
    if sweep_rows:
        text += ["Sweep (clean):", "", markdown_table(sweep_rows, mx.SWEEP_KEYS)]
        text += ["", f"data-parallel bytes/token (fp32 ring all-reduce): {dp_bpt:,.0f}", ""]
    text += ["Targets:", ""] + [
        f"- {'met' if g['met'] else 'MISSED'}: {g['target']} ({g['measured']})" for g in goals
    ]
    if failed:
        text += ["", f"Failed runs: {', '.join(failed)}"]
    (out / "table.md").write_text("\n".join(text) + "\n")
    return "\n".join(text), figures

"""The benchmark's figures (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from diloco.report.headless import headless_pyplot

COLORS = {"decoupled": "tab:blue", "sync": "tab:orange", "dp": "tab:green", "torchft": "tab:red"}
STYLES = {"clean": "-", "chaos": "--", "slow": ":"}


def loss_curves(results: list[dict], out: Path) -> list[Path]:
    """Held-out loss against tokens and against wall time, one line per run."""
    plt = headless_pyplot()
    paths = []
    for x, label, name in (("tokens", "tokens", "loss_vs_tokens"), ("t", "wall s", "loss_vs_time")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        seen = set()
        for r in results:
            pts = [(p[x], p["val_loss"]) for p in r["curve"] if p.get(x) is not None]
            if not pts:
                continue
            key = (r["mode"], r["condition"])
            ax.plot(
                *zip(*pts, strict=True),
                color=COLORS.get(r["mode"], "gray"),
                linestyle=STYLES.get(r["condition"], "-"),
                alpha=0.8,
                label=None if key in seen else f"{r['mode']} ({r['condition']})",
            )
            seen.add(key)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def bars(rows: list[dict], out: Path) -> list[Path]:
    """Goodput, bytes per token and tokens/s per (mode, condition) cell."""
    plt = headless_pyplot()
    paths = []
    for column, title, log in (
        ("goodput", "goodput", False),
        ("bytes_per_token", "bytes per token (log)", True),
        ("tokens_per_s", "tokens/s", False),
    ):
        cells = [r for r in rows if r.get(column) is not None]
        if not cells:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['mode']}\n{r['condition']}" for r in cells]
        ax.bar(labels, [r[column] for r in cells], color=[COLORS.get(r["mode"]) for r in cells])
        if log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out / f"{column}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def contributors(results: list[dict], out: Path) -> Path | None:
    """How many learners each committed round merged: the share of rounds with n learners,
    one group of bars per (mode, condition) cell, rounds of all its seeds together."""
    totals: dict[tuple[str, str], dict[int, int]] = {}
    for r in results:
        cell = totals.setdefault((r["mode"], r["condition"]), {})
        for n, count in (r.get("contributors") or {}).items():
            cell[int(n)] = cell.get(int(n), 0) + int(count)
    totals = {k: v for k, v in totals.items() if sum(v.values())}
    if not totals:
        return None
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ns = sorted({n for v in totals.values() for n in v})
    width = 0.8 / len(totals)
    for i, ((mode, condition), counts) in enumerate(sorted(totals.items())):
        total = sum(counts.values())
        ax.bar(
            [n + (i - (len(totals) - 1) / 2) * width for n in ns],
            [counts.get(n, 0) / total for n in ns],
            width=width,
            color=COLORS.get(mode, "gray"),
            alpha=0.5 + 0.5 * (condition == "clean"),
            label=f"{mode} ({condition})",
        )
    ax.set_xticks(ns)
    ax.set_xlabel("learners merged by a round")
    ax.set_ylabel("share of rounds")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "contributors.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_tradeoff(rows: list[dict], out: Path) -> Path | None:
    """Held-out loss against bytes per token for every setting of the sweep."""
    if not rows:
        return None
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        ax.scatter(r["bytes_per_token"], r["val_loss"], color="tab:blue")
        ax.annotate(
            f"{r.get('mode', 'decoupled')[:4]} H={r['H']} {r['up_codec']}/{r.get('down_codec', 'bf16')}",
            (r["bytes_per_token"], r["val_loss"]),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token (log)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

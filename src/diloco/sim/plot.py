"""Goodput against chip count, one line per mode (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from diloco.report.headless import headless_pyplot
from diloco.sim.grid import (
    PAPER_CHIPS,
    PAPER_DECOUPLED_M8_1_2M,
    PAPER_DP,
    PAPER_DP_ELASTIC,
    row_label,
)


def plot_goodput(cells: list[dict], path: str) -> None:
    """Simulated goodput (95% CI bars) per mode; the paper's published values as open markers."""
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows: dict[tuple[str, int], list[dict]] = {}
    for c in cells:
        rows.setdefault((c["mode"], c["learners"]), []).append(c)
    for (mode, m), cs in rows.items():
        cs = sorted(cs, key=lambda c: c["chips"])
        ax.errorbar(
            [c["chips"] for c in cs],
            [100 * c["goodput"] for c in cs],
            yerr=[100 * c["goodput_ci95"] for c in cs],
            marker="o",
            ms=3,
            capsize=2,
            label=row_label(mode, m),
        )
    ax.plot(PAPER_CHIPS, [100 * g for g in PAPER_DP], "kx", label="paper: dp")
    ax.plot(PAPER_CHIPS, [100 * g for g in PAPER_DP_ELASTIC], "k+", ms=9, label="paper: dp-elastic")
    ax.plot([1_200_000], [100 * PAPER_DECOUPLED_M8_1_2M], "k*", ms=10, label="paper: decoupled M=8")
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("Goodput under chip failures (MTBI 1 year per chip)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Run the simulator over seeds, modes and chip counts; confidence intervals; the grid table.

One seed draws one set of slice outages per chip count and scores every mode on it (common
random numbers: the modes differ only by how they handle the same failures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco.sim.config import SimConfig as SimConfig  # its home: the simulator's settings
from diloco.sim.defaults import (
    GRID_LEARNERS,
    PAPER_CHIPS,
    PAPER_DECOUPLED_M8_1_2M,
    PAPER_DP,
    PAPER_DP_ELASTIC,
)
from diloco.sim.failures import draw_outages
from diloco.sim.modes import ModeResult, dp_accounting, elastic_accounting, speed_factor


@dataclass(frozen=True)
class Row:
    """One mode (and M for decoupled) across chip counts."""

    mode: str
    learners: int
    """M for decoupled; 1 otherwise."""


def grid_rows(learners: tuple[int, ...] = GRID_LEARNERS) -> list[Row]:
    return [Row("dp", 1), Row("dp-elastic", 1)] + [Row("decoupled", m) for m in learners]


def score(row: Row, outages, cfg: SimConfig, rng: np.random.Generator) -> ModeResult:
    """Goodput and uptime of one mode on one draw of outages."""
    if row.mode == "dp":
        r = dp_accounting(outages, restart_s=cfg.restart_s, checkpoint_s=cfg.checkpoint_s)
    else:
        m = row.learners if row.mode == "decoupled" else 1
        r = elastic_accounting(
            outages,
            groups=m,
            quorum=min(cfg.quorum, m),
            reconfig_s=cfg.reconfig_s,
            readd_s=cfg.readd_s,
        )
    groups = row.learners if row.mode == "decoupled" else 1
    f = speed_factor(rng, slices=outages.slices, groups=groups, sigma=cfg.speed_sigma)
    return ModeResult(r.goodput * f, r.uptime)


def simulate(
    chips: tuple[int, ...], rows: list[Row], cfg: SimConfig, seeds: int, seed0: int = 0
) -> dict[tuple[str, int, int], np.ndarray]:
    """``{(mode, M, chips): array[seeds, 2]}`` of (goodput, uptime) per seed."""
    if seeds < 2:
        raise ValueError("seeds must be >= 2 (a confidence interval needs two)")
    out: dict[tuple[str, int, int], list] = {}
    for n_chips in chips:
        slices = n_chips // cfg.slice_chips
        if slices < max(r.learners for r in rows):
            raise ValueError(
                f"{n_chips} chips make {slices} slices of {cfg.slice_chips}: fewer than "
                f"{max(r.learners for r in rows)} learners; use smaller slices or more chips"
            )
        for k in range(seeds):
            rng = np.random.default_rng([seed0 + k, n_chips])
            outages = draw_outages(
                rng,
                slices=slices,
                slice_chips=cfg.slice_chips,
                mtbi_s=cfg.mtbi_s,
                recovery=cfg.recovery,
                horizon_s=cfg.horizon_s,
            )
            for row in rows:
                r = score(row, outages, cfg, rng)
                out.setdefault((row.mode, row.learners, n_chips), []).append((r.goodput, r.uptime))
    return {k: np.asarray(v) for k, v in out.items()}


# two-sided 95% Student t quantiles for 1..30 degrees of freedom
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def mean_ci(x: np.ndarray) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (Student t over seeds)."""
    n = int(x.size)
    if n < 2:
        raise ValueError("need at least two values for a confidence interval")
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return float(x.mean()), float(t * x.std(ddof=1) / math.sqrt(n))


def summarize(results: dict[tuple[str, int, int], np.ndarray]) -> list[dict]:
    """One record per cell: mode, learners, chips, goodput ± ci, uptime ± ci (fractions)."""
    cells = []
    for (mode, m, chips), arr in results.items():
        g, g_ci = mean_ci(arr[:, 0])
        u, u_ci = mean_ci(arr[:, 1])
        cells.append(
            {
                "mode": mode,
                "learners": m,
                "chips": chips,
                "goodput": g,
                "goodput_ci95": g_ci,
                "uptime": u,
                "uptime_ci95": u_ci,
                "seeds": int(arr.shape[0]),
            }
        )
    return cells


def paper_value(mode: str, learners: int, chips: int) -> float | None:
    """The published goodput for a cell, if there is one."""
    if chips in PAPER_CHIPS:
        i = PAPER_CHIPS.index(chips)
        if mode == "dp":
            return PAPER_DP[i]
        if mode == "dp-elastic":
            return PAPER_DP_ELASTIC[i]
    if mode == "decoupled" and learners == 8 and chips == 1_200_000:
        return PAPER_DECOUPLED_M8_1_2M
    return None


def row_label(mode: str, learners: int) -> str:
    return f"decoupled M={learners}" if mode == "decoupled" else mode


def format_table(cells: list[dict], chips: tuple[int, ...], metric: str = "goodput") -> str:
    """``metric`` (goodput or uptime, ± 95% CI, points) per row and chip count.

    For goodput the paper's value follows in brackets where there is one.
    """
    head = f"{metric + ' %':<18}" + "".join(f"{_chips_label(c):>18}" for c in chips)
    lines = [head]
    rows: dict[tuple[str, int], dict[int, dict]] = {}
    for c in cells:
        rows.setdefault((c["mode"], c["learners"]), {})[c["chips"]] = c
    for (mode, m), by_chips in rows.items():
        parts = []
        for n in chips:
            c = by_chips[n]
            txt = f"{100 * c[metric]:.1f}±{100 * c[metric + '_ci95']:.1f}"
            paper = paper_value(mode, m, n) if metric == "goodput" else None
            txt += f" [{100 * paper:.0f}]" if paper is not None else ""
            parts.append(f"{txt:>18}")
        lines.append(f"{row_label(mode, m):<18}" + "".join(parts))
    if metric == "goodput":
        lines.append("[..] = published value; dp rows were fitted, decoupled rows are predictions")
    return "\n".join(lines)


def _chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"

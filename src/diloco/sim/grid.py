"""Run the simulator over seeds, modes and chip counts; confidence intervals; the grid table.

One seed draws one set of slice outages per chip count and scores every mode on it (common
random numbers: the modes differ only by how they handle the same failures).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from diloco.sim.defaults import (
    ASSUMED_RECOVERY_KIND,
    ASSUMED_SLICE_CHIPS,
    DEFAULT_HORIZON_S,
    FITTED_CHECKPOINT_S,
    FITTED_RECONFIG_S,
    FITTED_RECOVERY_MEAN_S,
    FITTED_RESTART_S,
    GRID_LEARNERS,
    PAPER_CHIPS,
    PAPER_DECOUPLED_M8_1_2M,
    PAPER_DP,
    PAPER_DP_ELASTIC,
    YEAR_S,
)
from diloco.sim.failures import Recovery, draw_outages
from diloco.sim.modes import ModeResult, dp_accounting, elastic_accounting, speed_factor


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Everything one simulated cell needs except the chip count, mode and seed."""

    slice_chips: int = ASSUMED_SLICE_CHIPS
    """Chips taken down together by one chip failure (a slice)."""
    mtbi_s: float = YEAR_S
    """Mean time between interruptions of one chip, seconds (the paper: one year)."""
    recovery: Recovery = field(
        default_factory=lambda: Recovery(kind=ASSUMED_RECOVERY_KIND, mean_s=FITTED_RECOVERY_MEAN_S)
    )
    """How long a failed slice stays down (matters to the elastic modes)."""
    restart_s: float = FITTED_RESTART_S
    """dp: stop after each failure (reschedule, restart, reload the checkpoint), seconds."""
    checkpoint_s: float = FITTED_CHECKPOINT_S
    """dp: seconds of training between checkpoints (rollback on a stop)."""
    reconfig_s: float = FITTED_RECONFIG_S
    """Elastic modes: pause of a group when it loses a slice, seconds."""
    readd_s: float = 0.0
    """Elastic modes: pause of a group to add a recovered slice back, seconds."""
    speed_sigma: float = 0.0
    """Log-standard-deviation of slice speeds (0: all slices equally fast)."""
    quorum: int = 1
    """Decoupled: K, the contributions a round needs."""
    horizon_s: float = DEFAULT_HORIZON_S
    """Simulated duration, seconds."""

    def __post_init__(self) -> None:
        if self.slice_chips < 1:
            raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips}")
        for name in ("mtbi_s", "checkpoint_s", "horizon_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("restart_s", "reconfig_s", "readd_s", "speed_sigma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["recovery"] = asdict(self.recovery)
        return d


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

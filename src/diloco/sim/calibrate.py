"""Fit the parameters the paper leaves open on the published data-parallel goodput only.

Two independent fits (their parameters do not interact in the model, docs/simulate.md):

* ``dp`` row → ``restart_s`` and ``checkpoint_s`` (the stop per failure and the rollback);
* ``dp-elastic`` row → ``reconfig_s`` and the mean recovery time of a slice.

Slice size and the recovery-time distribution's shape are not identifiable from these rows
(the elastic row depends on slice size × mean recovery only, and only means enter); they are
fixed by assumption (``ASSUMED_SLICE_CHIPS``, exponential). The objective is the largest
absolute residual in goodput points over the five chip counts (a minimax fit: the tolerance
is per point), minimized by Nelder–Mead in log-parameter space on common random numbers
(the same seeds for every evaluation, so the objective is a deterministic function).
Decoupled DiLoCo's published 88 % is never used: it is a prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from diloco.sim.failures import Recovery
from diloco.sim.grid import (
    PAPER_CHIPS,
    PAPER_DP,
    PAPER_DP_ELASTIC,
    Row,
    SimConfig,
    simulate,
)


def nelder_mead(
    f: Callable[[np.ndarray], float],
    x0: np.ndarray,
    step: np.ndarray,
    *,
    iters: int = 200,
    tol: float = 1e-4,
) -> tuple[np.ndarray, float]:
    """Minimize ``f`` from ``x0`` (standard reflection/expansion/contraction/shrink)."""
    n = x0.size
    pts = [np.asarray(x0, float)] + [x0 + np.eye(n)[i] * step[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0] + 0.5 * (p - pts[0]) for p in pts]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = int(np.argmin(vals))
    return pts[best], float(vals[best])


def row_goodput(mode: str, cfg: SimConfig, seeds: int) -> np.ndarray:
    """Mean goodput of one data-parallel row at the paper's chip counts."""
    res = simulate(PAPER_CHIPS, [Row(mode, 1)], cfg, seeds)
    return np.array([res[(mode, 1, n)][:, 0].mean() for n in PAPER_CHIPS])


def max_residual_points(model: np.ndarray, target: tuple[float, ...]) -> float:
    return float(np.max(np.abs(model - np.asarray(target))) * 100)


def fit_dp(base: SimConfig, seeds: int) -> tuple[SimConfig, np.ndarray]:
    """Fit ``restart_s`` and ``checkpoint_s`` on the data-parallel row (no elasticity)."""

    def cfg_of(x: np.ndarray) -> SimConfig:
        return replace(base, restart_s=float(np.exp(x[0])), checkpoint_s=float(np.exp(x[1])))

    def objective(x: np.ndarray) -> float:
        return max_residual_points(row_goodput("dp", cfg_of(x), seeds), PAPER_DP)

    x, _ = nelder_mead(objective, np.log([60.0, 60.0]), np.array([0.3, 0.5]))
    cfg = _rounded(cfg_of(x))
    return cfg, row_goodput("dp", cfg, seeds)


def fit_elastic(base: SimConfig, seeds: int) -> tuple[SimConfig, np.ndarray]:
    """Fit ``reconfig_s`` and the mean slice recovery time on the elastic data-parallel row."""

    def cfg_of(x: np.ndarray) -> SimConfig:
        recovery = replace(base.recovery, mean_s=float(np.exp(x[1])))
        return replace(base, reconfig_s=float(np.exp(x[0])), recovery=recovery)

    def objective(x: np.ndarray) -> float:
        return max_residual_points(row_goodput("dp-elastic", cfg_of(x), seeds), PAPER_DP_ELASTIC)

    x, _ = nelder_mead(objective, np.log([20.0, 1000.0]), np.array([0.3, 0.5]))
    cfg = _rounded(cfg_of(x))
    return cfg, row_goodput("dp-elastic", cfg, seeds)


def _rounded(cfg: SimConfig) -> SimConfig:
    """Round fitted values to what the defaults ship (3 significant digits)."""

    def r(v: float) -> float:
        return float(f"{v:.3g}")

    return replace(
        cfg,
        restart_s=r(cfg.restart_s),
        checkpoint_s=r(cfg.checkpoint_s),
        reconfig_s=r(cfg.reconfig_s),
        recovery=Recovery(
            kind=cfg.recovery.kind, mean_s=r(cfg.recovery.mean_s), sigma=cfg.recovery.sigma
        ),
    )

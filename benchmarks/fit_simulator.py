"""Fit the simulator's open parameters on the published data-parallel goodput only.

Run: ``.venv/bin/python benchmarks/fit_simulator.py [--seeds 4] [--days 2] [--check]``

Prints the fitted values (the shipped defaults in ``diloco.sim.grid`` must equal them;
``tests/test_simulate.py`` checks the ones it can afford to) and the residual table against
the paper's rows. Decoupled DiLoCo's numbers are not used (they are predictions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from diloco.sim import defaults
from diloco.sim.calibrate import fit_dp, fit_elastic
from diloco.sim.grid import PAPER_CHIPS, PAPER_DP, PAPER_DP_ELASTIC, SimConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--days", type=float, default=2.0, help="simulated days per seed")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless the fitted values equal the shipped defaults (diloco.sim.defaults)",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    base = replace(SimConfig(), horizon_s=args.days * 86400)
    dp_cfg, dp = fit_dp(base, args.seeds)
    el_cfg, el = fit_elastic(base, args.seeds)
    fitted = {
        "restart_s": dp_cfg.restart_s,
        "checkpoint_s": dp_cfg.checkpoint_s,
        "reconfig_s": el_cfg.reconfig_s,
        "recovery_mean_s": el_cfg.recovery.mean_s,
        "recovery_kind": el_cfg.recovery.kind,
        "slice_chips (assumed)": base.slice_chips,
    }
    rows = []
    for i, n in enumerate(PAPER_CHIPS):
        rows.append(
            {
                "chips": n,
                "dp_model": round(100 * dp[i], 1),
                "dp_paper": round(100 * PAPER_DP[i]),
                "dp_residual": round(100 * (dp[i] - PAPER_DP[i]), 1),
                "elastic_model": round(100 * el[i], 1),
                "elastic_paper": round(100 * PAPER_DP_ELASTIC[i]),
                "elastic_residual": round(100 * (el[i] - PAPER_DP_ELASTIC[i]), 1),
            }
        )
    seconds = time.perf_counter() - t0
    shipped = {
        "restart_s": defaults.FITTED_RESTART_S,
        "checkpoint_s": defaults.FITTED_CHECKPOINT_S,
        "reconfig_s": defaults.FITTED_RECONFIG_S,
        "recovery_mean_s": defaults.FITTED_RECOVERY_MEAN_S,
    }
    differ = {k: (fitted[k], v) for k, v in shipped.items() if fitted[k] != v}
    if args.json:
        out = {"fitted": fitted, "residuals": rows, "seconds": seconds, "differ": differ}
        print(json.dumps(out, indent=1))
    else:
        _print_table(fitted, rows, args, seconds)
        print("shipped defaults:", "equal" if not differ else f"DIFFER (fitted, shipped): {differ}")
    if args.check and differ:
        sys.exit(1)


def _print_table(fitted: dict, rows: list[dict], args: argparse.Namespace, seconds: float) -> None:
    print("fitted:", ", ".join(f"{k} = {v}" for k, v in fitted.items()))
    print(
        f"{'chips':>9} | {'dp':>6} {'paper':>5} {'resid':>6} | {'elastic':>7} {'paper':>5} {'resid':>6}"
    )
    for r in rows:
        print(
            f"{r['chips']:>9} | {r['dp_model']:>6} {r['dp_paper']:>5} {r['dp_residual']:>+6} | "
            f"{r['elastic_model']:>7} {r['elastic_paper']:>5} {r['elastic_residual']:>+6}"
        )
    print(f"({args.seeds} seeds x {args.days:g} days, {seconds:.0f} s)")


if __name__ == "__main__":
    main()

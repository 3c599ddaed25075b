"""Published targets, fitted defaults and fixed names: plain constants, no numpy.

Kept apart so that ``diloco --help`` and every ``diloco`` sub-command (learners and the
syncer parse the same command line) do not import the simulator to build their parser.
"""

from __future__ import annotations

from diloco.runtime.units import YEAR_S as YEAR_S  # one definition, re-exported

RECOVERY_KINDS = ("fixed", "exponential", "lognormal")
MODES = ("dp", "dp-elastic", "decoupled")

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_DP = (0.72, 0.57, 0.38, 0.27, 0.18)
"""Published data-parallel goodput without elasticity at ``PAPER_CHIPS``."""
PAPER_DP_ELASTIC = (0.88, 0.80, 0.69, 0.58, 0.40)
"""Published elastic data-parallel goodput at ``PAPER_CHIPS``."""
PAPER_DECOUPLED_M8_1_2M = 0.88
"""Published Decoupled DiLoCo goodput, M = 8 learners at 1.2M chips (a prediction here)."""
GRID_LEARNERS = (2, 4, 8, 16)

# Fitted by benchmarks/fit_simulator.py on the data-parallel rows only (docs/simulate.md).
FITTED_RESTART_S = 53.3
FITTED_CHECKPOINT_S = 69.3
FITTED_RECONFIG_S = 18.3
FITTED_RECOVERY_MEAN_S = 2170.0
ASSUMED_SLICE_CHIPS = 1024
"""Not identifiable from the published rows (only slice size × mean recovery is): a guess."""
ASSUMED_RECOVERY_KIND = "exponential"
"""Not identifiable either (only the mean enters): the distribution with fewest parameters."""
DEFAULT_HORIZON_S = 7 * 24 * 3600.0
DEFAULT_SEEDS = 8

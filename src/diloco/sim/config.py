"""The simulator's settings: the failure model and how long one cell runs (``diloco simulate``).

Each field is also a flag of ``diloco simulate`` (``diloco.runtime.schema``): its default and
its ``--help`` text are written here once. No numpy: every ``diloco`` process builds the
command line's parser, which reads these fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from diloco.runtime.schema import option
from diloco.runtime.units import parse_duration
from diloco.sim.defaults import (
    ASSUMED_RECOVERY_KIND,
    ASSUMED_SLICE_CHIPS,
    DEFAULT_HORIZON_S,
    FITTED_CHECKPOINT_S,
    FITTED_RECONFIG_S,
    FITTED_RECOVERY_MEAN_S,
    FITTED_RESTART_S,
    RECOVERY_KINDS,
    YEAR_S,
)


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """Distribution of the time a failed slice stays down (seconds)."""

    kind: str = option("lognormal", flag="--recovery-kind", choices=RECOVERY_KINDS)
    """Distribution of a slice's recovery time: ``fixed`` (always the mean), ``exponential``
    or ``lognormal``."""
    mean_s: float = option(600.0, flag="--recovery-mean", type=parse_duration, metavar="DURATION")
    """Mean recovery time of a slice (seconds, or e.g. 36m)."""
    sigma: float = option(1.0, flag="--recovery-sigma")
    """Shape of the lognormal (standard deviation of log-time); ignored otherwise."""

    def __post_init__(self) -> None:
        if self.kind not in RECOVERY_KINDS:
            raise ValueError(f"recovery kind {self.kind!r}: choose one of {RECOVERY_KINDS}")
        if not self.mean_s >= 0:
            raise ValueError(f"recovery mean must be >= 0 s, got {self.mean_s}")
        if not self.sigma >= 0:
            raise ValueError(f"lognormal sigma must be >= 0, got {self.sigma}")

    def draw(self, rng, n: int):
        """``n`` recovery times in seconds (a numpy array; ``rng`` a numpy ``Generator``)."""
        import numpy as np

        if self.kind == "fixed" or self.mean_s == 0:
            return np.full(n, float(self.mean_s))
        if self.kind == "exponential":
            return rng.exponential(self.mean_s, n)
        mu = np.log(self.mean_s) - 0.5 * self.sigma**2  # so that E[X] = mean_s
        return rng.lognormal(mu, self.sigma, n)


def _fitted_recovery() -> Recovery:
    return Recovery(kind=ASSUMED_RECOVERY_KIND, mean_s=FITTED_RECOVERY_MEAN_S)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Everything one simulated cell needs except the chip count, mode and seed (defaults:
    fitted on the paper's data-parallel rows, docs/simulate.md)."""

    slice_chips: int = option(ASSUMED_SLICE_CHIPS)
    """Chips taken down together by one chip failure (a slice)."""
    mtbi_s: float = option(YEAR_S, flag="--mtbi", type=parse_duration, metavar="DURATION")
    """Mean time between interruptions of one chip, seconds or e.g. 1y (the paper: one
    year)."""
    recovery: Recovery = field(default_factory=_fitted_recovery)
    """How long a failed slice stays down (matters to the elastic modes)."""
    restart_s: float = option(
        FITTED_RESTART_S, flag="--restart", type=parse_duration, metavar="DURATION"
    )
    """dp: stop after each failure (reschedule, restart, reload the checkpoint), seconds."""
    checkpoint_s: float = option(
        FITTED_CHECKPOINT_S, flag="--checkpoint-every", type=parse_duration, metavar="DURATION"
    )
    """dp: seconds of training between checkpoints (rollback on a stop)."""
    reconfig_s: float = option(
        FITTED_RECONFIG_S, flag="--reconfig", type=parse_duration, metavar="DURATION"
    )
    """Elastic modes: pause of a group when it loses a slice, seconds."""
    readd_s: float = option(0.0, flag="--readd", type=parse_duration, metavar="DURATION")
    """Elastic modes: pause of a group to add a recovered slice back, seconds."""
    speed_sigma: float = option(0.0)
    """Log-standard-deviation of slice speeds, lognormal (0: all slices equally fast)."""
    quorum: int = option(1)
    """Decoupled: K, the contributions a round needs."""
    horizon_s: float = option(
        DEFAULT_HORIZON_S, flag="--duration", type=parse_duration, metavar="DURATION"
    )
    """Simulated time per seed, seconds or e.g. 7d."""

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

"""The one duration grammar of the command line and the chaos specs."""

from __future__ import annotations

YEAR_S = 365.0 * 86400.0
"""A year in seconds (the unit ``y``): 365 days, as the simulator's chip MTBI is quoted."""

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "y": YEAR_S}
"""Suffixes and their length in seconds; a bare number is seconds."""


def parse_duration(text: str) -> float:
    """``90``, ``250ms``, ``90s``, ``15m``, ``2h``, ``7d``, ``1y`` -> seconds (>= 0).

    Raises ``ValueError`` naming the text for anything else (negative, NaN, no number).
    """
    t = text.strip().lower()
    scale = 1.0
    for unit in sorted(UNITS, key=len, reverse=True):  # "ms" before "m" and "s"
        if t.endswith(unit):
            scale, t = UNITS[unit], t[: -len(unit)]
            break
    try:
        value = float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (e.g. 250ms, 90s, 15m, 2h, 7d, 1y)") from None
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"{text!r}: durations must be >= 0")
    return value

"""The one duration grammar (the command line, the chaos specs), the one link-rate grammar
(``--wan``, ``diloco plan --link``) and the one size grammar (``--max-shard-size``, ``diloco
plan --syncer-memory``)."""

from __future__ import annotations

import re

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


RATE_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
"""Decimal prefixes of a rate (``50mbit`` is 50·10⁶ bits per second, as ``tc`` reads it)."""
GBIT_S = 1e9
"""A gigabit per second, in bits per second (``diloco plan --link``'s bare number)."""
UNSHAPED = ("none", "unshaped", "inf")
"""The spellings of "no rate limit" (where one is allowed)."""
_RATE = re.compile(
    r"(?P<number>(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*(?P<prefix>[kmgt]?)(?P<unit>bit/s|bits|bit|bps|b)?"
)
_RATE_EXAMPLES = "e.g. 50mbit, 1gbit, 200Mbps, 2.5g, 500kbit"


def parse_rate(
    text: str, *, bare_bps: float | None = None, unshaped_ok: bool = False
) -> float | None:
    """A link rate in bits per second (> 0). Case-insensitive.

    Grammar: a number, then a unit: a decimal prefix ``k``, ``m``, ``g`` or ``t`` (or none)
    followed by ``bit``, ``bps``, ``bit/s``, ``b`` or nothing: ``50mbit``, ``200Mbps``,
    ``1.5Gbit``, ``2.5g``, ``300kbit``, ``8000bit``. Every spelling counts *bits* (``bps`` is
    bits per second here, not ``tc``'s bytes). A bare number (no prefix, no unit) is
    ``number × bare_bps`` where the caller gives that scale (``diloco plan --link 0.5``: Gbit/s);
    without it a bare number is refused, as its unit would be a guess (``--wan rate=50``).
    ``none``, ``unshaped`` or ``inf`` give None when ``unshaped_ok``.
    Raises ``ValueError`` naming the text for anything else.
    """
    t = text.strip().lower()
    if t in UNSHAPED:
        if unshaped_ok:
            return None
        raise ValueError(f"{text!r}: a link rate must be a number of bits per second")
    match = _RATE.fullmatch(t)
    if match is None:
        raise ValueError(f"{text!r} is not a link rate ({_RATE_EXAMPLES})")
    number, prefix, unit = match["number"], match["prefix"], match["unit"]
    if not prefix and not unit:
        if bare_bps is None:
            raise ValueError(f"{text!r} is not a link rate: say its unit ({_RATE_EXAMPLES})")
        value = float(number) * bare_bps
    else:
        value = float(number) * RATE_PREFIXES[prefix]
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r}: a link rate must be > 0")
    return value


def format_rate(bps: float | None) -> str:
    """5e7 -> ``50mbit``; None -> ``none`` (:func:`parse_rate` and ``tc`` read it back)."""
    if bps is None:
        return "none"
    for prefix in ("g", "m", "k"):
        if bps >= RATE_PREFIXES[prefix]:
            return f"{bps / RATE_PREFIXES[prefix]:g}{prefix}bit"
    return f"{bps:g}bit"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1048576"`` -> bytes (> 0); ``ValueError`` otherwise."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    size = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").lower()])
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size

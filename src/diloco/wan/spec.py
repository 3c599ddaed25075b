"""What a wide-area link is: a rate and a round-trip time, per learner. Pure.

The grammar of ``--wan`` (repeatable; later specs override earlier ones for the learners they
name)::

    rate=50mbit,rtt=40ms          every learner's link
    2,3:rate=20mbit,rtt=80ms      the links of learners 2 and 3 (a slow site)
    rate=none                     unshaped (the harness, but no rate limit)

``rate``: a number with ``bit``, ``kbit``, ``mbit`` or ``gbit`` (per second, decimal units as
``tc`` reads them), or ``none``. ``rtt``: a duration (``diloco.runtime.units``; ``0`` for none).
A learner's link is shaped to ``rate`` in each direction (``up`` and ``down`` set them apart);
``rtt`` is the round trip between the learner and the syncer.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.runtime.units import parse_duration

RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
"""Rate suffixes in bits per second (longest match first)."""


@dataclass(frozen=True)
class LinkSpec:
    """One learner's link: rates in bits per second (None: unshaped) and the round trip."""

    up_bps: float | None = None
    """Learner to syncer."""
    down_bps: float | None = None
    """Syncer to learner."""
    rtt_s: float = 0.0

    @property
    def shaped(self) -> bool:
        return self.up_bps is not None or self.down_bps is not None

    def describe(self) -> str:
        """``50mbit/50mbit 40ms`` (up/down rate, round trip)."""
        return f"{format_rate(self.up_bps)}/{format_rate(self.down_bps)} {self.rtt_s * 1e3:g}ms"


def parse_rate(text: str) -> float | None:
    """``50mbit`` -> 5e7 bits/s; ``none`` -> None. Raises ValueError naming the text."""
    t = text.strip().lower()
    if t in ("none", "unshaped", "inf"):
        return None
    for unit in sorted(RATE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)]) * RATE_UNITS[unit]
            except ValueError:
                break
            if not value > 0:
                raise ValueError(f"{text!r}: a rate must be > 0 (or none)")
            return value
    raise ValueError(f"{text!r} is not a rate (e.g. 20mbit, 1gbit, 500kbit, none)")


def format_rate(bps: float | None) -> str:
    """5e7 -> ``50mbit``; None -> ``none`` (``tc`` reads it back)."""
    if bps is None:
        return "none"
    for unit, scale in RATE_UNITS.items():
        if bps >= scale and unit != "bit":
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


def parse_link(text: str, base: LinkSpec | None = None) -> LinkSpec:
    """``rate=50mbit,rtt=40ms`` (keys ``rate``, ``up``, ``down``, ``rtt``) on top of ``base``."""
    up, down, rtt = (base.up_bps, base.down_bps, base.rtt_s) if base else (None, None, 0.0)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--wan: {item!r} is not key=value (rate=, up=, down=, rtt=)")
        key = key.strip().lower()
        if key == "rate":
            up = down = parse_rate(value)
        elif key == "up":
            up = parse_rate(value)
        elif key == "down":
            down = parse_rate(value)
        elif key == "rtt":
            rtt = parse_duration(value)
        else:
            raise ValueError(f"--wan: unknown key {key!r} (rate, up, down, rtt)")
    return LinkSpec(up, down, rtt)


def plan_links(specs: list[str], learners: int) -> list[LinkSpec]:
    """Each learner's link from the ``--wan`` specs (in order; ``I,J:...`` names learners)."""
    if learners < 1:
        raise ValueError("--wan needs at least one learner")
    links = [LinkSpec()] * learners
    for spec in specs:
        head, sep, body = spec.partition(":")
        if sep and "=" not in head:
            targets = _indices(head, learners)
        else:
            targets, body = list(range(learners)), spec
        for i in targets:
            links[i] = parse_link(body, links[i])
    return links


def _indices(text: str, learners: int) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            i = int(part)
        except ValueError:
            raise ValueError(f"--wan: {part!r} is not a learner index") from None
        if not 0 <= i < learners:
            raise ValueError(f"--wan: learner {i} does not exist (M = {learners})")
        out.append(i)
    return out

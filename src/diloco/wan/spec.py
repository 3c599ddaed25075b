"""What a wide-area link is: a rate and a round-trip time, per learner. Pure.

The grammar of ``--wan`` (repeatable; later specs override earlier ones for the learners they
name)::

    rate=50mbit,rtt=40ms          every learner's link
    2,3:rate=20mbit,rtt=80ms      the links of learners 2 and 3 (a slow site)
    rate=none                     unshaped (the harness, but no rate limit)

``rate``: bits per second with a unit (``50mbit``, ``1gbit``, ``500kbit``, decimal as ``tc``
reads them; the grammar is ``diloco.runtime.units.parse_rate``), or ``none``. ``rtt``: a duration (``diloco.runtime.units``; ``0`` for none).
A learner's link is shaped to ``rate`` in each direction (``up`` and ``down`` set them apart);
``rtt`` is the round trip between the learner and the syncer.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.runtime.units import format_rate, parse_duration, parse_rate


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


def parse_link(text: str, base: LinkSpec | None = None) -> LinkSpec:
    """``rate=50mbit,rtt=40ms`` (keys ``rate``, ``up``, ``down``, ``rtt``) on top of ``base``."""
    up, down, rtt = (base.up_bps, base.down_bps, base.rtt_s) if base else (None, None, 0.0)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--wan: {item!r} is not key=value (rate=, up=, down=, rtt=)")
        key = key.strip().lower()
        if key == "rate":
            up = down = parse_rate(value, unshaped_ok=True)
        elif key == "up":
            up = parse_rate(value, unshaped_ok=True)
        elif key == "down":
            down = parse_rate(value, unshaped_ok=True)
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

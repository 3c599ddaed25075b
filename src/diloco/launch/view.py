"""The live terminal view of ``diloco run``: one line per learner, one for the global model."""

from __future__ import annotations

import sys


def render(snapshot: dict) -> list[str]:
    """Lines for one frame. ``snapshot`` has ``elapsed``, ``val_loss``, ``rounds``, ``bytes_up``,
    ``bytes_down`` and ``learners`` (each ``id``, ``step``, ``tokens``, ``tokens_per_s``,
    ``state``)."""
    loss = snapshot.get("val_loss")
    lines = [
        f"diloco  {snapshot['elapsed']:6.1f}s  held-out loss "
        f"{'  -  ' if loss is None else f'{loss:.3f}'}  rounds {snapshot['rounds']}  "
        f"up {snapshot['bytes_up'] / 1e6:.2f} MB  down {snapshot['bytes_down'] / 1e6:.2f} MB",
        f"  {'learner':<12} {'step':>7} {'tokens':>11} {'tok/s':>8}  state",
    ]
    for ln in snapshot["learners"]:
        lines.append(
            f"  {ln['id']:<12} {ln['step']:>7} {ln['tokens']:>11,} "
            f"{ln['tokens_per_s']:>8.0f}  {ln['state']}"
        )
    return lines


class LiveView:
    """Redraws in place on a terminal; elsewhere prints one frame every ``plain_every`` s."""

    def __init__(self, stream=None, *, enabled: bool = True, plain_every: float = 10.0):
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.plain_every = plain_every
        self._drawn = 0
        self._last_plain = -1e9

    def update(self, snapshot: dict) -> None:
        if not self.enabled:
            return
        lines = render(snapshot)
        if self.tty:
            up = f"\x1b[{self._drawn}F" if self._drawn else ""
            self.stream.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            self._drawn = len(lines)
        elif snapshot["elapsed"] - self._last_plain >= self.plain_every:
            self._last_plain = snapshot["elapsed"]
            self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

"""The live terminal view of ``diloco run``: progress towards the budget, one line per learner,
one for the global model.

On a terminal it is redrawn in place with ``rich`` (a progress bar with the time remaining
and a table); elsewhere (a pipe, a log file) a plain frame is printed every ``plain_every``
seconds.
"""

from __future__ import annotations

import sys


def progress(
    elapsed: float,
    *,
    budget_s: float | None = None,
    tokens: int = 0,
    token_budget: int = 0,
    steps: int = 0,
    step_budget: int = 0,
) -> tuple[float | None, float | None]:
    """``(fraction done, seconds left)`` towards whichever budget ends the run first (time,
    tokens, or the slowest learner's steps), or ``(None, None)`` without a budget. The time
    left of a token or step budget assumes the pace so far.

    >>> progress(60.0, budget_s=180.0)
    (0.3333333333333333, 120.0)
    >>> progress(10.0, token_budget=1000, tokens=250)
    (0.25, 30.0)
    >>> progress(10.0)
    (None, None)
    """
    fractions = []
    if budget_s:
        fractions.append(elapsed / budget_s)
    if token_budget:
        fractions.append(tokens / token_budget)
    if step_budget:
        fractions.append(steps / step_budget)
    if not fractions:
        return None, None
    done = min(1.0, max(fractions))
    if budget_s and done == elapsed / budget_s:
        return done, max(0.0, budget_s - elapsed)
    return done, (elapsed * (1 - done) / done) if done > 0 else None


def clock(seconds: float | None) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def render(snapshot: dict) -> list[str]:
    """Plain lines for one frame. ``snapshot`` has ``elapsed``, ``val_loss``, ``rounds``,
    ``bytes_up``, ``bytes_down``, ``learners`` (each ``id``, ``step``, ``tokens``,
    ``tokens_per_s``, ``state``) and optionally ``done`` and ``left`` (from :func:`progress`)."""
    loss = snapshot.get("val_loss")
    done = snapshot.get("done")
    lines = [
        f"diloco  {snapshot['elapsed']:6.1f}s  held-out loss "
        f"{'  -  ' if loss is None else f'{loss:.3f}'}  rounds {snapshot['rounds']}  "
        f"up {snapshot['bytes_up'] / 1e6:.2f} MB  down {snapshot['bytes_down'] / 1e6:.2f} MB"
        + ("" if done is None else f"  {100 * done:.0f}% ({clock(snapshot.get('left'))} left)"),
        f"  {'learner':<12} {'step':>7} {'tokens':>11} {'tok/s':>8}  state",
    ]
    for ln in snapshot["learners"]:
        lines.append(
            f"  {ln['id']:<12} {ln['step']:>7} {ln['tokens']:>11,} "
            f"{ln['tokens_per_s']:>8.0f}  {ln['state']}"
        )
    return lines


def rich_frame(snapshot: dict):
    """The terminal frame: a progress bar with the time left, the model line, the table."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    loss = snapshot.get("val_loss")
    done, left = snapshot.get("done"), snapshot.get("left")
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text("diloco", style="bold"),
        ProgressBar(total=1.0, completed=done or 0.0, width=30)
        if done is not None
        else Text("no budget"),
        Text(
            f"{clock(snapshot['elapsed'])} elapsed"
            + ("" if done is None else f", {clock(left)} left ({100 * done:.0f}%)")
        ),
    )
    model = Text(
        f"global model: held-out loss {'-' if loss is None else f'{loss:.3f}'} nats/byte, "
        f"{snapshot['rounds']:,} rounds, up {snapshot['bytes_up'] / 1e6:.2f} MB, "
        f"down {snapshot['bytes_down'] / 1e6:.2f} MB"
    )
    table = Table(box=None, pad_edge=False, header_style="dim")
    for name, justify in (("learner", "left"), ("step", "right"), ("tokens", "right")):
        table.add_column(name, justify=justify)
    table.add_column("tok/s", justify="right")
    table.add_column("state")
    for ln in snapshot["learners"]:
        down = any(w in ln["state"] for w in ("down", "hung", "not live"))
        table.add_row(
            ln["id"],
            f"{ln['step']:,}",
            f"{ln['tokens']:,}",
            f"{ln['tokens_per_s']:,.0f}",
            Text(ln["state"], style="red" if down else "green"),
        )
    return Group(head, model, table)


class LiveView:
    """Redraws in place on a terminal (``rich``); elsewhere prints one plain frame every
    ``plain_every`` s. Call :meth:`close` when the run stops (leaves the last frame)."""

    def __init__(self, stream=None, *, enabled: bool = True, plain_every: float = 10.0):
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.plain_every = plain_every
        self._last_plain = -1e9
        self._live = None

    def update(self, snapshot: dict) -> None:
        if not self.enabled:
            return
        if self.tty:
            if self._live is None:
                from rich.console import Console
                from rich.live import Live

                console = Console(file=self.stream)
                self._live = Live(console=console, auto_refresh=False, transient=False)
                self._live.start()
            self._live.update(rich_frame(snapshot), refresh=True)
        elif snapshot["elapsed"] - self._last_plain >= self.plain_every:
            self._last_plain = snapshot["elapsed"]
            self.stream.write("\n".join(render(snapshot)) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

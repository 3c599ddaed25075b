"""The modes ``diloco run`` can run, as a registry a program fills.

The launcher runs ``decoupled`` and ``sync`` itself. Another mode (the data-parallel
baseline, ``--mode dp``) lives in a package above the launcher (``diloco.baselines``) that
registers it here when imported: the launcher asks the registry and never imports a
baseline. ``diloco run`` imports the baselines first (``diloco.cli.run``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """A mode run by another program than the launcher's own supervisor loop."""

    name: str
    run: Callable[..., int]
    """``run(config, *, recipe, plans, chaos, run_dir, tape, fabric, outputs)``: the exit
    status."""
    check_chaos: Callable[[list], None] = lambda clauses: None
    """Raise ``ValueError`` for the chaos clauses the mode cannot carry out."""


OWN_MODES = ("decoupled", "sync")
"""The modes the launcher runs itself."""
_REGISTERED: dict[str, Mode] = {}


def register(mode: Mode) -> None:
    """Make ``mode`` available to ``diloco run --mode NAME``."""
    _REGISTERED[mode.name] = mode


def registered(name: str) -> Mode | None:
    """The registered mode ``name``; None for the launcher's own modes. ``ValueError`` for a
    mode no package registered (its package was not imported)."""
    if name in OWN_MODES:
        return None
    mode = _REGISTERED.get(name)
    if mode is None:
        raise ValueError(
            f"mode {name!r} is not registered: import the package that provides it "
            "(diloco.baselines for dp) before running"
        )
    return mode

"""Optional packages (the ``diloco[...]`` extras): imported only where they are used, and
where one is missing the error says which extra to install, in one line."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra that brings it."""


def import_optional(module: str, extra: str, needed_by: str) -> ModuleType:
    """``import module`` for ``needed_by`` (what the user asked for, e.g. ``--wandb offline``),
    or ``MissingExtra``: "NEEDED_BY needs PACKAGE: pip install 'diloco[EXTRA]'". A package
    that is installed and fails to import for another reason raises as it does."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        raise MissingExtra(
            f"{needed_by} needs the {top} package: pip install 'diloco[{extra}]'", name=exc.name
        ) from None

"""A copy of a directory that a running process writes (a backup of a live syncer's state
directory, as an operator's tool would take it)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from diloco.runtime.atomic_files import TMP_SUFFIX

LIVE_COPY_ATTEMPTS = 10
"""Copies of a live directory tried before ``copy_live_directory`` gives up."""


def copy_live_directory(
    source: Path, target: Path, *, copy_function: Callable = shutil.copy2
) -> None:
    """Copy the directory ``source``, which a running process writes, to ``target`` (its
    ``*.tmp`` files left out), as a backup tool would: a file deleted between the listing and
    its copy (a journal segment a new snapshot covered) makes the copy start again, up to
    ``LIVE_COPY_ATTEMPTS`` times; then the last ``shutil.Error`` is raised. A copy that lost
    nothing holds every file of one listing: what the directory held then, or newer."""
    for attempt in range(LIVE_COPY_ATTEMPTS):
        shutil.rmtree(target, ignore_errors=True)
        try:
            shutil.copytree(
                source,
                target,
                ignore=shutil.ignore_patterns("*" + TMP_SUFFIX),
                copy_function=copy_function,
            )
            return
        except shutil.Error:
            if attempt == LIVE_COPY_ATTEMPTS - 1:
                raise

"""A user's model named on the command line: ``MODULE:CALLABLE``.

``diloco syncer --model train_model:build`` and ``diloco export --model ...`` import
``MODULE`` (from the working directory first, then the usual path) and call ``CALLABLE()``
with no arguments; it must return a ``torch.nn.Module`` built exactly as every learner builds
it (same parameter names, shapes and dtypes, and, for the global model to start from the
learners' values, the same seed).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ModelRefError(ValueError):
    """A ``MODULE:CALLABLE`` that cannot give a model (said why)."""


def check_model_ref(ref: str) -> str:
    """``ref`` if it reads ``MODULE:CALLABLE`` (dotted names), else ``ModelRefError``."""
    if not _REF.match(ref or ""):
        raise ModelRefError(f"--model wants MODULE:CALLABLE (e.g. my_model:build), got {ref!r}")
    return ref


def load_model(ref: str) -> nn.Module:
    """Import ``MODULE`` of ``ref`` and return ``CALLABLE()``; every failure (no such module,
    no such name, the call raising, not a module) is a ``ModelRefError`` naming ``ref``.
    Imports torch (:func:`check_model_ref` does not: the command line checks a flag with it)."""
    from torch import nn

    from diloco.runtime.modules import plain_module

    module_name, _, attribute = check_model_ref(ref).partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelRefError(f"--model {ref}: cannot import {module_name!r} ({exc})") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelRefError(f"--model {ref}: {module_name} has no {attribute!r}") from None
    if not callable(target):
        raise ModelRefError(f"--model {ref}: {attribute} is not callable")
    try:
        model = target()
    except Exception as exc:  # the user's code: any failure is theirs to read
        raise ModelRefError(f"--model {ref}: {attribute}() raised {exc!r}") from None
    if not isinstance(model, nn.Module):
        raise ModelRefError(
            f"--model {ref}: {attribute}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    return plain_module(model)

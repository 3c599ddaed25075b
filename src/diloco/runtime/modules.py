"""What a model is once ``torch.compile`` has wrapped it."""

from __future__ import annotations

from torch import nn


def plain_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``model`` itself.

    A compiled model names its parameters ``_orig_mod.<name>``; the module it wraps holds
    the very same tensors under their own names, which are the names every learner and the
    syncer agree on. So a Learner, a syncer or an export may be given a model before or
    after ``torch.compile``: training the compiled one trains the parameters they see."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model

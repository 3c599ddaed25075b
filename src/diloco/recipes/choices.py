"""The names a recipe is chosen by, checked without importing torch: the command line parses
and checks its flags with this module alone (torch loads only when something trains)."""

from __future__ import annotations

INNER_OPTIMIZERS = ("adamw", "muon")
"""The values of ``--inner-optimizer``."""


def check_inner_optimizer(name: str) -> str:
    """``name`` if it is one of :data:`INNER_OPTIMIZERS` this torch provides, else ValueError
    saying why (``torch.optim.Muon`` exists from torch 2.9 on; torch is imported only to
    check ``muon``)."""
    if name not in INNER_OPTIMIZERS:
        raise ValueError(f"inner optimizer {name!r}: choose one of {', '.join(INNER_OPTIMIZERS)}")
    if name == "muon":
        import torch

        if not hasattr(torch.optim, "Muon"):
            raise ValueError(
                f"--inner-optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch "
                f"{torch.__version__}"
            )
    return name

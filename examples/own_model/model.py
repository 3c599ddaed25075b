"""The example's model: any ``torch.nn.Module``, built the same way by the syncer
(``diloco syncer --model model:build``) and by every learner (``train.py``), and its
held-out loss (``diloco launch --eval model:held_out``)."""

import torch
from torch import nn


def build() -> nn.Module:
    torch.manual_seed(0)  # the syncer and every learner start from the same values
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


TARGET = torch.linspace(-1, 1, 16)
"""The function every site learns: y = x · TARGET (each site draws its own x)."""


def held_out(model: nn.Module) -> torch.Tensor:
    """The mean squared error on 1,024 points no site trains on."""
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        return ((model(x).squeeze(-1) - x @ TARGET) ** 2).mean()

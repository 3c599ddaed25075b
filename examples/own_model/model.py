"""The example's model: any ``torch.nn.Module``, built the same way by the syncer
(``diloco syncer --model model:build``) and by every learner (``train.py``)."""

import torch
from torch import nn


def build() -> nn.Module:
    torch.manual_seed(0)  # the syncer and every learner start from the same values
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

"""What every recipe provides: the contract between a recipe and the processes that train it.

A recipe is everything a learner, a data-parallel rank, the syncer and the evaluator must
agree on: the model and its initial parameters (a pure function of the seed), the inner
optimizer and its learning-rate schedule, the training batches of each learner, the loss of a
batch, how many tokens a batch counts for (the merge weights and the bytes-per-token measure
use it), and the held-out evaluation. :class:`Recipe` holds what they share; a concrete recipe
(:mod:`diloco.recipes.language`, :mod:`diloco.recipes.digits`) adds its data and model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.recipes.optimizers import build_inner_optimizer


class Stream(Protocol):
    """A learner's training batches; its position is its ``state_dict`` (checkpointed)."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(kw_only=True)
class Recipe:
    """The shared part of a recipe: its name, batch size and inner optimizer (AdamW, or Muon
    with AdamW, with a linear warm-up and a cosine decay). Subclasses implement the methods that raise
    ``NotImplementedError``."""

    name: str
    batch_size: int = 8
    lr: float = 3e-3
    optimizer: str = "adamw"
    """The inner optimizer: ``adamw``, or ``muon`` (:mod:`diloco.recipes.optimizers`)."""
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    loss_unit: str = "nats/token"
    """What one unit of :meth:`evaluate` is (printed beside the held-out loss)."""

    # ------------------------------------------------------------------ to implement
    @property
    def tokens_per_sample(self) -> int:
        """Tokens one sample of a batch counts for (a text window: its length; an image: 1)."""
        raise NotImplementedError

    def load_data(self):
        """Read and validate the data once (``DataError`` with a clear message)."""
        raise NotImplementedError

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        """The model with its initial parameters (a pure function of the seed)."""
        raise NotImplementedError

    def stream(self, *, learner_id: int, seed: int = 0, batch_size: int | None = None) -> Stream:
        """The training batches of learner ``learner_id`` (independent of other learners)."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        """The training loss of ``batch`` (a scalar to call ``backward`` on)."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module) -> float:
        """Held-out loss of ``model`` (in ``loss_unit``), on the same data every time."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def scores(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out measures besides the loss (e.g. ``{"accuracy": 0.93}``); none by default."""
        return {}

    def tokens(self, batch) -> int:
        """Tokens ``batch`` counts for: samples × ``tokens_per_sample``."""
        return int(batch[0].shape[0]) * self.tokens_per_sample

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The inner optimizer :attr:`optimizer` names (``diloco.recipes.optimizers``): AdamW,
        or Muon for the hidden matrices with AdamW for the rest; no weight decay on biases,
        norms and position embeddings (``pos_emb``)."""
        return build_inner_optimizer(
            self.optimizer,
            model,
            lr=self.lr,
            weight_decay=self.weight_decay,
            no_decay=lambda name, p: p.dim() < 2 or "pos_emb" in name,
        )

    def lr_at(self, step: int, total_steps: int = 0) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio·lr`` over ``total_steps``.

        ``total_steps = 0`` (unknown length) keeps the peak rate after warm-up.
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if total_steps <= self.warmup_steps:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (total_steps - self.warmup_steps))
        floor = self.min_lr_ratio
        return self.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

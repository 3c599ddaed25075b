"""Byte-level language models on text (Shakespeare's plays by default, or ``--data FILE``).

Three architectures share the data, the batches and the evaluation (held-out loss in nats per
byte on fixed windows):

* ``gpt``: the small GPT of :mod:`diloco.recipes.gpt` (tied input and output embedding);
* ``hf-gpt2``: Hugging Face ``transformers``' ``GPT2LMHeadModel`` built from a config with a
  256-byte vocabulary (random init; no tokenizer and nothing downloaded);
* ``moe``: the mixture-of-experts transformer of :mod:`diloco.recipes.moe`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from diloco.recipes.base import Recipe
from diloco.recipes.gpt import GPT, GPTConfig
from diloco.recipes.text import (
    BatchStream,
    DataError,
    TextCorpus,
    heldout_windows,
    load_shakespeare,
    load_text_file,
)


class RecipeUnavailable(DataError):
    """A recipe whose optional dependency is not installed (the message says what to install)."""


def build_hf_gpt2(cfg: GPTConfig) -> torch.nn.Module:
    """``GPT2LMHeadModel`` of ``cfg``'s sizes, tied embeddings, no dropout, random init."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise RecipeUnavailable(
            "the hf-gpt2 recipe needs Hugging Face transformers: pip install 'diloco[recipes]'"
        ) from None
    config = GPT2Config(
        vocab_size=cfg.vocab,
        n_positions=cfg.seq_len,
        n_embd=cfg.dim,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,  # GPT-2's 50256 lies outside a byte vocabulary
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def _own_logits(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)[1]


def _hf_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _build_moe(cfg: GPTConfig) -> torch.nn.Module:
    from diloco.recipes.moe import MoEGPT

    return MoEGPT(cfg)


ARCHITECTURES: dict[str, tuple[Callable, Callable]] = {
    "gpt": (GPT, _own_logits),
    "hf-gpt2": (build_hf_gpt2, _hf_loss),
    "moe": (_build_moe, _own_logits),
}
"""Architecture -> (build the model from its config, loss of ``(model, x, y)``)."""


@dataclass(kw_only=True)
class TextRecipe(Recipe):
    """A byte-level language model of ``architecture`` and sizes ``model`` on a text corpus
    (``data_path=None``: Shakespeare's plays)."""

    model: GPTConfig
    architecture: str = "gpt"
    eval_windows: int = 64
    data_path: str | None = None
    loss_unit: str = "nats/byte"
    _corpus: TextCorpus | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}")

    @property
    def tokens_per_sample(self) -> int:
        return self.model.seq_len

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

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return ARCHITECTURES[self.architecture][0](self.model)

    def stream(
        self, *, learner_id: int, seed: int = 0, batch_size: int | None = None
    ) -> BatchStream:
        return BatchStream(
            self.corpus.train,
            seq_len=self.model.seq_len,
            batch_size=batch_size or self.batch_size,
            seed=seed,
            learner=learner_id,
        )

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return ARCHITECTURES[self.architecture][1](model, x, y)

    @cached_property
    def heldout(self) -> tuple[torch.Tensor, torch.Tensor]:
        return heldout_windows(self.corpus.val, self.model.seq_len, self.eval_windows)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batch: int = 16) -> float:
        """Mean held-out loss (nats per byte) on fixed windows, in eval mode."""
        was_training = model.training
        model.eval()
        x, y = self.heldout
        total = 0.0
        for i in range(0, x.shape[0], batch):
            chunk = (x[i : i + batch], y[i : i + batch])
            total += float(self.loss(model, chunk)) * chunk[0].shape[0]
        model.train(was_training)
        return total / x.shape[0]

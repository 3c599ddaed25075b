"""A small CNN on scikit-learn's handwritten digits (the ``digits`` recipe).

``sklearn.datasets.load_digits`` ships 1,797 grey 8×8 images of the digits 0-9 inside the
package (nothing is downloaded). The last 20% of a fixed shuffle (seed 0) is held out; pixels
are scaled to [0, 1]. The model: two 3×3 convolutions (16 and 32 channels, ReLU), a 2×2
max-pool, and a linear classifier; the loss is cross-entropy in nats per image, and the
held-out accuracy is reported beside it. A sample counts as one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from diloco.recipes.base import Recipe
from diloco.recipes.text import DataError, SeededStream

HOLDOUT = 0.2


class DigitsCNN(nn.Module):
    """``model(x)`` returns the logits of the 10 classes for images ``x`` of shape (B, 1, 8, 8)."""

    def __init__(self, channels: tuple[int, int] = (16, 32)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.classifier = nn.Linear(channels[1] * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.classifier(h.flatten(1))


def load_digits_split() -> tuple[
    tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]:
    """``((train x, train y), (held-out x, held-out y))``; ``DataError`` without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        from diloco.recipes.language import RecipeUnavailable

        raise RecipeUnavailable(
            "the digits recipe needs scikit-learn: pip install 'diloco[recipes]'"
        ) from None
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = len(y) - int(len(y) * HOLDOUT)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


class ImageStream(SeededStream):
    """Random training batches of images for one learner (a
    :class:`~diloco.recipes.text.SeededStream`, as the text recipes' ``BatchStream``)."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int, seed: int, learner: int
    ):
        if len(y) < 1:
            raise DataError("no training images")
        super().__init__(seed=seed, learner=learner)
        self.x, self.y = x, y
        self.batch_size = batch_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, len(self.y), (self.batch_size,), generator=self.next_generator())
        return self.x[rows], self.y[rows]


@dataclass(kw_only=True)
class DigitsRecipe(Recipe):
    """The CNN of :class:`DigitsCNN` on scikit-learn's digits."""

    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 10
    loss_unit: str = "nats/image"
    data_path: str | None = None
    _split: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.data_path is not None:
            raise DataError("the digits recipe has its own data: --data does not apply")

    @property
    def tokens_per_sample(self) -> int:
        return 1

    def load_data(self):
        if self._split is None:
            self._split = load_digits_split()
        return self._split

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return DigitsCNN()

    def stream(
        self, *, learner_id: int, seed: int = 0, batch_size: int | None = None
    ) -> ImageStream:
        (x, y), _ = self.load_data()
        return ImageStream(
            x, y, batch_size=batch_size or self.batch_size, seed=seed, learner=learner_id
        )

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def _heldout_logits(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = model.training
        model.eval()
        _, (x, y) = self.load_data()
        logits = model(x)
        model.train(was_training)
        return logits, y

    def evaluate(self, model: torch.nn.Module) -> float:
        """Held-out cross-entropy in nats per image."""
        logits, y = self._heldout_logits(model)
        return float(F.cross_entropy(logits, y))

    def scores(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out accuracy."""
        logits, y = self._heldout_logits(model)
        return {"accuracy": float((logits.argmax(dim=1) == y).float().mean())}

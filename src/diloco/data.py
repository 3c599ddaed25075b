"""A data position a checkpoint can carry: ``StatefulSampler``, a seeded shuffle that knows
how far it got.

    sampler = diloco.StatefulSampler(len(dataset), seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    learner = diloco.Learner(model, optimizer, syncer=..., state=saved)
    learner.track(sampler)      # its position is in learner.state_dict(), restored from saved

A learner restarted from its checkpoint then draws the samples that follow the checkpoint's,
neither repeating nor skipping any (docs/own-model.md, "Data exactly once"). The position
counts the indices handed out, so it is exact when the loader takes them as it trains: a
``DataLoader`` with ``num_workers=0`` does; one with workers fetches batches ahead, so track
the loader instead (``torchdata``'s ``StatefulDataLoader`` has the same two methods).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StatefulSampler(Sampler[int]):
    """The indices ``0..num_samples-1`` in a new seeded order each epoch (epoch ``e`` is
    ``torch.randperm(num_samples)`` drawn from ``seed + e``), resumable mid-epoch.

    Each ``iter`` goes on from the position (the start of the next epoch once one is
    complete); ``state_dict`` is ``{"epoch", "position", "num_samples", "seed"}`` and
    ``load_state_dict`` takes it back (``ValueError`` for another dataset size or seed:
    the position would mean other samples)."""

    def __init__(self, num_samples: int, *, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"StatefulSampler needs at least one sample, got {num_samples}")
        self.num_samples, self.seed = num_samples, seed
        self.epoch = 0
        """The epoch being drawn."""
        self.position = 0
        """Indices of this epoch handed out so far."""

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the indices."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position < self.num_samples:
            index = order[self.position]
            self.position += 1  # (counted as handed out: a checkpoint from now on skips it)
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["num_samples"], state["seed"]) != (self.num_samples, self.seed):
            raise ValueError(
                f"sampler state of {state['num_samples']} samples, seed {state['seed']}: "
                f"this sampler has {self.num_samples}, seed {self.seed}"
            )
        if not 0 <= state["position"] <= self.num_samples or state["epoch"] < 0:
            raise ValueError(f"sampler state out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

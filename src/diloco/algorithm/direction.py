"""The direction check of a round (``SyncerConfig.direction_floor``): each delta's cosine with
the coordinate-wise median of the round's deltas, on the whole fragment or on indices drawn
afresh every round from the operating system's entropy. Beside the norm guard
(``diloco.algorithm.guard``), which bounds a delta's size, this bounds its direction."""

from __future__ import annotations

import secrets

import torch

from diloco.algorithm.encoded_delta import EncodedDelta

DIRECTION_WHOLE = 1 << 17
"""Fragments of at most this many values are compared whole by the direction check.

Measured (2026-11-26, one CPU thread of the 2-core dev machine, median + cosines of M
deltas, best of 7): whole 131,072 values 10 / 15 / 20 ms at M = 4 / 6 / 8, 262,144 values
19 / 32 / 38 ms, 1e6 values 77 / 118 / 155 ms, 1e7 values 1.5 / 3.3 s (M = 4 / 8); a random
sample of 65,536 costs 5-12 ms at any size up to 1e6, 19-30 ms at 1e7. Up to 2^17 the whole
comparison costs at most twice the sample's, beyond it grows without bound, and the check
runs under the syncer's lock."""
DIRECTION_SAMPLE = 1 << 16
"""Values a larger fragment is compared on, at indices drawn afresh for every round."""


def secret_generator() -> torch.Generator:
    """A generator seeded from the operating system's entropy (``secrets``), never from
    anything a learner knows or sends: the direction check's indices for one round."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def direction_sample(numel: int, generator: torch.Generator) -> torch.Tensor | None:
    """The indices the direction check compares a fragment of ``numel`` values on: ``None``
    (the whole vector) up to ``DIRECTION_WHOLE``, else ``DIRECTION_SAMPLE`` indices drawn
    uniformly (with replacement) from ``generator``. Pure: same generator state, same
    indices. Why random: the fragment size is public, so a delta that agrees with the round
    on fixed (evenly strided) indices and is reversed elsewhere passed a check on those
    (cosine +0.98 there, −0.5 in truth); on indices it cannot predict, its sampled cosine is
    an unbiased estimate of the true one (±~0.01 at 65,536 values)."""
    if numel <= DIRECTION_WHOLE:
        return None
    return torch.randint(numel, (DIRECTION_SAMPLE,), generator=generator)


def _values(delta: torch.Tensor | EncodedDelta, indices: torch.Tensor | None) -> torch.Tensor:
    """``delta``'s values (float32, flat) at ``indices``, or all of them (``None``): an
    ``EncodedDelta`` read at those indices only."""
    if isinstance(delta, EncodedDelta):
        return delta.decoded() if indices is None else delta.at(indices)
    flat = delta.reshape(-1)
    return (flat if indices is None else flat[indices]).float()


def consensus_cosines(
    deltas: list[torch.Tensor | EncodedDelta], generator: torch.Generator | None = None
) -> list[float]:
    """Each delta's cosine with the coordinate-wise median of all of them.

    The direction check of a round (``SyncerConfig.direction_floor``): a median has no use
    for the merge weights, which are claims, and a minority cannot move it, so a delta that
    points away from what most of the round agrees on (a reversed or an unrelated one, at any
    size and any claimed weight) has a negative cosine while the honest majority's are
    positive. Fragments of at most ``DIRECTION_WHOLE`` values are compared whole, larger ones
    on ``direction_sample(numel, generator)`` (pass a fresh ``secret_generator()`` per round;
    required for them). Needs at least 3 deltas (a median of two is their mean).
    """
    if len(deltas) < 3:
        raise ValueError(f"the direction check needs at least 3 deltas, got {len(deltas)}")
    numel = deltas[0].numel()
    if numel > DIRECTION_WHOLE and generator is None:
        raise ValueError(
            f"a fragment of {numel} values is compared on a random sample: pass a generator "
            "(direction.secret_generator())"
        )
    indices = direction_sample(numel, generator) if generator is not None else None
    sample = torch.stack([_values(d, indices) for d in deltas])
    median = sample.median(dim=0).values
    cosines = torch.nn.functional.cosine_similarity(sample, median.unsqueeze(0), dim=1)
    return [float(c) for c in cosines]

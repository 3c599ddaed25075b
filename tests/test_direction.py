"""The direction check's sample: a delta built against indices a learner can predict."""

from __future__ import annotations

import pytest
import torch
from kit import join_state, syncer_state, tiny_model

from diloco.algorithm.direction import (
    DIRECTION_SAMPLE,
    DIRECTION_WHOLE,
    consensus_cosines,
    direction_sample,
    secret_generator,
)
from diloco.syncer.config import SyncerConfig


def honest_deltas(n: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` deltas sharing half their direction (pairwise cosine ~0.5)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=gen)
    return [0.01 * (0.5**0.5) * (common + torch.randn(n, generator=gen)) for _ in range(count)]


def strided_attack(honest: list[torch.Tensor], stride: int = 0) -> torch.Tensor:
    """Agrees with the honest mean on the evenly strided indices the check used to compare
    (the fragment size is public; ``stride``: the old check's) and is reversed elsewhere."""
    stride = stride or max(1, -(-honest[0].numel() // DIRECTION_SAMPLE))
    mean = torch.stack(honest).mean(0)
    attack = -mean
    attack[::stride] = mean[::stride]
    return attack


def test_a_delta_reversed_off_the_strided_indices_is_left_out_of_the_round():
    model = tiny_model(0, (512, 512))  # 262,656 values: more than the sample
    config = SyncerConfig(schedule="learner", quorum=4, outer_lr=1.0, outer_momentum=0.0)
    state, layout, events = syncer_state(model, config, num_fragments=1)
    n = layout.fragments[0].numel
    assert n > 2 * DIRECTION_SAMPLE
    ids = ["honest-0", "honest-1", "honest-2", "mallory"]
    for lid in ids:
        join_state(state, lid)
    honest = honest_deltas(n, 3)
    attack = strided_attack(honest)
    mean = torch.stack(honest).mean(0)
    assert torch.nn.functional.cosine_similarity(attack, mean, dim=0) < -0.4
    before = state.params[0].clone()
    for lid, delta in zip(ids, [*honest, attack], strict=True):
        state.submit(
            lid,
            state.learners[lid].session,
            fragment=0,
            base_version=0,
            steps=24,
            tokens=240,
            delta=delta,
            step_time_s=0.1,
            nbytes=4 * n,
            now=1.0,
        )
    commits, _ = state.poll(2.0)
    record = commits[0].record
    assert record["excluded"].keys() == {"mallory"}, record["cosines"]
    assert all(record["cosines"][lid] > 0.3 for lid in ids[:3]), record["cosines"]
    update = before - state.params[0]  # outer lr 1, no momentum: the merged delta
    assert torch.nn.functional.cosine_similarity(update, mean, dim=0) > 0.99


def test_the_sample_is_drawn_afresh_each_round_and_is_a_pure_function_of_the_generator():
    n = 10 * DIRECTION_SAMPLE
    first, second = (direction_sample(n, secret_generator()) for _ in range(2))
    assert first.shape == (DIRECTION_SAMPLE,) and 0 <= int(first.min()) <= int(first.max()) < n
    assert not torch.equal(first, second)  # two rounds, two samples
    same = [direction_sample(n, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*same)  # the decision is pure given its generator
    assert direction_sample(DIRECTION_WHOLE, secret_generator()) is None  # compared whole


def test_the_strided_attack_passed_the_old_check_and_fails_the_new_one():
    n = 4 * DIRECTION_SAMPLE + 3  # sampled, with a stride of 5 in the old check
    honest = honest_deltas(n, 4, seed=1)
    deltas = [*honest, strided_attack(honest)]
    stride = -(-n // DIRECTION_SAMPLE)
    strided = torch.stack([d[::stride] for d in deltas])
    old = torch.nn.functional.cosine_similarity(strided, strided.median(0).values, dim=1)
    assert old[-1] > 0.9  # what the check on fixed indices saw
    for _ in range(3):
        cosines = consensus_cosines(deltas, secret_generator())
        assert cosines[-1] < -0.3 and min(cosines[:-1]) > 0.3, cosines
    with pytest.raises(ValueError, match="generator"):
        consensus_cosines(deltas)


def test_a_small_fragment_is_compared_whole_without_a_generator():
    honest = honest_deltas(DIRECTION_WHOLE, 3, seed=2)
    attack = strided_attack(honest, stride=4)
    cosines = consensus_cosines([*honest, attack])
    assert cosines == consensus_cosines([*honest, attack], secret_generator())
    assert cosines[-1] < 0 < min(cosines[:-1]), cosines

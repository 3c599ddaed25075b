"""The evaluator reads the lineage of the versions it holds (issue 46, a rolled-back or
replaced syncer): values of another lineage are never mixed with, or kept over, the new
one's; it says which lineage the model it evaluated belongs to."""

from __future__ import annotations

import torch
from kit import tiny_model, unused_port

from diloco.launch.evaluator import Evaluator


class SumRecipe:
    """What the evaluator asks of a recipe: a model, and a 'loss' that shows its values."""

    def build_model(self, seed: int):
        return tiny_model(seed, (4, 3), tanh=False)

    def scores(self, model) -> dict:
        return {}

    def evaluate(self, model) -> float:
        return float(sum(p.detach().sum() for p in model.parameters()))


def test_a_syncer_of_another_lineage_replaces_what_the_evaluator_held():
    # (nothing listens at the address: every call of the link's listener comes from here)
    address = f"127.0.0.1:{unused_port()}"
    evaluator = Evaluator(SumRecipe(), address, seed=0, num_fragments=1)
    numel = evaluator.layout.fragments[0].numel
    try:
        evaluator.on_rejoin(address, "syncer-1", [0], (0,), [], [], lineage="aaaa")
        evaluator.on_fragment(0, 3, torch.full((numel,), 1.0), frozenset(), -1)
        loss, versions = evaluator.evaluate()
        assert versions == [3] and loss == numel and evaluator.evaluated_lineages == ["aaaa"]
        # the state directory was rolled back: a syncer of a new lineage, at version 1
        evaluator.on_rejoin(address, "syncer-2", [1], (0,), [], [], lineage="bbbb")
        assert evaluator.have_versions() == [-1]  # it asks for a keyframe
        evaluator.on_fragment(0, 1, torch.full((numel,), 2.0), frozenset(), -1)
        loss, versions = evaluator.evaluate()
        assert versions == [1] and loss == 2 * numel  # the new lineage's value, not v3's
        assert evaluator.evaluated_lineages == ["bbbb"]
        # a delta of the new lineage from version 3 never lands on the old value
        evaluator.on_fragment(0, 4, torch.full((numel,), 1.0), frozenset(), 3)
        assert evaluator.evaluate()[1] == [1]
    finally:
        evaluator.close()


def test_a_syncer_behind_the_versions_held_is_another_history_even_with_its_lineage():
    address = f"127.0.0.1:{unused_port()}"
    evaluator = Evaluator(SumRecipe(), address, seed=0, num_fragments=1)
    numel = evaluator.layout.fragments[0].numel
    try:
        evaluator.on_rejoin(address, "syncer-1", [0], (0,), [], [], lineage="aaaa")
        evaluator.on_fragment(0, 5, torch.full((numel,), 1.0), frozenset(), -1)
        evaluator.on_rejoin(address, "syncer-2", [2], (0,), [], [], lineage="aaaa")
        assert evaluator.have_versions() == [-1]
    finally:
        evaluator.close()

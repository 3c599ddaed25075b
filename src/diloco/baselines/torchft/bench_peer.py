"""External peers in ``diloco bench``: the same cell, trained by another implementation.

``torchft``: torchft's DiLoCo (:func:`diloco.baselines.torchft.peer.run_torchft`) on the same recipe,
seed, learners and batch size, our default H (one fragment: torchft's plain DiLoCo), our syncer's
default outer optimizer (``SyncerConfig``'s lr and Nesterov momentum). Its lighthouse waits for every replica, so it is
synchronous DiLoCo as torchft runs it. Clean cells stop at the matrix's token budget
(M × steps × batch × context, met at the next sync), slow cells at the wall-time budget with
the same learner slowed down. The summary it returns is written to the run directory as
``summary.json`` like a ``diloco run``'s.
"""

from __future__ import annotations

import json
from pathlib import Path


def peer_kwargs(spec, budget) -> dict:
    """``run_torchft`` arguments for one cell of the matrix (H and the outer optimizer are
    ``PeerSettings``' defaults: ours). Pure."""
    from diloco.recipes import get_recipe

    recipe = get_recipe(budget.recipe)
    common = {
        "learners": budget.learners,
        "recipe": budget.recipe,
        "seed": spec.seed,
        "wan": tuple(budget.wan),
    }
    if spec.condition == "clean":
        tokens = budget.learners * budget.steps * recipe.batch_size * recipe.tokens_per_sample
        return {**common, "tokens": tokens, "minutes": 0.0, "max_minutes": budget.minutes * 10}
    if spec.condition == "slow":
        return {**common, "minutes": budget.minutes, "slow": {1: budget.slow_factor}}
    raise ValueError(f"the {spec.peer} peer has no {spec.condition!r} condition")


def run_peer(spec, run_dir: Path, budget) -> dict:
    """Run ``spec`` with its peer; returns its summary (also written to ``run_dir``)."""
    if spec.peer != "torchft":
        raise ValueError(f"unknown peer {spec.peer!r}")
    from diloco.baselines.torchft.peer import run_torchft

    summary = run_torchft(run_dir=run_dir, **peer_kwargs(spec, budget))
    summary.setdefault("mode", "torchft")
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary

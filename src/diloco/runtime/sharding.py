"""Sharded islands (FSDP2): shard a recipe's model across an island's ranks, and checkpoint
each rank's own shards.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every block of every
``nn.ModuleList`` (a transformer's layers: one all-gather per block in forward and backward)
and then to the whole model (everything else: embeddings, head, norms). Parameter names are
unchanged, so the syncer's model and the island's agree.

A sharded model's and optimizer's state dicts hold ``DTensor`` shards, which
``torch.load(weights_only=True)`` does not read: ``local_state`` replaces them with each
rank's local tensors (a rank's checkpoint holds its own shards), ``load_local_state`` puts
them back.
"""

from __future__ import annotations

import torch
from torch import nn


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place across the default process group; returns it."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
    fully_shard(model)
    return model


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_state(state):
    """``state`` (a state dict, nested) with every ``DTensor`` replaced by its local shard."""
    if _is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_state(v) for v in state]
    return state


def load_local_model_state(model: nn.Module, saved: dict) -> None:
    """Copy a ``local_state`` of ``model`` back into its shards (and plain tensors)."""
    current = model.state_dict()
    missing = set(current) - set(saved)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, value in current.items():
            target = value.to_local() if _is_dtensor(value) else value
            if target.shape != saved[name].shape:
                raise ValueError(
                    f"{name}: checkpoint shard {tuple(saved[name].shape)}, this rank holds "
                    f"{tuple(target.shape)} (another island size?)"
                )
            target.copy_(saved[name])


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load a ``local_state`` of ``optimizer``: its per-parameter tensors become shards of the
    same layout as their parameters again."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(saved)
    for param, state in optimizer.state.items():
        if not _is_dtensor(param):
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not _is_dtensor(value) and value.dim() > 0:
                state[key] = DTensor.from_local(
                    value.to(param.to_local().device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )

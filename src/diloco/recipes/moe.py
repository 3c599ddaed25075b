"""A small mixture-of-experts transformer in plain PyTorch (the ``moe`` recipe).

The byte-level GPT of :mod:`diloco.recipes.gpt` with every block's MLP replaced by ``experts``
expert MLPs and a router that sends each token to its ``top_k`` experts (weights: the
router's softmax over the chosen ones, renormalised). Training adds the load-balancing loss of
the Switch Transformer (Fedus et al. 2021): ``experts · Σ_e f_e · P_e``, with ``f_e`` the share
of routing slots expert e received and ``P_e`` its mean router probability, scaled by
``aux_weight``; evaluation reports the cross-entropy alone. Router and expert tensors are
ordinary parameters (``blocks.0.moe.router.weight``, ``blocks.0.moe.experts.3.0.weight``),
so they fragment, travel and merge like any other tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diloco.recipes.gpt import GPT, GPTConfig, SelfAttention


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    experts: int = 4
    top_k: int = 2
    aux_weight: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts], got {self.top_k} of {self.experts}")


class MixtureOfExperts(nn.Module):
    """Top-k routing over expert MLPs; ``self.aux`` holds the last forward's balance loss."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(
                nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
            )
            for _ in range(cfg.experts)
        )
        self.aux = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.router(flat).softmax(dim=-1)  # (tokens, experts)
        weight, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weight[rows, slot, None])
        routed = F.one_hot(chosen, len(self.experts)).sum(dim=1).float().mean(dim=0) / self.top_k
        self.aux = len(self.experts) * (routed * probs.mean(dim=0)).sum()
        return out.view(shape)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MixtureOfExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    """``model(x, y)`` returns ``(logits, loss)``; in training mode the loss includes the
    load-balancing term (``cfg.aux_weight`` × the blocks' mean), in eval mode it is the
    cross-entropy alone (nats/token)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.apply(self._init)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = super().forward(x, y)
        if loss is not None and self.training:
            aux = torch.stack([b.moe.aux for b in self.blocks]).mean()
            loss = loss + self.cfg.aux_weight * aux
        return logits, loss

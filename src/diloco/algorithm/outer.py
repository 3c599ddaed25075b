"""The outer optimizer: SGD with Nesterov momentum on merged outer gradients, per fragment.

For fragment p with merged outer gradient Δ (global minus learners' local parameters):

    m_p ← μ·m_p + Δ
    Θ_p ← Θ_p − lr·(Δ + μ·m_p)

Fragments are merged at different times, so every fragment keeps its own momentum buffer;
the state of one fragment is independent of all others and can be saved on its own
(1/P of the model per commit).

This class's defaults ``lr = 1.0, μ = 0.0`` make the outer step "replace the global fragment
by the merged learners' fragment"; the syncer's default is ``lr = 0.7, μ = 0``
(``SyncerConfig``), chosen from the sweep recorded in ``docs/algorithm.md``. The DiLoCo
lineage's ``0.7 / 0.9`` was tuned for H = 500 and is far worse at H = 24 (shared DESIGN §4d,
and our sweep).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class NesterovOuter:
    """Per-fragment Nesterov SGD. Not thread-safe: the syncer calls it under its state lock."""

    def __init__(self, *, lr: float = 1.0, momentum: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self._buffers: dict[int, torch.Tensor] = {}

    def step(self, fragment: int, params: torch.Tensor, delta: torch.Tensor) -> None:
        """Apply one outer step to ``params`` (fragment ``fragment``'s flat tensor) in place.

        ``delta`` is the merged outer gradient, same shape as ``params``. With μ = 0 no
        momentum buffer is kept.
        """
        if params.shape != delta.shape:
            raise ValueError(f"params {tuple(params.shape)} and delta {tuple(delta.shape)} differ")
        if self.momentum == 0.0:
            params.sub_(delta, alpha=self.lr)
            return
        buf = self._buffers.get(fragment)
        if buf is None:
            buf = self._buffers[fragment] = torch.zeros_like(params, dtype=torch.float32)
        buf.mul_(self.momentum).add_(delta)
        params.sub_(delta, alpha=self.lr).sub_(buf, alpha=self.lr * self.momentum)

    def fragment_state(self, fragment: int) -> dict[str, torch.Tensor]:
        """Serializable state of one fragment: ``{"momentum": tensor}`` or ``{}``."""
        buf = self._buffers.get(fragment)
        return {} if buf is None else {"momentum": buf.clone()}

    def load_fragment_state(self, fragment: int, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``fragment_state`` returned (an empty mapping clears the buffer)."""
        if "momentum" in state:
            self._buffers[fragment] = state["momentum"].detach().to(torch.float32).clone()
        else:
            self._buffers.pop(fragment, None)

    def state_dict(self) -> dict:
        """All state: hyper-parameters and every fragment's momentum buffer."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "buffers": {p: b.clone() for p, b in self._buffers.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self._buffers = {
            int(p): b.detach().to(torch.float32).clone() for p, b in state["buffers"].items()
        }

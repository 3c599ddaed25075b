"""The global model a syncer holds: per fragment p, Θ_p, its version and its outer momentum.

A part :class:`diloco.syncer.state.SyncerState` holds (``state.model``) and its round
closing (``diloco.syncer.closing``) moves: Θ_p (fp32, the single source of truth) changes
only by an outer step (``step``, which bumps the version) or, with ``down_feedback`` off, by
taking the value learners will hold (``take_wire_image``). It keeps ‖Θ_p‖ for the norm
guard, computed once per value (``norm``). Not thread-safe: callers hold the state's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.outer import NesterovOuter


class GlobalModel:
    """Θ_p, versions and the outer optimizer of every fragment of ``layout``."""

    def __init__(
        self,
        layout: FragmentLayout,
        params: Sequence[torch.Tensor],
        outer: NesterovOuter,
        versions: Sequence[int] | None = None,
    ) -> None:
        """``params``: one tensor per fragment, of the layout's size (``ValueError``
        otherwise), copied as flat fp32; ``versions`` (default: all 0)."""
        if len(params) != layout.num_fragments:
            raise ValueError(
                f"{len(params)} parameter vectors for {layout.num_fragments} fragments"
            )
        for p, t in enumerate(params):
            if t.numel() != layout.fragments[p].numel:
                raise ValueError(
                    f"fragment {p} has {t.numel()} values, layout says {layout.fragments[p].numel}"
                )
        self.params = [t.detach().to(torch.float32).clone().reshape(-1) for t in params]
        """Θ_p of each fragment (flat fp32)."""
        self.versions = list(versions) if versions is not None else [0] * layout.num_fragments
        """Each fragment's version: the commits that made its Θ_p."""
        self.outer = outer
        """The outer optimizer (its per-fragment momentum)."""
        self._norms: dict[int, float] = {}  # ‖Θ_p‖ of the current values

    def norm(self, fragment: int) -> float:
        """‖Θ_p‖ for the norm guard, computed once per value (every upload asks for it)."""
        if fragment not in self._norms:
            self._norms[fragment] = float(self.params[fragment].norm())
        return self._norms[fragment]

    def step(self, fragment: int, merged: torch.Tensor, lr: float) -> int:
        """Take the outer step of ``fragment`` with a round's ``merged`` delta at learning
        rate ``lr``; returns the new version (the old one plus 1)."""
        self.outer.step(fragment, self.params[fragment], merged, lr=lr)
        self._norms.pop(fragment, None)
        self.versions[fragment] += 1
        return self.versions[fragment]

    def take_wire_image(self, fragment: int, wire: torch.Tensor) -> None:
        """Θ_p := ``wire``, the value learners will hold (``down_feedback`` off): ‖Θ_p‖ is
        computed anew from it."""
        self.params[fragment].copy_(wire)
        self._norms.pop(fragment, None)

"""The outer optimizer: SGD with Nesterov momentum on merged outer gradients, per fragment.

For fragment p with merged outer gradient Δ (global minus learners' local parameters):

    m_p ← μ·m_p + Δ
    Θ_p ← Θ_p − lr·(Δ + μ·m_p)

Fragments are merged at different times, so every fragment keeps its own momentum buffer;
the state of one fragment is independent of all others and can be saved on its own
(1/P of the model per commit).

With ``lr = 1.0, μ = 0.0`` (this class's defaults) the outer step replaces the global
fragment by the merged learners' fragment. The syncer runs at ``SyncerConfig``'s lr 0.6 and
μ 0.7 (docs/algorithm.md, "Outer optimizer"; the sweep: benchmarks/RESULTS.md, "The outer
step") and scales each round's merged delta by ``round_share`` first. The DiLoCo lineage's
``0.7 / 0.9`` was tuned for H = 500 and is far worse at H = 24 (our sweeps, in
benchmarks/HISTORY.md). ``scheduled_outer_lr`` gives an
optional cosine decay of the lr over a fragment's versions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from diloco.algorithm.chunk_threads import for_each_chunk
from diloco.algorithm.streaming import CHUNK_VALUES


def round_share(contributed: Sequence[int], expected_absent: Sequence[int | None]) -> float:
    """The share of one cycle of the live learners' work that a closing round holds.

    ``contributed``: the tokens of each contribution in the round. ``expected_absent``: for
    every live learner that is *not* in the round, the tokens it is expected to bring (the
    syncer uses its measured throughput since the fragment's last commit, or its last
    contribution's tokens), or ``None`` when nothing is known (then the mean of
    ``contributed`` stands in). Returns ``Σ contributed / (Σ contributed + Σ absent)``,
    in (0, 1]; 1 when every live learner is in the round.

    Why: when a round misses learners (on the learners' schedule with quorum 1, most rounds
    carried one learner's delta; on the syncer's clock, a learner that was late), the others rebase
    their own progress on top of the result, so every learner's progress reaches the global
    model through its own round. Scaling a round's merged delta by this share makes the model
    move by ``lr`` times the *mean* of the learners' deltas per cycle, as synchronous DiLoCo
    does, instead of ``lr`` times their *sum*: the outer lr no longer depends on M. When the
    other learners are dead the share is 1 and the survivors step at the full rate.

    >>> round_share([100], [100, 100, 100])
    0.25
    >>> round_share([100, 300], [])
    1.0
    >>> round_share([100], [None])
    0.5
    """
    if not contributed or any(t <= 0 for t in contributed):
        raise ValueError(f"a round needs contributions with tokens >= 1, got {list(contributed)}")
    if any(t is not None and t < 0 for t in expected_absent):
        raise ValueError(f"expected tokens must be >= 0, got {list(expected_absent)}")
    here = float(sum(contributed))
    stand_in = here / len(contributed)
    absent = sum(stand_in if t is None else float(t) for t in expected_absent)
    return here / (here + absent)


def scheduled_outer_lr(version: int, *, lr: float, decay_versions: int, final: float) -> float:
    """The outer lr of the step that makes fragment version ``version + 1``.

    ``decay_versions`` V = 0: ``lr`` at every version. Otherwise a cosine from ``lr`` at
    version 0 down to ``final × lr`` at version V, and ``final × lr`` from there on. The
    schedule counts a fragment's own committed versions, which the syncer persists, so a
    restarted syncer resumes it where it was.

    >>> [round(scheduled_outer_lr(v, lr=0.6, decay_versions=4, final=0.5), 4) for v in range(6)]
    [0.6, 0.5561, 0.45, 0.3439, 0.3, 0.3]
    >>> scheduled_outer_lr(7, lr=0.6, decay_versions=0, final=0.5)
    0.6
    """
    if version < 0 or decay_versions < 0:
        raise ValueError(
            f"version and decay_versions must be >= 0 (got {version}, {decay_versions})"
        )
    if not 0.0 < final <= 1.0:
        raise ValueError(f"the final outer lr fraction must be in (0, 1], got {final}")
    if decay_versions == 0:
        return lr
    progress = min(version, decay_versions) / decay_versions
    return lr * (final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress)))


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

    def step(
        self, fragment: int, params: torch.Tensor, delta: torch.Tensor, *, lr: float | None = None
    ) -> None:
        """Apply one outer step to ``params`` (fragment ``fragment``'s flat tensor) in place.

        ``delta`` is the merged outer gradient, same shape as ``params``; ``lr``: this step's
        learning rate (default: ``self.lr``; a schedule passes its own). With μ = 0 no
        momentum buffer is kept.
        """
        if params.shape != delta.shape:
            raise ValueError(f"params {tuple(params.shape)} and delta {tuple(delta.shape)} differ")
        lr = self.lr if lr is None else float(lr)
        if not lr > 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if self.momentum == 0.0:
            for_each_chunk(params.numel(), CHUNK_VALUES, _plain_step(params, delta, lr))
            return
        buf = self._buffers.get(fragment)
        if buf is None:
            buf = self._buffers[fragment] = torch.zeros_like(params, dtype=torch.float32)
        step = _nesterov_step(params, delta, buf, lr, self.momentum)
        for_each_chunk(params.numel(), CHUNK_VALUES, step)

    def buffer(self, fragment: int) -> torch.Tensor | None:
        """The momentum buffer of ``fragment`` itself (None before its first step with
        μ > 0): read it, never change it."""
        return self._buffers.get(fragment)

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


def _plain_step(params: torch.Tensor, delta: torch.Tensor, lr: float):
    """One chunk ``[a, b)`` of ``Θ ← Θ − lr·Δ`` (elementwise: chunks on any thread give the
    bits of the whole tensor's operation; ``chunk_threads``)."""
    params, delta = params.view(-1), delta.reshape(-1)

    def chunk(a: int, b: int) -> None:
        params[a:b].sub_(delta[a:b], alpha=lr)

    return chunk


def _nesterov_step(params, delta, buf, lr: float, momentum: float):
    """One chunk ``[a, b)`` of ``m ← μ·m + Δ; Θ ← Θ − lr·Δ − lr·μ·m``, in that order of
    operations per value (elementwise, as ``_plain_step``)."""
    params, delta, buf = params.view(-1), delta.reshape(-1), buf.view(-1)

    def chunk(a: int, b: int) -> None:
        m = buf[a:b].mul_(momentum).add_(delta[a:b])
        params[a:b].sub_(delta[a:b], alpha=lr).sub_(m, alpha=lr * momentum)

    return chunk

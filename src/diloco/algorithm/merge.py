"""How the syncer weighs and merges the outer gradients of one fragment.

Each contribution is an outer gradient ``Δ_m = A_p − θ_p`` (anchor minus local fragment) of
learner m, weighted by what it did since it last received the fragment:

    w_m = tokens_m² / steps_m        ("quantity × quality": tokens × tokens-per-step)

Merging happens tensor by tensor inside a fragment:

* **RDA** (radial–directional averaging) for ordinary tensors. Plain averaging of vectors
  that point in different directions shrinks their norm (two orthogonal deltas of norm 2
  average to norm 1.414), which silently lowers the effective outer learning rate as more
  learners join. RDA averages the *lengths* and the *directions* separately:

      RDA = (Σ w‖v‖ / Σ w) · normalize(Σ w·normalize(v) / Σ w),   normalize(0) = 0

* **weighted mean** for embedding tensors (input embeddings, untied output heads, position
  embeddings). Embedding rows are touched only by the tokens a learner saw, so their deltas
  are sparse and near-orthogonal by construction; RDA would inflate rare rows. The rule that
  decides what is an embedding is ``is_embedding_name`` and can be replaced.

Fallback when the mean direction cancels (``‖Σ w·normalize(v)‖ / Σ w < CANCEL_TOL``): the
learners disagree about the direction, so there is no direction worth scaling up to the mean
radius; RDA returns the weighted mean instead (small by construction).

All functions are pure: inputs are never modified, the result is a new float32 tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

#: Below this length of the weighted mean of unit directions, RDA falls back to the mean.
CANCEL_TOL = 1e-6

#: Default rule for embedding tensors: a parameter named ``*.weight`` whose owning module
#: name looks like an embedding table or an output head. Matched case-insensitively against
#: the full dotted parameter name.
DEFAULT_EMBEDDING_PATTERNS: tuple[str, ...] = (
    r"(^|\.)[^.]*emb[^.]*\.weight$",  # tok_emb, pos_emb, embed_tokens, word_embeddings, ...
    r"(^|\.)(wte|wpe|lm_head|head|output)\.weight$",  # GPT-2 names and untied output heads
)


def is_embedding_name(name: str, patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS) -> bool:
    """True if the parameter ``name`` is treated as an embedding (merged by weighted mean)."""
    return any(re.search(p, name, flags=re.IGNORECASE) for p in patterns)


def token_weight(tokens: float, steps: float) -> float:
    """Merge weight of a contribution: ``tokens² / steps``; zero steps means zero weight.

    ``tokens`` and ``steps`` count what the learner did since it last received the fragment.
    Raises ``ValueError`` for negative counters.
    """
    if tokens < 0 or steps < 0:
        raise ValueError(f"counters must be non-negative, got tokens={tokens}, steps={steps}")
    if steps == 0:
        return 0.0
    return float(tokens) * float(tokens) / float(steps)


def cap_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Clip every weight at ``cap`` × the round's lower median weight (robust weights).

    A learner's weight grows with the tokens it claims (``tokens² / steps``); a buggy or
    hostile learner that claims many tokens would otherwise take over a round. The lower
    median (the ⌊(n−1)/2⌋-th smallest) is a weight at least half of the round reached, so one
    contribution cannot raise its own cap: with two contributions the larger gets at most
    ``cap / (1 + cap)`` of the round (0.75 at the default 3). ``cap <= 0`` turns it off;
    fewer than two weights are returned unchanged.

    >>> cap_weights([1.0, 100.0], 3.0)
    [1.0, 3.0]
    >>> cap_weights([4.0, 5.0, 6.0, 100.0], 3.0)
    [4.0, 5.0, 6.0, 15.0]
    """
    out = [float(w) for w in weights]
    if any(w < 0 for w in out):
        raise ValueError(f"weights must be >= 0, got {out}")
    if cap <= 0 or len(out) < 2:
        return out
    limit = cap * sorted(out)[(len(out) - 1) // 2]
    return [min(w, limit) for w in out] if limit > 0 else out


def check_contributions(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> list[float]:
    """The weights as floats; ``ValueError`` unless there is at least one vector, one weight
    per vector, one shape, finite non-negative weights and a positive total."""
    if len(vectors) == 0:
        raise ValueError("need at least one contribution to merge")
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    shape = vectors[0].shape
    for v in vectors:
        if v.shape != shape:
            raise ValueError(f"all contributions must have one shape, got {shape} and {v.shape}")
    ws = [float(w) for w in weights]
    if any(w < 0 or w != w for w in ws):
        raise ValueError(f"weights must be finite and non-negative, got {ws}")
    if sum(ws) <= 0:
        raise ValueError("the total weight is zero: nothing to merge")
    return ws


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ w·v / Σ w`` as a new float32 tensor."""
    ws = check_contributions(vectors, weights)
    total = sum(ws)
    out = torch.zeros(vectors[0].shape, dtype=torch.float32)
    for v, w in zip(vectors, ws, strict=True):
        if w:
            out.add_(v, alpha=w / total)
    return out


def rda(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial–directional average of ``vectors`` (see the module docstring).

    The result's norm is the weighted mean of the input norms (unless the directions cancel,
    in which case the weighted mean is returned). Identical inputs return that input; zero
    vectors add radius 0 and no direction.
    """
    ws = check_contributions(vectors, weights)
    total = sum(ws)
    radius = 0.0
    direction = torch.zeros(vectors[0].shape, dtype=torch.float32)
    for v, w in zip(vectors, ws, strict=True):
        norm = float(torch.linalg.vector_norm(v, dtype=torch.float32))
        if w and norm > 0:
            radius += w * norm / total
            direction.add_(v, alpha=w / (total * norm))
    dir_norm = float(torch.linalg.vector_norm(direction))
    if dir_norm < CANCEL_TOL:
        return weighted_mean(vectors, ws)
    return direction.mul_(radius / dir_norm)


def merge_contributions(
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    fragment=None,
    *,
    is_embedding: Callable[[str], bool] = is_embedding_name,
) -> torch.Tensor:
    """Merge flat fragment deltas tensor by tensor.

    ``deltas`` are 1-d float tensors of one length (a fragment's flat vector). ``fragment``
    is a ``fragments.Fragment`` (its pieces give each tensor's ``name``, ``offset`` and
    ``numel`` inside the flat vector); ``None`` merges the whole vector as one ordinary
    tensor. Pieces whose name ``is_embedding`` get the weighted mean, all others RDA. Row
    pieces of one tensor are merged as one tensor, so RDA sees the tensor's full norm.
    Returns a new float32 tensor; the inputs are not modified.
    """
    ws = check_contributions(deltas, weights)
    if fragment is None:
        return rda(deltas, ws)
    out = torch.empty(deltas[0].shape, dtype=torch.float32)
    covered = 0
    for name, spans in spans_by_tensor(fragment).items():
        parts = [
            torch.cat([d[a:b] for a, b in spans])
            if len(spans) > 1
            else d[spans[0][0] : spans[0][1]]
            for d in deltas
        ]
        merged = weighted_mean(parts, ws) if is_embedding(name) else rda(parts, ws)
        start = 0
        for a, b in spans:
            out[a:b] = merged[start : start + (b - a)]
            start += b - a
            covered += b - a
    if covered != out.numel():
        raise ValueError(
            f"fragment pieces cover {covered} values but the deltas have {out.numel()}"
        )
    return out


def spans_by_tensor(fragment) -> dict[str, list[tuple[int, int]]]:
    """Per tensor name, the ``(start, stop)`` spans of ``fragment``'s flat vector it holds."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for piece in fragment.pieces:
        spans.setdefault(piece.name, []).append((piece.offset, piece.offset + piece.numel))
    return spans

"""Pure algorithm core of Decoupled DiLoCo: no I/O, no threads, no sockets.

Public names (other packages and users rely on them):

- ``balanced_fragments``, ``FragmentLayout``, ``due_fragments``, ``fragment_offset``
  (module ``fragments``): balanced tensor fragmentation and the send schedule.
- ``token_weight``, ``rda``, ``weighted_mean``, ``merge_contributions``, ``is_embedding_name``
  (module ``merge``): how contributions are weighted and merged.
- ``NesterovOuter``, ``round_share`` (module ``outer``): the per-fragment outer optimizer and
  the share of a cycle a round holds (its step scale).
- ``decide_round``, ``admit_contribution`` (module ``rounds``): when a round closes and
  whether a (possibly stale) contribution is accepted.
- ``codecs.encode`` / ``codecs.decode`` (module ``codecs``): wire formats fp32, bf16, int8, int4,
  int2, sign1, sign1w, topk2.

Names are imported lazily so a partially built tree stays importable.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "balanced_fragments": "fragments",
    "FragmentLayout": "fragments",
    "Fragment": "fragments",
    "TensorPiece": "fragments",
    "LayoutMismatch": "fragments",
    "due_fragments": "fragments",
    "fragment_offset": "fragments",
    "token_weight": "merge",
    "rda": "merge",
    "weighted_mean": "merge",
    "merge_contributions": "merge",
    "is_embedding_name": "merge",
    "NesterovOuter": "outer",
    "round_share": "outer",
    "decide_round": "rounds",
    "admit_contribution": "rounds",
    "RoundDecision": "rounds",
    "Admission": "rounds",
}

__all__ = [*_EXPORTS, "codecs"]


def __getattr__(name: str):
    if name == "codecs":
        return importlib.import_module(f"{__name__}.codecs")
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

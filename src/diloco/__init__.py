"""diloco: Decoupled DiLoCo for PyTorch.

Independent learners run many local optimizer steps and stream compressed parameter
fragments to a central syncer, which merges whatever has arrived and applies an outer
Nesterov step. See ``docs/algorithm.md`` for the contract and the choices we made.

Nothing is started at import time; heavy modules (gRPC, the learner) load lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "IslandLearner",
    "Learner",
    "LearnerConfig",
    "ProtocolConfig",
    "StatefulSampler",
    "SyncerServer",
    "SyncerConfig",
    "SyncerUnreachable",
    "__version__",
]


def __getattr__(name: str):
    # Lazy so that `import diloco` stays cheap and never touches gRPC.
    if name in ("Learner", "LearnerConfig"):
        from diloco.learner import learner as _learner

        return getattr(_learner, name)
    if name == "IslandLearner":
        from diloco.learner.island import IslandLearner

        return IslandLearner
    if name == "ProtocolConfig":
        from diloco.wire.protocol import ProtocolConfig

        return ProtocolConfig
    if name == "SyncerUnreachable":
        from diloco.learner.waiting import SyncerUnreachable

        return SyncerUnreachable
    if name == "StatefulSampler":
        from diloco.data import StatefulSampler

        return StatefulSampler
    if name == "SyncerServer":
        from diloco.syncer.server import SyncerServer

        return SyncerServer
    if name == "SyncerConfig":
        from diloco.syncer.config import SyncerConfig

        return SyncerConfig
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")

"""``diloco learner``: one learner process (``diloco.launch.learner_worker``).

Every setting is a field of ``diloco.config.worker.WorkerConfig`` and a flag; ``--config FILE``
reads them from a JSON file (as ``diloco run`` writes one per learner) and flags given beside
it override the file.
"""

from __future__ import annotations

from diloco.cli.common import configured_command
from diloco.config.worker import WorkerConfig


def _runner():
    from diloco.launch.learner_worker import run

    return run


def register(subparsers) -> None:
    configured_command(
        subparsers,
        "learner",
        WorkerConfig,
        _runner,
        help="run one learner process",
        description=__doc__.split("\n\n")[0],
    )

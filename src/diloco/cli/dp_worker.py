"""``diloco dp-worker``: one rank of the data-parallel baseline (``diloco run --mode dp``
starts them). Every setting is a field of ``diloco.config.dp_worker.DpWorkerConfig`` and a
flag; ``--config FILE`` reads them from a JSON file and flags given beside it override it
(the supervisor passes ``--generation`` that way when it restarts the group)."""

from __future__ import annotations

from diloco.cli.common import configured_command
from diloco.config.dp_worker import DpWorkerConfig


def _runner():
    from diloco.baselines.dp.worker import run

    return run


def register(subparsers) -> None:
    configured_command(
        subparsers,
        "dp-worker",
        DpWorkerConfig,
        _runner,
        help="one rank of the data-parallel baseline (started by diloco run)",
    )

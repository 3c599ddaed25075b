"""``diloco syncer``: run the syncer service standalone (``diloco run`` starts it too).

Every setting is a field of ``diloco.config.service.ServiceConfig`` (its ``syncer`` section is
``diloco.syncer.config.SyncerConfig``) and a flag; ``--config FILE`` reads them from a JSON
file (as ``diloco run`` writes one) and flags given beside it override the file.
"""

from __future__ import annotations

from diloco.cli.common import configured_command
from diloco.config.service import ServiceConfig


def _runner():
    from diloco.launch.syncer_process import serve

    return serve


def register(subparsers) -> None:
    configured_command(
        subparsers,
        "syncer",
        ServiceConfig,
        _runner,
        help="run the syncer service",
        description=__doc__.split("\n\n")[0],
    )

"""``diloco run``: a syncer, M learners and an evaluator on this machine (the embedded default).

Every setting is a field of ``diloco.config.run.RunConfig`` (its sections: the recipe, P and
H, the syncer's ``SyncerConfig`` and the Ray backend) and a flag; ``--config FILE`` reads
them from a JSON file (a run's ``config.json`` repeats that run; change ``--name``) and flags
given beside it override the file.
"""

from __future__ import annotations

from diloco.cli.common import configured_command
from diloco.config.run import RunConfig, load_run_config


def _runner():
    import diloco.baselines.dp  # noqa: F401 (registers --mode dp with the launcher)
    from diloco.launch.run import run

    return run


def register(subparsers) -> None:
    configured_command(
        subparsers,
        "run",
        RunConfig,
        _runner,
        help="run a syncer, M learners and an evaluator on this machine (the embedded default)",
        description=__doc__.split("\n\n")[0],
        load=load_run_config,
    )

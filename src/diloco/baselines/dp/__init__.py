"""The data-parallel baseline: ``diloco run --mode dp``.

A static group of M ranks all-reduces gradients every step (``torch.distributed``, gloo on
CPU) and restarts as a whole from its last checkpoint when any rank fails. It trains the same
recipe, seeds and token budget as the DiLoCo modes and writes the same run directory and
summary, so that ``diloco bench`` can put them side by side. Importing this package
registers the mode with the launcher (``diloco.launch.modes``).
"""

from diloco.launch.modes import Mode, register


def _run(*args, **kwargs) -> int:
    from diloco.baselines.dp.run import run_dp

    return run_dp(*args, **kwargs)


def _check_chaos(clauses) -> None:
    from diloco.baselines.dp.run import check_chaos

    check_chaos(clauses)


register(Mode("dp", _run, _check_chaos))

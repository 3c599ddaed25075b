"""The data-parallel baseline: ``diloco run --mode dp``.

A static group of M ranks all-reduces gradients every step (``torch.distributed``, gloo on
CPU) and restarts as a whole from its last checkpoint when any rank fails. It trains the same
recipe, seeds and token budget as the DiLoCo modes and writes the same run directory and
summary, so that ``diloco bench`` can put them side by side.
"""

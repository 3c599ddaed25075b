"""External peers: other implementations run on the same recipe, model and data as ``diloco run``.

* :mod:`diloco.baselines.torchft.peer`: ``torchft``'s DiLoCo (lighthouse + one replica group
  process per learner, gloo on CPU), via :func:`run_torchft`. Needs the optional extra
  ``pip install 'diloco[torchft]'`` (``make setup-peers``).

Nothing here is imported by the rest of the package, so diloco works without the peers.
"""

"""Where users already train: callbacks that turn a framework's training run into a learner.

- :mod:`diloco.integrations.hf_trainer`: ``DilocoCallback`` for Hugging Face
  ``transformers.Trainer`` (``pip install 'diloco[recipes]'``).

Nothing here is imported by the rest of the package.
"""

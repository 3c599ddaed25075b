"""A PyTorch Lightning ``Trainer`` run as a Decoupled DiLoCo learner, in one line.

    trainer = lightning.Trainer(callbacks=[DilocoCallback("10.0.0.5:7000", learner_id="site-a")])

The callback wraps the LightningModule in a :class:`diloco.Learner` when fitting starts
(after Lightning built the optimizer), waits for the syncer's global model so every learner
starts from the same parameters, calls ``learner.step`` after every optimizer step (a
training batch after which Lightning's ``global_step`` moved: with gradient accumulation, the
tokens of every batch of the step are counted), and flushes the learner's progress and leaves
the syncer when fitting ends (on an exception it leaves without flushing). Everything else
(data, optimizer, schedule, logging, checkpoints, precision) stays Lightning's. One optimizer
per module; inside one process (a strategy with several ranks is an island:
``diloco.IslandLearner``).

Resuming: the callback's ``state_dict`` is the learner's (``Learner.state_dict``: its unsent
progress, the deltas on their way, the versions it holds, its step count), so every
checkpoint Lightning saves carries it, and ``trainer.fit(..., ckpt_path=...)`` makes the
learner from it: the progress the checkpoint held unsent is sent, not lost.

Tokens per batch (the merge weight of this learner against the others): ``tokens(batch)``
if given, else the number of elements of the batch's first tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.integrations.joining import JoinsAsLearner
from diloco.runtime.optional import import_optional

Callback = import_optional("lightning.pytorch", "lightning", "the Lightning callback").Callback


def first_tensor_elements(batch) -> int:
    """Elements of the first tensor in ``batch`` (a tensor, or a tuple/list/dict of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    items = batch.values() if isinstance(batch, dict) else batch
    for item in items:
        if isinstance(item, torch.Tensor):
            return item.numel()
    raise ValueError("no tensor in the batch: pass tokens=<function of the batch>")


class DilocoCallback(JoinsAsLearner, Callback):
    """Makes the Lightning run a learner of the syncer at ``syncer`` (``HOST:PORT``).

    ``tokens``: what a batch counts for; the other arguments:
    :class:`~diloco.integrations.joining.JoinsAsLearner`.
    """

    def __init__(
        self, syncer: str, *, tokens: Callable[[object], int] = first_tensor_elements, **options
    ) -> None:
        super().__init__(syncer, **options)
        self.tokens = tokens
        self._step_seen = 0
        self._pending_tokens = 0
        self.restored: dict | None = None
        """The learner state of the checkpoint Lightning resumes from (``load_state_dict``)."""

    def state_dict(self) -> dict:
        return self.checkpoint_state()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.learner is not None:  # (a strategy that restores after setup)
            raise RuntimeError(
                "DilocoCallback: the checkpoint was restored after training began; this "
                "strategy's resume cannot carry the learner's state"
            )
        self.restored = state_dict

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"DilocoCallback needs one optimizer, the module has {len(trainer.optimizers)}"
            )
        restored, self.restored = self.restored, None
        self.join(pl_module, trainer.optimizers[0], restored)
        self._step_seen = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.learner is None:
            return
        self._pending_tokens += self.tokens(batch)
        if trainer.global_step > self._step_seen:  # an optimizer step happened
            self._step_seen = trainer.global_step
            tokens, self._pending_tokens = self._pending_tokens, 0
            self.learner.step(tokens=tokens)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.leave(flush=True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.leave(flush=False)

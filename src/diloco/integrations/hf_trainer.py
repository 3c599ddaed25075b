"""A Hugging Face ``transformers.Trainer`` run as a Decoupled DiLoCo learner, in one line.

    trainer.add_callback(DilocoCallback(syncer="10.0.0.5:7000", learner_id="site-a"))

The callback wraps the Trainer's model in a :class:`diloco.Learner` when training begins
(after the Trainer built its optimizer), waits for the syncer's global model so every learner
starts from the same parameters, calls ``learner.step`` after every optimizer step (the
Trainer's ``on_step_end``: after ``optimizer.step()`` and ``zero_grad()``, a step boundary),
and flushes the learner's progress and leaves the syncer when training ends. Everything else
(data, optimizer, schedule, logging, checkpoints, mixed precision) stays the Trainer's.

Resuming: at every checkpoint the Trainer saves (``on_save``) the callback writes the
learner's state (``Learner.state_dict``: its unsent progress, the deltas on their way, the
versions it holds, its step count) into the checkpoint folder as ``diloco_learner.pt``; a
Trainer resumed from that checkpoint (``trainer.train(resume_from_checkpoint=...)``) makes
its learner from it, so the progress the checkpoint held unsent is sent, not lost. The
folder is the one the Trainer wrote (``OUTPUT_DIR/checkpoint-STEP``), or
``TrainingArguments(resume_from_checkpoint=...)``, or the callback's ``resume_from``.

Tokens per step (the merge weight of this learner against the others) are the Trainer's own
count when it keeps one (``TrainingArguments(include_num_input_tokens_seen=True)``), else
examples per optimizer step × ``tokens_per_sample``.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diloco.integrations.joining import JoinsAsLearner

log = logging.getLogger(__name__)

LEARNER_STATE_FILE = "diloco_learner.pt"
"""The learner's state in a Trainer's checkpoint folder."""


class DilocoCallback(JoinsAsLearner, TrainerCallback):
    """Makes the Trainer's run a learner of the syncer at ``syncer`` (``HOST:PORT``).

    ``tokens_per_sample``: what one example counts for when the Trainer does not count input
    tokens; ``resume_from``: the checkpoint folder a resumed Trainer's learner state is read
    from when it is not where the Trainer writes (see the module's docstring); the other
    arguments: :class:`~diloco.integrations.joining.JoinsAsLearner`.
    """

    def __init__(
        self,
        syncer: str,
        *,
        tokens_per_sample: int = 1,
        resume_from: str | os.PathLike | None = None,
        **options,
    ) -> None:
        super().__init__(syncer, **options)
        self.tokens_per_sample = tokens_per_sample
        self.resume_from = resume_from
        self._tokens_seen = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("DilocoCallback needs the Trainer's model")
        self.join(model, optimizer, self._saved_state(args, state))
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_save(self, args, state, control, **kwargs):
        if self.learner is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = os.path.join(folder, LEARNER_STATE_FILE)
        torch.save(self.checkpoint_state(), path + ".tmp")
        os.replace(path + ".tmp", path)  # (a kill mid-write leaves the folder without it)

    def _saved_state(self, args, state) -> dict | None:
        """The learner state of the checkpoint a resumed Trainer starts from; None for a
        fresh start (step 0). A resume without one (a checkpoint saved without this
        callback) is said, and the learner starts afresh."""
        if not state.global_step:
            return None
        folder = self.resume_from or getattr(args, "resume_from_checkpoint", None)
        if not folder:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = os.path.join(folder, LEARNER_STATE_FILE)
        if not os.path.isfile(path):
            log.warning("resuming at step %d without a learner state (%s)", state.global_step, path)
            return None
        return torch.load(path, weights_only=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.learner is not None:
            self.learner.step(tokens=self._step_tokens(args, state))

    def on_train_end(self, args, state, control, **kwargs):
        self.leave(flush=True)

    def _step_tokens(self, args, state) -> int:
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            tokens, self._tokens_seen = seen - self._tokens_seen, seen
            return tokens
        examples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return examples * max(1, args.world_size) * self.tokens_per_sample

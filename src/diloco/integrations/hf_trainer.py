"""A Hugging Face ``transformers.Trainer`` run as a Decoupled DiLoCo learner, in one line.

    trainer.add_callback(DilocoCallback(syncer="10.0.0.5:7000", learner_id="site-a"))

The callback wraps the Trainer's model in a :class:`diloco.Learner` when training begins
(after the Trainer built its optimizer), waits for the syncer's global model so every learner
starts from the same parameters, calls ``learner.step`` after every optimizer step (the
Trainer's ``on_step_end``: after ``optimizer.step()`` and ``zero_grad()``, a step boundary),
and flushes the learner's progress and leaves the syncer when training ends. Everything else
(data, optimizer, schedule, logging, checkpoints, mixed precision) stays the Trainer's.

Tokens per step (the merge weight of this learner against the others) are the Trainer's own
count when it keeps one (``TrainingArguments(include_num_input_tokens_seen=True)``), else
examples per optimizer step × ``tokens_per_sample``.
"""

from __future__ import annotations

from transformers import TrainerCallback

from diloco.integrations.joining import JoinsAsLearner


class DilocoCallback(JoinsAsLearner, TrainerCallback):
    """Makes the Trainer's run a learner of the syncer at ``syncer`` (``HOST:PORT``).

    ``tokens_per_sample``: what one example counts for when the Trainer does not count input
    tokens; the other arguments: :class:`~diloco.integrations.joining.JoinsAsLearner`.
    """

    def __init__(self, syncer: str, *, tokens_per_sample: int = 1, **options) -> None:
        super().__init__(syncer, **options)
        self.tokens_per_sample = tokens_per_sample
        self._tokens_seen = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("DilocoCallback needs the Trainer's model")
        self.join(model, optimizer)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

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

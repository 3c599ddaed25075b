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

from diloco.config.common import ProtocolConfig
from diloco.learner.learner import Learner


class DilocoCallback(TrainerCallback):
    """Makes the Trainer's run a learner of the syncer at ``syncer`` (``HOST:PORT``).

    ``learner_id`` is its identity at the syncer (keep it across restarts to rejoin);
    ``token``: the syncer's shared secret or this learner's own token; ``fragments`` and
    ``sync_every``: P and H, as the syncer has them; ``tokens_per_sample``: what one example
    counts for when the Trainer does not count input tokens; ``join_timeout_s``: how long to
    wait for the global model at the start (the learner then trains from its own
    initialisation and joins later). Other keyword arguments go to :class:`diloco.Learner`
    (its ``LearnerConfig`` fields).
    """

    def __init__(
        self,
        syncer: str,
        *,
        learner_id: str | None = None,
        token: str | None = None,
        fragments: int = ProtocolConfig.fragments,
        sync_every: int = ProtocolConfig.sync_every,
        tokens_per_sample: int = 1,
        join_timeout_s: float = 60.0,
        **learner_options,
    ) -> None:
        self.syncer = syncer
        self.options = dict(
            learner_id=learner_id, fragments=fragments, sync_every=sync_every, **learner_options
        )
        self.token = token
        self.tokens_per_sample = tokens_per_sample
        self.join_timeout_s = join_timeout_s
        self.learner: Learner | None = None
        self.joined = False
        """Whether the global model arrived within ``join_timeout_s`` at the start."""
        self._tokens_seen = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("DilocoCallback needs the Trainer's model")
        self.learner = Learner(
            model, optimizer, syncer=self.syncer, token=self.token, **self.options
        )
        self.joined = self.learner.wait_for_global(timeout=self.join_timeout_s)
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_end(self, args, state, control, **kwargs):
        if self.learner is not None:
            self.learner.step(tokens=self._step_tokens(args, state))

    def on_train_end(self, args, state, control, **kwargs):
        if self.learner is not None:
            self.learner.close(flush=True)
            self.learner = None

    def _step_tokens(self, args, state) -> int:
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self._tokens_seen:
            tokens, self._tokens_seen = seen - self._tokens_seen, seen
            return tokens
        examples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return examples * max(1, args.world_size) * self.tokens_per_sample

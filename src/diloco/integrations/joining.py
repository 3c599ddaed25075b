"""What the framework callbacks share: the learner they make at the start of training, and
how they leave the syncer at the end."""

from __future__ import annotations

from diloco.learner.learner import Learner
from diloco.wire.protocol import ProtocolConfig


class JoinsAsLearner:
    """Holds a callback's learner settings; ``join`` makes the :class:`diloco.Learner` and
    waits for the global model, ``leave`` closes it.

    ``learner_id``: the identity at the syncer (keep it across restarts to rejoin); ``token``:
    the syncer's shared secret or this learner's own token; ``fragments`` and ``sync_every``:
    P and H, as the syncer has them; ``join_timeout_s``: how long to wait for the global model
    at the start (the learner then trains from its own initialisation and joins later). Other
    keyword arguments go to :class:`diloco.Learner` (its ``LearnerConfig`` fields).
    """

    def __init__(
        self,
        syncer: str,
        *,
        learner_id: str | None = None,
        token: str | None = None,
        num_fragments: int = ProtocolConfig.num_fragments,
        join_timeout_s: float = 60.0,
        **learner_options,
    ) -> None:
        self.syncer = syncer
        self.options = dict(learner_id=learner_id, num_fragments=num_fragments, **learner_options)
        self.token = token
        self.join_timeout_s = join_timeout_s
        self.learner: Learner | None = None
        self.joined = False
        """Whether the global model arrived within ``join_timeout_s`` at the start."""

    def join(self, model, optimizer) -> None:
        self.learner = Learner(
            model, optimizer, syncer=self.syncer, token=self.token, **self.options
        )
        self.joined = self.learner.wait_for_global(timeout=self.join_timeout_s, required=False)

    def leave(self, *, flush: bool) -> None:
        if self.learner is not None:
            self.learner.close(flush=flush)
            self.learner = None

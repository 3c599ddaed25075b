"""What the framework callbacks share: the learner they make at the start of training (from
the state the Trainer's checkpoint carried, when it resumes), and how they leave the syncer
at the end."""

from __future__ import annotations

import logging

from diloco.learner.learner import Learner
from diloco.wire.protocol import ProtocolConfig

log = logging.getLogger(__name__)


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

    def join(self, model, optimizer, state: dict | None = None) -> None:
        """Make the learner (restored from ``state``, a ``Learner.state_dict`` the Trainer's
        checkpoint carried, when it resumes) and wait for the global model. A previous life
        that delivered steps past that checkpoint is said (the Trainer trains them again
        from its own data position: their data reaches the global model twice)."""
        self.learner = Learner(
            model, optimizer, syncer=self.syncer, token=self.token, state=state, **self.options
        )
        self.joined = self.learner.wait_for_global(timeout=self.join_timeout_s, required=False)
        if self.learner.ahead_on_restore:
            log.warning(
                "the previous life delivered %d steps past the checkpoint it resumes from; "
                "the Trainer trains them again (checkpoint more often to shrink this)",
                self.learner.ahead_on_restore,
            )

    def checkpoint_state(self) -> dict:
        """The learner's state for the Trainer's checkpoint (``Learner.state_dict``); empty
        when no learner runs (before training begins or after it ended)."""
        return self.learner.state_dict() if self.learner is not None else {}

    def leave(self, *, flush: bool) -> None:
        if self.learner is not None:
            self.learner.close(flush=flush)
            self.learner = None

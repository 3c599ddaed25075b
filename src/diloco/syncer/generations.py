"""One live process per learner id: the syncer fences learners by their generation.

Two processes can come to hold one learner id: a zombie on a partitioned node beside the
replacement its launcher started (Ray's actor restart, Slurm's requeue after a node failure).
Without a fence both join in turn, each join ending the other's session, and both processes'
progress is merged under one id. So every join names its process's *generation*
(``JoinRequest.generation``): a process started later to replace another has a larger one.
The syncer keeps, per learner id, the highest generation that joined (``Generations``) and
refuses a join with a lower one for good (``check_generation``); a join with a higher one
takes the id over at once (the older process's session is gone: its uploads and heartbeats
are answered "unknown session", and its next join is refused). Generation 0 means "not
given" (a client that predates generations): it is admitted and changes nothing, so it
neither fences nor is fenced.

The highest generations survive a restart of the syncer (a zombie that reaches a restarted
syncer first must not win): with a state directory they are kept in ``generations.json``
(``GenerationFile``), written through the state directory's fence whenever an id joins with
a generation higher than known, before that join is answered, and read at start.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from diloco.syncer.records import Refused
from diloco.syncer.store import StateError, replace_atomically
from diloco.wire.protocol import SUPERSEDED_KEY

GENERATIONS_FILE = "generations.json"
"""The file of a state directory holding the highest generation of every learner id."""
MAX_GENERATION = (1 << 64) - 1
"""A generation is a uint64 on the wire."""


def check_generation(learner_id: str, generation: int, highest: int | None) -> bool:
    """Whether a join of ``learner_id`` with ``generation`` raises the highest generation known
    for it (``highest``; None: none known). Raises ``Refused("FAILED_PRECONDITION")``, with
    ``SUPERSEDED_KEY`` naming the newer generation, when a newer process of the id has
    joined. Generation 0 (not given) is admitted and raises nothing. Pure."""
    if not 0 <= generation <= MAX_GENERATION:
        raise Refused("INVALID_ARGUMENT", f"generation must be in [0, 2^64), got {generation}")
    if generation == 0:
        return False
    if highest is not None and generation < highest:
        raise Refused(
            "FAILED_PRECONDITION",
            f"learner id {learner_id[:64]!r} was superseded by a newer process of this "
            f"learner id (generation {highest} joined; this process is generation "
            f"{generation}): stop this process",
            metadata=((SUPERSEDED_KEY, str(highest)),),
        )
    return highest is None or generation > highest


class Generations:
    """The highest generation each learner id joined with. Not thread-safe: the syncer's
    state lock."""

    def __init__(self, known: dict[str, int] | None = None) -> None:
        self.highest: dict[str, int] = dict(known or {})
        self.changes = 0
        """How many times a join raised a generation (``GenerationFile.write`` compares)."""

    def admit(self, learner_id: str, generation: int) -> None:
        """Admit a join (``check_generation``: ``Refused`` for a superseded process, nothing
        changed) and remember its generation if it is the highest."""
        if check_generation(learner_id, generation, self.highest.get(learner_id)):
            self.highest[learner_id] = generation
            self.changes += 1

    def restore(self, known: dict[str, int]) -> None:
        """Take in the generations a state directory kept (the higher of both per id)."""
        for learner_id, generation in known.items():
            self.highest[learner_id] = max(generation, self.highest.get(learner_id, 0))

    def snapshot(self) -> tuple[int, dict[str, int]]:
        """``(changes, a copy of the highest generations)``: what ``GenerationFile`` writes."""
        return self.changes, dict(self.highest)


class GenerationFile:
    """``generations.json`` in a state directory: read at start, written atomically through
    the directory's ``fence`` (``diloco.syncer.fencing.Claim.check``). Thread-safe."""

    def __init__(self, root: str | os.PathLike, fence: Callable[[], None] | None = None):
        self.path = Path(root) / GENERATIONS_FILE
        self.fence = fence
        self.written = 0
        """The ``Generations.changes`` the file holds (0: nothing written by this syncer)."""
        self._lock = threading.Lock()

    def load(self) -> dict[str, int]:
        """The generations kept ({} without a file); ``StateError`` naming the file if it is
        not a JSON object of learner ids to generations (a syncer must not start without the
        fence it kept)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            known = json.loads(text)
        except ValueError as exc:
            raise StateError(f"{self.path} is not valid JSON: {exc}") from None
        if not isinstance(known, dict) or not all(
            isinstance(k, str) and type(v) is int and 0 <= v <= MAX_GENERATION
            for k, v in known.items()
        ):
            raise StateError(f"{self.path} must map learner ids to generations in [0, 2^64)")
        return known

    def write(self, snapshot: Callable[[], tuple[int, dict[str, int]]]) -> None:
        """Make the file hold the generations ``snapshot()`` returns with their
        ``Generations.changes`` (the caller makes that read safe: the state lock), unless a
        write of as many changes is done already. Writers take turns, so the file only ever
        moves to a later snapshot. ``OSError`` (disk full) or ``fencing.Superseded``: not
        written."""
        with self._lock:
            changes, known = snapshot()
            if changes <= self.written:
                return
            data = json.dumps(known, sort_keys=True, separators=(",", ":")).encode()
            replace_atomically(self.path, data, fence=self.fence)
            self.written = changes

"""How a learner waits, bounded, on the training thread: for the global model before it
trains (``wait_for_global``), for the merges of what it sent in synchronous DiLoCo
(``wait_for_merges``). The ``Waiter`` is a part the ``Learner`` holds; the decisions are
pure functions of what it holds (``holds_joined``, ``late_fragments``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from diloco.learner.progress import Progress

GLOBAL_POLL_S = 0.02
"""How often ``wait_for_global`` looks again for the fragments it waits for."""
MERGES_POLL_S = 0.005
"""How often ``wait_for_merges`` looks again (a round's lockstep: short)."""


class SyncerUnreachable(TimeoutError):
    """``wait_for_global`` timed out without this learner ever having joined its syncer (a
    wrong or dead address, a syncer not up): training on would train alone from its own
    initialization. A ``TimeoutError``, so code that catches that still does."""


def no_global_model(address: str, timeout: float, reached: bool) -> TimeoutError:
    """The error of a ``wait_for_global`` that timed out: ``SyncerUnreachable`` when the
    learner never ``reached`` the syncer at ``address``, else a plain ``TimeoutError`` (it
    joined; the global model had not all arrived). Pure."""
    if not reached:
        return SyncerUnreachable(
            f"no global model from {address} within {timeout:g} s: never reached the syncer "
            "(is it up, the address and token right? To train alone on purpose: --no-sync)"
        )
    return TimeoutError(
        f"no global model from {address} within {timeout:g} s: joined, but the global model "
        "had not all arrived (a slow link: give a longer timeout)"
    )


def holds_joined(versions: list[int], target: list[int] | None) -> bool:
    """Whether the ``versions`` held reach the versions the syncer had when this learner
    joined (``target``; None before the join). Pure.

    >>> holds_joined([3, 0], [3, -1]), holds_joined([2, 0], [3, 0]), holds_joined([1], None)
    (True, False, False)
    """
    return target is not None and all(
        h >= max(t, 0) for h, t in zip(versions, target, strict=False)
    )


def late_fragments(awaited: dict[int, tuple[int, int]], local_step: int, lag: int) -> list[int]:
    """Of the fragments ``awaited`` (p -> step sent at, base version), those sent ``lag`` or
    more steps before ``local_step``. Pure.

    >>> late_fragments({0: (10, 3), 1: (14, 3)}, 15, 2)
    [0]
    """
    return [p for p, (at, _) in awaited.items() if local_step - at >= lag]


class Waiter:
    """Waits for the global model or for merges. Given: the ``link`` (its joined versions,
    its error), the learner's ``progress`` (versions held, the fragments awaited, which it
    takes off once merged back), ``clock`` (deadlines) and the learner's own steps
    ``send_copied`` and ``apply_arrived``."""

    def __init__(
        self,
        link,
        progress: Progress,
        clock: Callable[[], float],
        send_copied: Callable[[], None],
        apply_arrived: Callable[[], int],
        give_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.link, self.progress, self.clock = link, progress, clock
        self.send_copied, self.apply_arrived = send_copied, apply_arrived
        self.give_up = give_up
        """Called when the wait times out: training starts without the first join (a
        restored learner gives up confirming its previous life's uploads)."""

    def wait_for_global(self, timeout: float = 60.0, *, required: bool = True) -> bool:
        """Block until this learner holds every fragment at least at the version the syncer had
        when it joined, and apply them; True if so within ``timeout``. Otherwise
        ``TimeoutError`` (it would train from its own initialization, apart from the fleet):
        ``SyncerUnreachable`` if it never joined the syncer at all; or, with
        ``required=False`` (training on alone is what the caller asked for), False. Either
        way a timeout calls ``give_up`` first.

        Call it once before training: a fresh learner then starts from the global model, and
        one restored from a checkpoint catches up before it sends.
        """
        deadline = self.clock() + timeout
        while True:
            if self.link.error is not None:
                raise RuntimeError(str(self.link.error))
            # the target first: the link sets it after reporting the rejoin, settled below
            target = self.link.joined_versions
            self.apply_arrived()
            if holds_joined(self.progress.versions, target):
                return True
            if self.clock() > deadline:
                self.give_up()  # (before any training step: nothing trained is lost)
                if required:
                    raise no_global_model(self.link.address, timeout, target is not None)
                return False
            time.sleep(GLOBAL_POLL_S)

    def wait_for_merges(
        self, lag: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Synchronous DiLoCo: block until every fragment sent ``lag`` or more steps ago has
        come back merged (a newer version of it applied), so no learner runs more than ``lag``
        steps ahead of a round. Returns False if ``timeout`` passed or ``stop`` was set first.

        The decoupled default never calls it: a learner there never waits for anyone.
        """
        pr = self.progress
        deadline = self.clock() + timeout
        while True:
            self.send_copied()
            self.apply_arrived()
            for p, (_, base) in list(pr.awaited.items()):
                if pr.versions[p] > base:
                    del pr.awaited[p]
            if not late_fragments(pr.awaited, pr.local_step, lag):
                return True
            if self.link.error is not None:
                raise RuntimeError(str(self.link.error))
            if self.clock() >= deadline or (stop is not None and stop.is_set()):
                return False
            time.sleep(MERGES_POLL_S)

"""What a learner had accepted after its last checkpoint, so a restart does not send it twice.

A checkpoint holds, per fragment p, the progress trained since the anchor and not yet sent
(the last ``steps_p`` steps before the checkpoint's step). A learner killed some seconds after
its checkpoint has usually sent some fragments in between. Restored from the checkpoint, it
would find that progress again in its parameters and send it a second time. So the learner
keeps a tiny *delivery log*: per fragment, the local step at which its newest accepted upload
was queued (``{"p": step, ...}`` as JSON, rewritten atomically on each acceptance).

Accepted is not merged: the round that accepted an upload can die with its syncer (admissions
are durable only at commit) or leave it out (the direction check). So a learner with an upload
journal does not take fates from this log: the first join of each syncer decides, from the
upload ids its commits hold (``Restorer.confirm_delivered``). Without a journal the log is all
there is: a fragment whose accepted upload was queued after its unsent window began
(:func:`already_delivered`, a pure function) has its checkpointed progress dropped and counted
*unknown*, neither sent again nor counted merged (``Restorer.drop_delivered``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path


def already_delivered(
    accepted_at: dict[int, int], local_step: int, steps_since: Sequence[int]
) -> list[int]:
    """Fragments whose checkpointed progress was delivered after the checkpoint.

    ``accepted_at[p]``: the local step at which the newest accepted upload of p was queued;
    ``local_step`` and ``steps_since`` are the checkpoint's. Fragment p's unsent window is
    the steps ``(local_step − steps_since[p], local_step]``; an upload queued after the window
    began carried (some of) it.
    """
    return sorted(
        p
        for p, at in accepted_at.items()
        if 0 <= p < len(steps_since) and steps_since[p] > 0 and at > local_step - steps_since[p]
    )


class DeliveryLog:
    """The delivery log at ``path``: :meth:`record` from the link's thread, :meth:`read` at
    start-up. Unreadable or malformed contents read as empty (never fatal)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._accepted: dict[int, int] = {}

    def read(self) -> dict[int, int]:
        """The log's contents (also the base :meth:`record` extends)."""
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            raw = {}
        accepted = {}
        if isinstance(raw, dict):
            for key, value in raw.items():
                if isinstance(key, str) and key.isdigit() and isinstance(value, int):
                    accepted[int(key)] = value
        with self._lock:
            self._accepted = dict(accepted)
        return accepted

    def clear(self) -> None:
        """Start a new lineage (a learner that starts without a checkpoint)."""
        with self._lock:
            self._accepted = {}
            self._write()

    def record(self, fragment: int, queued_at_step: int) -> None:
        """An upload of ``fragment`` queued at ``queued_at_step`` was accepted."""
        with self._lock:
            if queued_at_step <= self._accepted.get(fragment, -1):
                return
            self._accepted[fragment] = queued_at_step
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({str(p): s for p, s in sorted(self._accepted.items())}))
        os.replace(tmp, self.path)

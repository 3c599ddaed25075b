"""A learner's upload journal: a write-ahead line for every delta it puts on the wire.

Each ``Learner`` is one *life* (a process killed and started again is a new life) with a
random id. Before an upload leaves, its life, upload id, fragment, steps and tokens are
appended to the journal (one JSON line, one ``write`` on an ``O_APPEND`` descriptor: in the
kernel's hands before the upload is sent, so a ``kill -9`` right after cannot lose it). The
syncer's tape names the upload ids every commit merged or left out; the journal says whose
steps those were. Together they prove from outside that every step reached the global model
at most once, across learner and syncer crashes (``diloco.report.exactly_once``).

Lines::

    {"life": "9f2c…", "start": 0, "t": 1700000000.0}          a life begins at this step
    {"life": "7a1e…", "start": 275, "t": …, "carried": [275, …]}  resumed: delivered before
    {"life": "7a1e…", "found_delivered": 5, "steps": 10}  fragment 5's checkpointed
                                  progress: committed from its predecessor's last upload
    {"life": "7a1e…", "skipped": 20, "step": 295}      steps its predecessor trained past the
                                                       checkpoint, not trained again
    {"life": "9f2c…", "u": 123, "p": 3, "steps": 24, "tokens": 3072, "step": 96}
    {"life": "9f2c…", "settled": 123, "how": "accepted", "v": 7}  the syncer's answer
    {"life": "9f2c…", "settled": 123, "how": "merged", "v": 8}    the version holding it
    {"life": "9f2c…", "settled": 123, "how": "returned"}          its progress goes out again

``settled`` lines are what the learner concluded (``how``: accepted, merged, excluded,
returned, dropped); the audit compares them with the tape.

The journal is for audits; a full disk or another I/O error is logged once and the learner
goes on training without it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time

log = logging.getLogger(__name__)

JOURNAL_FILE = "uploads.jsonl"
"""The journal's name in a learner's work directory."""


def _ends_cut_short(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` is non-empty and does not end with a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


def _records(path: str | os.PathLike, since_life: str | None) -> list[dict]:
    """The journal's lines at ``path`` from the first line of life ``since_life`` on (every
    life when it is ``None`` or not in the file; ``[]`` without a readable journal)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    records = []
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(line, dict):
            records.append(line)
    lives = [r.get("life") for r in records]
    return records[lives.index(since_life) if since_life in lives else 0 :]


def journaled_returns(
    path: str | os.PathLike, since_life: str | None = None
) -> dict[int, int | None]:
    """Upload id -> the local step at which the same life next queued an upload of the same
    fragment (None: it queued none), for each upload the journal at ``path`` says was
    returned (its progress undelivered again: that next upload carried its steps), from
    the first line of life ``since_life`` on. A resumed learner must not send again, as it
    was, a delta its checkpoint holds unanswered that a later life had back."""
    fragment_of: dict[int, int] = {}
    waiting: dict[tuple[str, int], list[int]] = {}  # (life, fragment) -> returned ids
    found: dict[int, int | None] = {}
    for line in _records(path, since_life):
        try:
            if "u" in line:
                upload_id, p = int(line["u"]), int(line["p"])
                fragment_of[upload_id] = p
                for returned in waiting.pop((str(line.get("life")), p), []):
                    found[returned] = int(line["step"])
            elif line.get("how") == "returned" and int(line["settled"]) in fragment_of:
                upload_id = int(line["settled"])
                found[upload_id] = None
                key = (str(line.get("life")), fragment_of[upload_id])
                waiting.setdefault(key, []).append(upload_id)
        except (KeyError, TypeError, ValueError):
            continue
    return found


def journaled_uploads(
    path: str | os.PathLike, since_life: str | None = None
) -> list[tuple[int, int, int, int]]:
    """``(upload id, fragment, steps, local step at queueing)`` of the uploads the journal
    at ``path`` holds (``[]`` without a readable journal), from the first line of life
    ``since_life`` on (every life when it is ``None`` or not in the file). A resumed
    learner checks the ones its checkpoint cannot know of against the syncer's commits."""
    found = []
    for line in _records(path, since_life):
        if "u" in line:
            try:
                found.append(
                    (int(line["u"]), int(line["p"]), int(line["steps"]), int(line["step"]))
                )
            except (KeyError, TypeError, ValueError):
                continue
    return found


class UploadJournal:
    """The journal file at ``path`` for one learner life (``life``: its id)."""

    def __init__(
        self,
        path: str | os.PathLike,
        start_step: int,
        carried: list[int] | None = None,
        unknown: list[int] | None = None,
    ) -> None:
        """``carried``: for a life resumed from a checkpoint, per fragment the steps its
        earlier lives delivered (merged, in flight or left out, as the restored accounting
        says): the audit checks them against what the tape holds of those lives, which may
        also hold some of the ``unknown`` steps (the restored accounting's column: deltas
        whose fate no syncer could tell)."""
        self.path = path
        self.life = secrets.token_hex(6)
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._failed = False
        if _ends_cut_short(path):  # a line cut short by a kill: this life starts a new one
            self._write_bytes(b"\n")
        begin = {"life": self.life, "start": start_step, "t": round(time.time(), 3)}
        if carried is not None:
            begin["carried"] = list(carried)
            begin["unknown"] = list(unknown or [0] * len(carried))
        self._write(begin)

    def queued(self, upload_id: int, fragment: int, steps: int, tokens: int, step: int) -> None:
        """Record an upload before it is handed to the link."""
        record = {"life": self.life, "u": upload_id, "p": fragment, "steps": steps}
        self._write({**record, "tokens": tokens, "step": step})

    def found_delivered(self, fragment: int, steps: int, *, unknown: bool = False) -> None:
        """Record that the checkpointed progress of ``fragment`` (``steps`` steps) was found
        delivered by the previous life (its upload committed, its answer lost with it):
        carried, like the start line's ``carried``; ``unknown``: maybe delivered (the syncer
        no longer keeps the logs that would say), like the start line's ``unknown``."""
        line = {"life": self.life, "found_delivered": fragment, "steps": steps}
        self._write({**line, "unknown": True} if unknown else line)

    def skipped(self, steps: int, step: int) -> None:
        """Record that this life skipped ``steps`` steps its previous life trained past its
        checkpoint (``Learner.skip``), resuming at ``step``."""
        self._write({"life": self.life, "skipped": steps, "step": step})

    def settled(self, upload_id: int, how: str, version: int | None = None) -> None:
        """Record what the learner concluded about an upload (see the module docstring)."""
        record = {"life": self.life, "settled": upload_id, "how": how}
        self._write(record if version is None else {**record, "v": version})

    def _write(self, record: dict) -> None:
        self._write_bytes((json.dumps(record, separators=(",", ":")) + "\n").encode())

    def _write_bytes(self, line: bytes) -> None:
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, line)
            except OSError as exc:
                if not self._failed:
                    log.warning("upload journal %s: %s (not written from now on)", self.path, exc)
                self._failed = True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

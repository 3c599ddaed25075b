"""The receipt log: every commit's log, appended to one file of the state directory.

A commit's log (``diloco.syncer.receipts.CommitLog``: which upload ids of which learner it
merged and left out) is written twice. Into the fragment's own file, in the same rename as
Θ_p, for the fragment's last ``PERSISTED_COMMITS`` commits: so a commit and what it merged
can never disagree. And, right after that rename, appended to ``receipts.jsonl`` here, which
keeps every log a learner may still ask about (bounded): so the fates of uploads stay known
however many commits pass while a learner is cut off, across any number of restarts. A crash between the rename and the append loses nothing: at the next start the
logs the fragment files hold and this file lacks are appended (:meth:`ReceiptLog.open`).

Format: JSON lines. The first is a header, ``{"receipts": 1, "complete_from": {p: v}}``:
per fragment, the version from which the log of every commit is in the file (0 for a
directory that kept this file from its first commit; for a directory older than this file,
the oldest log its fragment files held). The others are commit logs, in commit order. A line
cut short by a crash or a full disk is cut off at the next open; a malformed line elsewhere
is a ``StateError``: the fates it would say are not guessed. So is a log of a version the
fragment files do not hold (the fragment files rolled back under their receipts), unless
the operator accepts the rollback (``diloco.syncer.lineage``): then the logs above the
fragment files are let go (``rolled_back`` says which) and the syncer starts a new lineage.

Which logs are kept is memory's decision (``Receipts``: the last ``RETAINED_COMMIT_LOGS``
and every log a learner's pin still needs, ``diloco.syncer.retention``); when the file holds
twice as many, it is rewritten without those memory let go (:meth:`ReceiptLog.compact`:
temp file, fsync, fenced rename) and ``complete_from`` moves past them. Cost per commit: one
line (~40 bytes per upload it holds) and one fsync.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from diloco.syncer.lineage import Behind, behind
from diloco.syncer.receipts import RETAINED_COMMIT_LOGS, CommitLog
from diloco.syncer.store import StateError, SyncFailed, replace_atomically, write_all

log = logging.getLogger(__name__)

RECEIPT_LOG = "receipts.jsonl"
"""The receipt log's name in the state directory."""
FORMAT = 1


def _key(log: CommitLog) -> str:
    return json.dumps(log.to_json(), separators=(",", ":"), sort_keys=True)


class ReceiptLog:
    """Appends commit logs to ``root/receipts.jsonl`` and reads them back. Not thread-safe:
    the committer is its only writer."""

    def __init__(
        self,
        root: str | os.PathLike,
        retained: int = RETAINED_COMMIT_LOGS,
        *,
        fence: Callable[[], None] | None = None,
    ) -> None:
        """``fence``: called before every write (``diloco.syncer.fencing.Claim.check``: a
        syncer another one has superseded never writes)."""
        self.path = Path(root) / RECEIPT_LOG
        self.retained = retained
        self.fence = fence
        self.complete_from: dict[int, int] = {}
        self.rolled_back: list[Behind] = []
        """Per fragment, the newest version its logs held above the fragment file's, when
        ``open`` let those logs go (a rollback accepted)."""
        self._lines = 0

    def open(
        self,
        versions: Mapping[int, int],
        embedded: Mapping[int, Sequence[CommitLog]],
        *,
        accept_rollback: bool = False,
    ) -> list[CommitLog]:
        """Read the log, or start it (``versions``: each owned fragment's version on disk;
        ``embedded``: the logs its file holds, oldest first), and append the embedded logs
        it lacks. Returns every log it keeps, in commit order; ``complete_from`` says from
        which version each fragment's logs are complete. Raises ``StateError`` or
        ``OSError``; with ``accept_rollback``, logs above the fragment files are let go
        instead (``rolled_back``)."""
        if self.path.exists():
            logs = self._read(versions, accept_rollback)
        else:
            start = {
                p: (embedded[p][0].admitted if embedded.get(p) else versions.get(p, 0))
                for p in versions
            }
            self._rewrite(start, [])
            logs = []
        kept = {_key(log) for log in logs}
        for p in sorted(embedded):
            for log in embedded[p]:
                if _key(log) not in kept and log.admitted >= self.complete_from.get(p, 0):
                    self.append(log)  # committed, but the crash came before its append
                    logs.append(log)
        return logs

    def append(self, log: CommitLog) -> None:
        """Append one commit's log and fsync it. ``OSError`` (disk full, I/O error) takes
        the line back (the file is truncated to its old size), so a retry writes the whole
        line again from scratch: every page the failed write touched is dirtied again and
        synced by the retry's fsync (a failed fsync may have left those pages clean and never
        written; a retry that only fsynced would report them written). The truncate is not
        synced: if the syncer then dies, the file holds nothing of the line, part of it (cut
        off at the next ``open``) or all of it (the true log of a commit whose fragment file
        is on disk). A truncate that fails leaves the line perhaps whole in the file, so the
        append cannot be retried: ``SyncFailed`` (the syncer fails; its restart appends what
        the fragment files hold and this log lacks)."""
        line = (_key(log) + "\n").encode()
        if self.fence is not None:
            self.fence()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, line, self.path)
                os.fsync(fd)
            except OSError as failed:
                try:
                    os.ftruncate(fd, size)  # no half line for the next append to follow
                except OSError as exc:
                    raise SyncFailed.of(self.path, exc) from failed
                raise
        finally:
            os.close(fd)
        self._lines += 1

    def compact(self, complete_from: Mapping[int, int], kept: int) -> None:
        """Once the file holds more than twice ``kept`` (the logs memory keeps,
        ``Receipts.kept``) and twice ``retained`` lines, rewrite it without the logs memory
        let go: those admitted before ``complete_from`` (``Receipts.complete_from``), which
        the header then records. Memory lets go first, so the file never holds less than
        memory; the rewrite is atomic (a crash leaves the old file or the new). An
        ``OSError`` is logged and the next call tries again (the lines are durable)."""
        if self._lines <= 2 * max(kept, self.retained):
            return
        start = dict(self.complete_from)
        for p, version in complete_from.items():
            start[p] = max(start.get(p, 0), version)
        try:
            logs = [log for log in self._read_all() if log.admitted >= start.get(log.fragment, 0)]
            self._rewrite(start, logs)
        except OSError as exc:
            log.warning("could not compact the receipt log %s: %s", self.path, exc)

    def _read(self, versions: Mapping[int, int], accept_rollback: bool) -> list[CommitLog]:
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):  # a line cut short: the append that wrote it failed
            with open(self.path, "r+b") as f:
                f.truncate(cut)
                os.fsync(f.fileno())
        lines = data[:cut].decode().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
            if header.get("receipts") != FORMAT:
                raise ValueError(f"no receipt log header (format {FORMAT})")
            self.complete_from = {int(p): int(v) for p, v in header["complete_from"].items()}
            logs = [CommitLog.from_json(json.loads(line)) for line in lines[1:]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(
                f"{self.path} is unreadable ({exc}): the fates of the uploads it holds cannot "
                "be told. Move it away to start it again from the fragment files (uploads "
                "older than their logs then count as unknown)"
            ) from None
        newest: dict[int, int] = {}
        for log in logs:
            newest[log.fragment] = max(log.version, newest.get(log.fragment, 0))
        ahead = behind(newest, {p: versions.get(p, 0) for p in newest}, newest)
        if ahead and not accept_rollback:
            first = ahead[0]
            raise StateError(
                f"{self.path} holds a commit of fragment {first.fragment} at version "
                f"{first.reached}, but its file is at version {first.version}: the fragment "
                "files were rolled back under their receipts. Start with --accept-rollback "
                "to serve them as a new lineage, or restore the newer state"
            )
        self._lines = len(logs)
        if ahead:
            self.rolled_back = ahead
            logs = [log for log in logs if log.version <= versions.get(log.fragment, 0)]
            self._rewrite(self.complete_from, logs)
        return logs

    def _read_all(self) -> list[CommitLog]:
        lines = self.path.read_text().splitlines()[1:]
        return [CommitLog.from_json(json.loads(line)) for line in lines]

    def _rewrite(self, complete_from: Mapping[int, int], logs: Sequence[CommitLog]) -> None:
        """Make the header and ``logs`` the whole file (``store.replace_atomically``)."""
        header = {
            "receipts": FORMAT,
            "complete_from": {str(p): v for p, v in complete_from.items()},
        }
        text = json.dumps(header, separators=(",", ":")) + "\n"
        text += "".join(_key(log) + "\n" for log in logs)
        replace_atomically(self.path, text.encode(), fence=self.fence)
        self.complete_from = dict(complete_from)
        self._lines = len(logs)

"""The tape's index: what a restarting syncer needs of its event tape, kept beside it.

At start a syncer needs, of the tape, only what ``diloco.syncer.store.Taped`` holds: per
fragment the newest version a ``round`` or ``recovered`` record names, and the uploads the
``dropped`` records name (to tape, as ``recovered``, what a crash kept off). The tape is
never rotated (reports read it whole, and other processes append to it), so a long run's
tape holds millions of records, and parsing it all at every restart costs seconds. The
syncer keeps ``events.jsonl.index`` instead: that ``Taped`` and the tape offset it covers,
written at start, every ``INDEX_EVERY_RECORDS`` commit records and at a clean stop. A restart
reads the index and only the tape written after its offset.

The index is a cache, never the truth: it is used only if the tape is the file it was
written for (same device and inode, at least as long, the same ``FINGERPRINT_BYTES`` bytes
just before the offset); otherwise (another run's tape, a truncated one, an unreadable
index) the whole tape is read, as without one. An index older than the tape's end costs
only a longer tail (reading a record twice changes nothing: versions are maxima, drops a
set). Its ``dropped`` set keeps only the uploads of the dropped rounds still in the commit
logs a restart checks (``keep``), so the file stays small.

Measured (2 shared cores, local disk, a tape of 1,000,000 records, 75 MB, one in ten a
``round`` record): every start of a syncer on it (``SyncerServer`` start and stop, a small
model) took 1.1 to 1.8 s, reading the whole tape (``read_taped`` alone: up to 3.2 s); with the
index the first start takes as long (it writes the index), every later one 0.025 s (reading
an index written at the tape's end: 0.1 ms).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable
from pathlib import Path

from diloco.syncer.receipts import CommitLog
from diloco.syncer.store import Taped, read_taped, replace_atomically

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".index"
"""The index of ``events.jsonl`` is ``events.jsonl.index``."""
FINGERPRINT_BYTES = 256
"""The tape bytes just before the index's offset that must match for the index to be used."""
INDEX_EVERY_RECORDS = 1024
"""The committer writes the index again after this many commit records (about one write
per 1,024 commits: an index write is one small file, fsynced and renamed)."""
FORMAT = 2
"""2: with the lineages of ``Taped`` (an index of format 1 is read as none: the whole tape)."""


class TapeIndex:
    """Reads a tape through its index and keeps the index up to date. Not thread-safe: the
    server reads it at start, then the committer is its only writer."""

    def __init__(self, tape_path: str | os.PathLike, shard: tuple[int, int] = (0, 1)) -> None:
        """``shard``: the syncer's (i, S). Shards share one tape and each keeps its own
        index (``events.jsonl.shard-1-of-4.index``): what it notes is its own commits, so its
        index holds its own fragments, the only ones its restart checks."""
        self.tape_path = Path(tape_path)
        name = self.tape_path.name + ("" if shard[1] == 1 else f".shard-{shard[0]}-of-{shard[1]}")
        self.path = self.tape_path.with_name(name + INDEX_SUFFIX)
        self.taped = Taped()
        self._noted = 0

    def read(self) -> Taped:
        """The tape's ``Taped``: from the index plus the tape after its offset when the
        index matches the tape, else from the whole tape (``Taped.read_from`` says which)."""
        taped = self._load()
        if taped is None:
            self.taped = read_taped(self.tape_path)
        else:
            self.taped = read_taped(self.tape_path, start=taped.end, taped=taped)
        return self.taped

    def note(self, record: dict, end: int) -> None:
        """A commit record this syncer taped (and synced), ending at tape offset ``end``."""
        self.taped.add(record)
        self.taped.end = max(self.taped.end, end)
        self._noted += 1

    def due(self) -> bool:
        """Whether ``INDEX_EVERY_RECORDS`` records were noted since the index was written."""
        return self._noted >= INDEX_EVERY_RECORDS

    def save(self, keep: Collection[tuple[int, int]] | None = None) -> bool:
        """Write the index of what was read and noted (``keep``: the ``(fragment, upload
        id)`` of the dropped rounds a restart may still check; None: all). A failure is
        logged and returns False: the index is a cache, a restart then reads more."""
        taped = self.taped
        dropped = taped.dropped if keep is None else taped.dropped & set(keep)
        try:
            identity = os.stat(self.tape_path)
            data = {
                "tape_index": FORMAT,
                "device": identity.st_dev,
                "inode": identity.st_ino,
                "offset": taped.end,
                "fingerprint": _fingerprint(self.tape_path, taped.end),
                "versions": {str(p): v for p, v in taped.versions.items()},
                "dropped": sorted(dropped),
                # per lineage (None: before lineages) and which lineage serves each fragment
                "lineages": [
                    [k, {str(p): v for p, v in vs.items()}] for k, vs in taped.lineages.items()
                ],
                "serving": {str(p): k for p, k in taped.serving.items()},
            }
            replace_atomically(self.path, json.dumps(data, separators=(",", ":")).encode())
        except OSError as exc:
            log.warning("could not write the tape index %s: %s", self.path, exc)
            return False
        taped.dropped = set(dropped)
        self._noted = 0
        return True

    def _load(self) -> Taped | None:
        """The index's ``Taped`` (``end``: its offset) if it matches the tape, else None."""
        try:
            data = json.loads(self.path.read_bytes())
            identity = os.stat(self.tape_path)
            offset = int(data["offset"])
            if (
                data.get("tape_index") != FORMAT
                or (data["device"], data["inode"]) != (identity.st_dev, identity.st_ino)
                or not 0 <= offset <= identity.st_size
                or data["fingerprint"] != _fingerprint(self.tape_path, offset)
            ):
                return None
            versions = {int(p): int(v) for p, v in data["versions"].items()}
            dropped = {(int(p), int(u)) for p, u in data["dropped"]}
            lineages = {k: {int(p): int(v) for p, v in vs.items()} for k, vs in data["lineages"]}
            serving = {int(p): k for p, k in data["serving"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return Taped(versions, dropped, lineages, serving, read_from=offset, end=offset)


def dropped_in(logs: Iterable[CommitLog]) -> set[tuple[int, int]]:
    """``(fragment, upload id)`` of every upload the dropped rounds among ``logs`` left out:
    what ``Taped.holds`` may be asked of those logs (a restart asks of the commit logs its
    fragment files hold, ``RoundClosing.history``)."""
    return {
        (log.fragment, u.upload_id)
        for log in logs
        if log.version <= log.admitted
        for parts in log.excluded.values()
        for u in parts
    }


def _fingerprint(path: Path, offset: int) -> str:
    """SHA-256 of the ``FINGERPRINT_BYTES`` bytes of ``path`` just before ``offset``."""
    with open(path, "rb") as f:
        f.seek(max(0, offset - FINGERPRINT_BYTES))
        return hashlib.sha256(f.read(offset - max(0, offset - FINGERPRINT_BYTES))).hexdigest()

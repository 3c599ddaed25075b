"""The commit journal: what makes a commit durable, in the compressed form it arrived in.

Every commit of a fragment but its first appends one record to the fragment's journal
(``fragments/p007.000003.journal``: fragment 7, segment 3) and fsyncs it: the commit is
*made* once that fsync returns; its receipt line, tape record and broadcast follow. A
record is a ``replay.RoundInputs``: the admitted uploads' bytes as they arrived, their
codecs, the weights, share, outer lr and momentum, the down codec, the commit log (which
uploads it merged and left out), the merged tokens and the digest of Θ_p after it.

Full snapshots of a fragment (its ``.safetensors`` file, ``diloco.syncer.store``) are
written in the background (``diloco.syncer.snapshots``). When one is due the committer
starts a new segment (``rotate``); once the snapshot is renamed into place the segments
before it are deleted (``drop_below``). Recovery is the fragment's snapshot plus the records
after it (``replay.after_snapshot``), replayed (``replay.replay``).

Record format: ``MAGIC``, the header's length (4 bytes) and the payloads' length (8 bytes,
little-endian), the header (JSON), the payloads one after the other, then a BLAKE2b digest
(16 bytes) of everything before it in the record, computed on the bytes as they are written.
A record cut short or whose digest does not match at the end of the newest segment is a
torn tail (a crash in the middle of its append: its commit was never made): the syncer cuts
it off when it opens the directory; readers pass over it. A bad record anywhere else is a
``StateError``, but for one just before a claim marker of a higher epoch (below).

**Epochs** (``diloco.syncer.fencing``). A syncer's records carry its claim's epoch in their
header (``"epoch"``; a record without one, written before epochs, is of epoch 0). Before it
reads a fragment's journal, a syncer that claimed the directory cuts off a torn tail and
appends a *claim marker* (a record of no commit: ``{"epoch": e, "marker": "claim"}``,
fsynced) to the fragment's current segment (``begin_epoch``). Readers take the segments in
order and ignore every record of an epoch lower than a marker or record already met: what a
superseded syncer appends once its successor claimed the directory (an append whose check
passed just before the claim: the check after it then fails that syncer) is never replayed,
by the successor or anyone after it. A record is written with one ``write`` on an
``O_APPEND`` descriptor, so a marker never lands inside it (an append is atomic against
another on a local filesystem); one cut short by its writer's death just before a marker
(the marker's bytes follow it) is passed over.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.syncer.files import StateError, SyncFailed, fsync_dir, write_all
from diloco.syncer.receipts import CommitLog
from diloco.syncer.replay import RoundInputs

MAGIC = b"DJR1"
CLAIM_MARKER = "claim"
"""The ``"marker"`` of a record that begins an epoch (``CommitJournal.begin_epoch``)."""
_LENGTHS = struct.Struct("<4sIQ")
_DIGEST_BYTES = 16
SUFFIX = ".journal"


def _digest():
    return hashlib.blake2b(digest_size=_DIGEST_BYTES)


def header_of(inputs: RoundInputs) -> dict:
    """The JSON part of a record (the payloads' codecs and sizes in place of their bytes)."""
    return {
        "fragment": inputs.fragment,
        "log": inputs.log.to_json(),
        "merged_tokens": inputs.merged_tokens,
        "changed": inputs.changed,
        "parts": [[[codec, len(data)] for codec, data in c] for c in inputs.contributions],
        "weights": inputs.weights,
        "share": inputs.share,
        "outer_lr": inputs.outer_lr,
        "outer_momentum": inputs.outer_momentum,
        "mean_pieces": inputs.mean_pieces,
        "down_codec": inputs.down_codec,
        "down_feedback": inputs.down_feedback,
        "digest": inputs.digest,
    }


def inputs_of(header: dict, payloads: memoryview) -> RoundInputs:
    """The record ``header_of`` and its payloads wrote (``KeyError``/``ValueError`` when
    it is not one)."""
    at, contributions = 0, []
    for parts in header["parts"]:
        contribution = []
        for codec, size in parts:
            contribution.append((str(codec), bytes(payloads[at : at + int(size)])))
            at += int(size)
        contributions.append(contribution)
    if at != len(payloads):
        raise ValueError("payload sizes do not add up")
    return RoundInputs(
        fragment=int(header["fragment"]),
        log=CommitLog.from_json(header["log"]),
        merged_tokens=int(header["merged_tokens"]),
        changed=bool(header["changed"]),
        contributions=contributions,
        weights=[float(w) for w in header["weights"]],
        share=float(header["share"]),
        outer_lr=float(header["outer_lr"]),
        outer_momentum=float(header["outer_momentum"]),
        mean_pieces=[str(n) for n in header["mean_pieces"]],
        down_codec=str(header["down_codec"]),
        down_feedback=bool(header["down_feedback"]),
        digest=str(header["digest"]),
    )


@dataclass(frozen=True)
class Entry:
    """One record of a journal: a commit (``inputs``) or a claim marker (``inputs`` None),
    written under ``epoch`` (0: before epochs)."""

    epoch: int
    inputs: RoundInputs | None


def parse(data: bytes, at: int) -> tuple[Entry, int] | None:
    """The record at offset ``at`` of ``data`` and the offset after it, or None when no
    whole, intact record starts there."""
    view = memoryview(data)
    if len(data) - at < _LENGTHS.size:
        return None
    magic, header_len, payload_len = _LENGTHS.unpack_from(data, at)
    body = at + _LENGTHS.size
    end = body + header_len + payload_len
    if magic != MAGIC or end + _DIGEST_BYTES > len(data):
        return None
    h = _digest()
    h.update(view[at:end])
    if h.digest() != data[end : end + _DIGEST_BYTES]:
        return None
    try:
        header = json.loads(bytes(view[body : body + header_len]))
        epoch = header.get("epoch", 0)
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"bad epoch {epoch!r}")
        if header.get("marker") == CLAIM_MARKER:
            return Entry(epoch, None), end + _DIGEST_BYTES
        inputs = inputs_of(header, view[body + header_len : end])
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise StateError(f"a commit journal record at offset {at} is unreadable ({exc})") from None
    return Entry(epoch, inputs), end + _DIGEST_BYTES


def scan(data: bytes, newest_epoch: int = 0) -> tuple[list[RoundInputs], int, int]:
    """The commits of one segment's bytes that count, given the highest epoch met before
    it: ``(commits, offset where the intact records end, highest epoch met)``. A record of
    an epoch below one met before it is passed over; so are bad bytes just before a claim
    marker of an epoch above every one met (a superseded syncer's append cut short)."""
    records: list[RoundInputs] = []
    at = 0
    while at < len(data):
        parsed = parse(data, at)
        if parsed is None:
            following = _next_record(data, at)
            if following is None:
                break
            entry, _ = following[1]
            if entry.inputs is not None or entry.epoch <= newest_epoch:
                break
            at = following[0]
            continue
        entry, at = parsed
        if entry.epoch < newest_epoch:
            continue  # written by a syncer superseded before it wrote
        newest_epoch = entry.epoch
        if entry.inputs is not None:
            records.append(entry.inputs)
    return records, at, newest_epoch


class CommitJournal:
    """The journal segments of one state directory's fragments. Not thread-safe for
    appends: the committer is their only writer; ``drop_below`` runs on the snapshot
    writer's thread on segments no append touches any more."""

    def __init__(
        self, fragment_dir: Path, *, fence: Callable[[], None] | None = None, epoch: int = 0
    ) -> None:
        """``fence``: called before every write, truncation and deletion
        (``diloco.syncer.fencing.Claim.check``); with one, a torn tail is cut off when read.
        ``epoch``: the claim's epoch, written into every record (0: none, as before
        epochs)."""
        self.dir = Path(fragment_dir)
        self.fence = fence
        self.epoch = epoch
        self._current: dict[int, int] = {}
        self._counting = threading.Lock()  # (a restart begins the fragments' epochs in parallel)
        self.bytes_written = 0
        """Bytes appended since this journal was opened (records and claim markers, with
        their framing)."""

    def segments(self, fragment: int) -> list[tuple[int, Path]]:
        """``(number, path)`` of the fragment's segments, oldest first."""
        found = []
        for path in self.dir.glob(f"p{fragment:03d}.*{SUFFIX}"):
            number = path.name[len(f"p{fragment:03d}.") : -len(SUFFIX)]
            if number.isdigit():
                found.append((int(number), path))
        return sorted(found)

    def size(self, fragment: int) -> int:
        """The bytes of the fragment's segments (those a restart reads; one deleted
        meanwhile, by a predecessor's snapshot writer, counts 0)."""
        total = 0
        for _, path in self.segments(fragment):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def _path(self, fragment: int, number: int) -> Path:
        return self.dir / f"p{fragment:03d}.{number:06d}{SUFFIX}"

    def current(self, fragment: int) -> int:
        """The segment the fragment's next record goes to."""
        if fragment not in self._current:
            found = self.segments(fragment)
            self._current[fragment] = found[-1][0] if found else 0
        return self._current[fragment]

    def rotate(self, fragment: int) -> int:
        """Start a new segment for the fragment's next records; returns its number (every
        record before it is in a segment below it)."""
        self._current[fragment] = self.current(fragment) + 1
        return self._current[fragment]

    def append(self, inputs: RoundInputs) -> int:
        """Append one record and fsync it (and the directory, for a new segment); returns
        the bytes written. ``OSError`` takes the record back (the file is truncated to its
        old size, so a retry writes it whole again; a syncer superseded meanwhile raises
        ``Superseded`` instead and cuts nothing); a failed fsync, or a truncation that
        fails, is ``SyncFailed`` (never retried: ``diloco.syncer.files.SyncFailed``)."""
        header = header_of(inputs)
        if self.epoch:
            header["epoch"] = self.epoch
        payloads = [data for c in inputs.contributions for _, data in c]
        return self._append(inputs.fragment, header, payloads)

    def begin_epoch(self, fragment: int) -> None:
        """Begin this journal's epoch in the fragment's journal, before the syncer reads it:
        a torn tail of the newest segment cut off, then a claim marker appended to the
        current segment and fsynced (nothing without an epoch). From then on no reader
        takes a record of a lower epoch that follows it (the module docstring)."""
        if not self.epoch:
            return
        found = self.segments(fragment)
        if found:
            self._cut_torn_tail(found[-1][1])
        self._append(fragment, {"epoch": self.epoch, "marker": CLAIM_MARKER}, [])

    def _append(self, fragment: int, header: dict, payloads: list[bytes]) -> int:
        encoded = json.dumps(header, separators=(",", ":")).encode()
        lengths = _LENGTHS.pack(MAGIC, len(encoded), sum(len(d) for d in payloads))
        pieces = [lengths, encoded, *payloads]
        h = _digest()
        for piece in pieces:
            h.update(piece)
        pieces.append(h.digest())
        record = b"".join(pieces)  # one write: no other append lands inside it
        path = self._path(fragment, self.current(fragment))
        if self.fence is not None:
            self.fence()
        new = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                write_all(fd, record, path)
            except OSError:
                if self.fence is not None:  # a successor's records may follow: never cut them
                    self.fence()
                try:
                    os.ftruncate(fd, size)
                except OSError as exc:
                    raise SyncFailed.of(path, exc) from exc
                raise
            try:
                os.fsync(fd)
            except OSError as exc:
                raise SyncFailed.of(path, exc) from exc
        finally:
            os.close(fd)
        if new:
            fsync_dir(self.dir)
        if self.fence is not None:
            self.fence()
        with self._counting:
            self.bytes_written += len(record)
        return len(record)

    def _cut_torn_tail(self, path: Path) -> None:
        """Cut off a torn tail of the segment at ``path`` (fenced, fsynced); bytes that are
        not a torn tail are left for ``read`` to report."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        _, at, _ = scan(data)
        if at < len(data) and not _holds_a_record_after(data, at):
            self._truncate(path, at)

    def _truncate(self, path: Path, size: int) -> None:
        if self.fence is not None:
            self.fence()
        os.truncate(path, size)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, fragment: int) -> list[RoundInputs]:
        """Every intact record of the fragment that counts, oldest first (a record of an
        epoch below one met before it does not: the module docstring). A torn tail of the
        newest segment is passed over (cut off when the journal has a fence: the
        syncer's own); a bad record before the end of a segment, or a torn one in an older
        segment, is a ``StateError``."""
        found = self.segments(fragment)
        records: list[RoundInputs] = []
        newest_epoch = 0
        for i, (_, path) in enumerate(found):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # (deleted by a snapshot meanwhile: a reader's race)
                continue
            counted, at, newest_epoch = scan(data, newest_epoch)
            records.extend(counted)
            if at == len(data):
                continue
            if i != len(found) - 1 or _holds_a_record_after(data, at):
                raise StateError(
                    f"{path} is corrupt at offset {at} (not a torn tail). Restore the state "
                    "directory from a backup, or start from a fresh --state-dir"
                )
            if self.fence is not None:
                self._truncate(path, at)
        return records

    def drop_below(self, fragment: int, number: int) -> None:
        """Delete the fragment's segments below ``number`` (a snapshot on disk holds all
        their records)."""
        doomed = [path for n, path in self.segments(fragment) if n < number]
        if not doomed:
            return
        if self.fence is not None:
            self.fence()
        for path in doomed:
            path.unlink(missing_ok=True)
        fsync_dir(self.dir)


def _holds_a_record_after(data: bytes, at: int) -> bool:
    """Whether an intact record starts anywhere after offset ``at`` (then the bad bytes at
    ``at`` are not a torn tail)."""
    try:
        return _next_record(data, at) is not None
    except StateError:
        return True


def _next_record(data: bytes, at: int) -> tuple[int, tuple[Entry, int]] | None:
    """The first intact record that starts after offset ``at``: ``(its offset, what
    ``parse`` makes of it)``, or None."""
    start = data.find(MAGIC, at + 1)
    while start >= 0:
        parsed = parse(data, start)
        if parsed is not None:
            return start, parsed
        start = data.find(MAGIC, start + 1)
    return None

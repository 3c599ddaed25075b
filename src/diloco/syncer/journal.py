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
``StateError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

from diloco.syncer.files import StateError, SyncFailed, fsync_dir, write_all
from diloco.syncer.receipts import CommitLog
from diloco.syncer.replay import RoundInputs

MAGIC = b"DJR1"
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


def parse(data: bytes, at: int) -> tuple[RoundInputs, int] | None:
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
        inputs = inputs_of(header, view[body + header_len : end])
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"a commit journal record at offset {at} is unreadable ({exc})") from None
    return inputs, end + _DIGEST_BYTES


class CommitJournal:
    """The journal segments of one state directory's fragments. Not thread-safe for
    appends: the committer is their only writer; ``drop_below`` runs on the snapshot
    writer's thread on segments no append touches any more."""

    def __init__(self, fragment_dir: Path, *, fence: Callable[[], None] | None = None) -> None:
        """``fence``: called before every write, truncation and deletion
        (``diloco.syncer.fencing.Claim.check``); with one, a torn tail is cut off when read."""
        self.dir = Path(fragment_dir)
        self.fence = fence
        self._current: dict[int, int] = {}
        self.bytes_written = 0
        """Bytes appended since this journal was opened (records, with their framing)."""

    def segments(self, fragment: int) -> list[tuple[int, Path]]:
        """``(number, path)`` of the fragment's segments, oldest first."""
        found = []
        for path in self.dir.glob(f"p{fragment:03d}.*{SUFFIX}"):
            number = path.name[len(f"p{fragment:03d}.") : -len(SUFFIX)]
            if number.isdigit():
                found.append((int(number), path))
        return sorted(found)

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
        old size, so a retry writes it whole again); a failed fsync, or a truncation that
        fails, is ``SyncFailed`` (never retried: ``diloco.syncer.files.SyncFailed``)."""
        header = json.dumps(header_of(inputs), separators=(",", ":")).encode()
        payloads = [data for c in inputs.contributions for _, data in c]
        lengths = _LENGTHS.pack(MAGIC, len(header), sum(len(d) for d in payloads))
        path = self._path(inputs.fragment, self.current(inputs.fragment))
        if self.fence is not None:
            self.fence()
        new = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            h, written = _digest(), 0
            try:
                for piece in (lengths, header, *payloads):
                    h.update(piece)  # the checksum of the bytes as they are written
                    write_all(fd, piece, path)
                    written += len(piece)
                write_all(fd, h.digest(), path)
            except OSError:
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
        self.bytes_written += written + _DIGEST_BYTES
        return written + _DIGEST_BYTES

    def read(self, fragment: int) -> list[RoundInputs]:
        """Every intact record of the fragment, oldest first. A torn tail of the newest
        segment is passed over (cut off when the journal has a fence: the syncer's own);
        a bad record before the end of a segment, or a torn one in an older segment, is
        a ``StateError``."""
        found = self.segments(fragment)
        records: list[RoundInputs] = []
        for i, (_, path) in enumerate(found):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # (deleted by a snapshot meanwhile: a reader's race)
                continue
            at = 0
            while at < len(data):
                parsed = parse(data, at)
                if parsed is None:
                    break
                records.append(parsed[0])
                at = parsed[1]
            if at == len(data):
                continue
            if i != len(found) - 1 or _holds_a_record_after(data, at):
                raise StateError(
                    f"{path} is corrupt at offset {at} (not a torn tail). Restore the state "
                    "directory from a backup, or start from a fresh --state-dir"
                )
            if self.fence is not None:
                self.fence()
                os.truncate(path, at)
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
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
    start = data.find(MAGIC, at + 1)
    while start >= 0:
        try:
            if parse(data, start) is not None:
                return True
        except StateError:
            return True
        start = data.find(MAGIC, start + 1)
    return False

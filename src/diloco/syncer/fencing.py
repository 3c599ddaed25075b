"""One syncer per state directory: an exclusive lock held for the process's life, and an
epoch that every write into the directory checks (fencing).

Two syncers can come to serve one directory: Ray restarting the syncer on another node over
a shared filesystem while the old one is only cut off, or a replacement started beside a
process that hangs. Without fencing the last writer wins: commits and their logs vanish and
version numbers are reused with other values. So a syncer *claims* its directory before it
reads or writes anything in it (``claim_state_dir``):

1. **The lock.** An exclusive ``flock`` on ``STATE_DIR/lock``, held until ``release`` (the
   syncer's ``stop``) or the process's death (the kernel drops it: a SIGKILLed syncer's
   successor starts at once). A second syncer finds it held and refuses to start
   (``StateError`` naming the directory and the holder; ``diloco syncer`` exits 2). The file
   stays; it names its last holder (pid, host).
2. **The epoch.** The claim then increments the integer in ``STATE_DIR/epoch`` (a file of its
   own, under 100 bytes, written to a temporary name, fsynced, renamed, the directory fsynced) and
   remembers the exact bytes it wrote (the epoch, its owner and a random nonce, so two
   claims never hold the same content). ``Claim.check`` re-reads the file and raises
   ``Superseded`` unless it still holds those bytes; the store calls it before and after
   every rename into the directory (fragment files, ``meta.json``; the syncer process's
   snapshots too). The committer fails the syncer on ``Superseded`` at once, without the
   retries it gives a full disk: every call ``UNAVAILABLE``, ``diloco syncer`` exits 3.
   Cost per commit: two ``open`` + ``read`` of that small file (about 10 µs each on a local
   disk, one metadata round trip each on NFS), against the commit's own write and two fsyncs.

A lock is not always honoured (a network filesystem without working locks: then the claim
logs a warning and relies on the epoch alone; a lock file deleted by hand). With the lock
held, two syncers never both pass a check. Without it, the check-then-write leaves one
window: a successor that claims between a stale syncer's check and its write. The stale
syncer is single-threaded in its commits, so at most the one commit it has in flight lands
after the successor's claim (and one background snapshot); the check after the write then
fails it before that commit is taped or broadcast, so no learner ever holds it. What that
write leaves never counts for the successor or anyone after it:

- **A journal append** (``diloco.syncer.journal``): every record carries its writer's epoch,
  and the successor appends a claim marker to each fragment's journal before it reads it;
  readers pass over a record of a lower epoch after a marker or record of a higher one.
  One that lands before the marker is read, and restored, by the successor.
- **A rename** (a fragment's snapshot, ``meta.json``): the file is written to a temporary
  name before the check, and the successor deletes the temporary files it finds once it
  has claimed the directory (``FragmentStore.initialize``), so the late rename finds
  nothing to rename (``FileNotFoundError``); one that landed before is read by the successor.

The event tape is append-only and shared by design (``diloco.syncer.store.EventTape``): a
stale syncer may still append records that commit nothing (joins, ticks, its ``failed``
record) until it stops.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from diloco.syncer.store import TMP_SUFFIX, StateError, replace_atomically

log = logging.getLogger(__name__)

LOCK_FILE = "lock"
"""The file of a state directory whose ``flock`` its syncer holds."""
EPOCH_FILE = "epoch"
"""The file of a state directory holding the epoch of the syncer that claimed it last."""


class Superseded(StateError):
    """Another syncer has claimed this syncer's state directory since it did: this one must
    stop and never write there again."""


@dataclass
class Claim:
    """A syncer's claim on its state directory: ``check`` before every write into it,
    ``release`` when it stops."""

    root: Path
    epoch: int
    content: bytes
    """The bytes this claim wrote to the epoch file (``check`` compares them)."""
    _lock_fd: int | None = field(default=None, repr=False)

    def check(self) -> None:
        """Raise ``Superseded`` unless the epoch file still holds this claim's epoch (also
        after ``release``: a write then is checked against a successor's claim the same
        way). A read error other than a missing or replaced file is an ``OSError``."""
        path = self.root / EPOCH_FILE
        try:
            found = path.read_bytes()
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):
                raise
            found = b""
        if found != self.content:
            raise Superseded(
                f"the state directory {self.root} was claimed by another syncer "
                f"({_describe(found)}); this one (epoch {self.epoch}) stops without writing"
            )

    @property
    def locked(self) -> bool:
        """Whether this claim still holds the directory's lock."""
        return self._lock_fd is not None

    def release(self) -> None:
        """Drop the lock (a successor may start); the epoch stays until one claims it.
        Calling it again does nothing."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def claim_state_dir(root: str | os.PathLike) -> Claim:
    """Claim ``root`` (created if missing) for this process: take its lock, then increment
    its epoch. Raises ``StateError`` when another syncer holds the lock (naming the
    directory and the holder) or the epoch file is unreadable; ``OSError`` when the epoch
    cannot be written."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    owner = f"pid {os.getpid()} on {socket.gethostname()}"
    lock_fd = _lock(root, owner)
    try:
        epoch = _read_epoch(root) + 1
        content = (
            json.dumps({"epoch": epoch, "owner": owner, "nonce": secrets.token_hex(8)}) + "\n"
        ).encode()
        tmp = root / f"{EPOCH_FILE}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        replace_atomically(root / EPOCH_FILE, content, tmp=tmp)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        raise
    return Claim(root, epoch, content, lock_fd)


def _lock(root: Path, owner: str) -> int | None:
    """The descriptor holding ``root``'s lock, or None where the filesystem has no locks."""
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateError(
            f"the state directory {root} is in use by another syncer ({holder}); stop it, "
            "or give this one another --state-dir"
        ) from None
    except OSError as exc:  # ENOLCK, EOPNOTSUPP: a filesystem that does not lock
        os.close(fd)
        log.warning("cannot lock %s (%s): fenced by its epoch alone", path, exc.strerror)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (owner + "\n").encode(), 0)
    return fd


def _read_epoch(root: Path) -> int:
    """The epoch in ``root``'s epoch file (0 without one)."""
    path = root / EPOCH_FILE
    try:
        epoch = json.loads(path.read_bytes())["epoch"]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StateError(
            f"{path} is unreadable ({exc!r}); delete it (a syncer holds no other state in it)"
        ) from None
    if not isinstance(epoch, int) or epoch < 0:
        raise StateError(f"{path} holds a bad epoch {epoch!r}; delete it")
    return epoch


def _describe(content: bytes) -> str:
    """Who holds an epoch file's content, in words."""
    try:
        found = json.loads(content)
        return f"epoch {found['epoch']}, {found['owner']}"
    except (ValueError, KeyError, TypeError):
        return "its epoch file is missing or unreadable"

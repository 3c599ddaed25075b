"""Durable syncer state: per fragment a checksummed snapshot and a commit journal, plus the
event tape.

Layout of a state directory::

    meta.json                  layout (names, shapes, pieces), its hash, the config used,
                               the lineage of its versions (``diloco.syncer.lineage``)
    lock, epoch                the running syncer's claim (``diloco.syncer.fencing``)
    fragments/p007.safetensors Θ_7, momentum_7, wire_7 (what learners hold); metadata:
                               version, the fragment's last commit logs (which uploads
                               each commit merged or left out, ``diloco.syncer.receipts``),
                               the tokens its commits merged in all, sha256 of all of it

    fragments/p007.000003.journal  segment 3 of fragment 7's commit journal
                               (``diloco.syncer.journal``): one record per commit since
                               the snapshot, the admitted uploads as they arrived

A fragment file is a *snapshot*: written to a temp file, fsync, rename, fsync of the
directory, so a crash leaves the old file or the new one. A fragment's first commit writes
one at once; later commits append a journal record (the commit is made when it is synced)
and a snapshot is written in the background when the records make it due
(``diloco.syncer.snapshots``, ``diloco.syncer.snapshot_interval``). ``load`` is the snapshot with the journal's records after it
replayed, bit for bit. Files are safetensors (no pickle); each carries a SHA-256 of its
tensor bytes, fragment id, version and commit logs, so a corrupt file is detected at start
and reported (naming the file), never silently loaded; journal records carry their own
checksum. Temporary files a crash left behind are removed when the directory is opened
again. Only one syncer writes a directory: it claims it first, and its store checks the
claim around every rename, append and deletion (``fence``), so a syncer another one has
superseded fails at its next write, and what that write left never counts
(``diloco.syncer.fencing``).

The **event tape** is an append-only JSONL file: one record per decision (join, leave,
round, refusal, injected fault, ...). Lines are written with a single ``write`` on an
``O_APPEND`` descriptor, so several processes (syncer, supervisor) can share one tape.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.algorithm.fragments import FragmentLayout
from diloco.runtime.atomic_files import replace_atomically_with
from diloco.syncer.files import (  # noqa: F401 (the store's API, as before)
    TMP_SUFFIX,
    StateError,
    SyncFailed,
    replace_atomically,
    write_all,
)
from diloco.syncer.journal import CommitJournal
from diloco.syncer.lineage import new_lineage
from diloco.syncer.receipts import CommitLog
from diloco.syncer.replay import Recovered, after_snapshot, replay
from diloco.syncer.restart_times import RestartTimes
from diloco.syncer.snapshot_file import raw_bytes, read_snapshot, tensor_digest, write_snapshot

log = logging.getLogger(__name__)

_RECOVER = (
    "Restore the file from a backup of the state directory, or start from a fresh --state-dir "
    "(see 'Recovering from a corrupt state file' in docs/security.md)"
)


def file_digest(
    tensors: dict[str, torch.Tensor],
    fragment: str,
    version: str,
    commits: str = "",
    merged_tokens: str = "",
) -> str:
    """Checksum stored in a fragment file: its tensors *and* its fragment id, version,
    commit logs and merged tokens (a bit flip in the metadata is as harmful as one in Θ)."""
    return digest_of_file(tensor_digest(tensors), fragment, version, commits, merged_tokens)


def digest_of_file(
    tensors_digest: str, fragment: str, version: str, commits: str = "", merged_tokens: str = ""
) -> str:
    """``file_digest`` from the ``tensor_digest`` of the file's tensors."""
    h = hashlib.sha256(tensors_digest.encode())
    h.update(f"fragment={fragment};version={version}".encode())
    if commits:
        h.update(f";commits={commits}".encode())
    if merged_tokens:
        h.update(f";merged_tokens={merged_tokens}".encode())
    return h.hexdigest()


def state_hash(versions: Sequence[int], params: Sequence[torch.Tensor]) -> str:
    """Hash of a syncer's committed state (versions and every Θ_p): equal iff identical."""
    h = hashlib.sha256(json.dumps(list(versions)).encode())
    for t in params:
        h.update(raw_bytes(t.detach().cpu().contiguous()))
    return h.hexdigest()


class FragmentStore:
    """Reads and writes one syncer's state directory.

    ``fence``: called before and after every rename into the directory (raising refuses
    the write; a syncer passes its ``diloco.syncer.fencing.Claim.check``, so a syncer another
    one has superseded never writes). Without one (export, audits, tools) nothing is
    checked: only a syncer's store writes, and it has claimed the directory first.
    ``epoch``: the claim's epoch, which the commit journal writes into its records and
    begins in each fragment's journal before ``load`` reads it (``CommitJournal.begin_epoch``).
    ``times``: where ``load`` adds the seconds of its parts (``diloco.syncer.restart_times``).
    ``load`` of different fragments may run on several threads at once."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        fence: Callable[[], None] | None = None,
        epoch: int = 0,
        times: RestartTimes | None = None,
    ) -> None:
        self.root = Path(root)
        self.fence = fence
        self.fragment_dir = self.root / "fragments"
        self.lineage: str | None = None
        """The lineage of the directory's versions (``diloco.syncer.lineage``), read or made
        by ``initialize``; None for a directory made before lineages (``set_lineage``)."""
        self.created = False
        """Whether ``initialize`` made the directory (nothing in it was restored)."""
        self._commits: dict[int, list[CommitLog]] = {}
        self._merged_tokens: dict[int, int | None] = {}
        self.journal = CommitJournal(self.fragment_dir, fence=fence, epoch=epoch)
        """The commit journal (``diloco.syncer.journal``): what makes a commit durable."""
        self.replayed: dict[int, int] = {}
        """Per fragment ``load`` read, the journal records it replayed onto the snapshot."""
        self.digests: dict[int, str | None] = {}
        """Per fragment ``load`` read, ``fragment_digest`` of the Θ_p it returned when the
        replay computed it (None: not computed)."""
        self.layout: FragmentLayout | None = None
        self.times = times if times is not None else RestartTimes()
        """Where ``load``'s time goes (its ``restore`` parts, ``diloco.syncer.restart_times``);
        ``load`` may run on several threads at once, one fragment each."""

    def path(self, fragment: int) -> Path:
        return self.fragment_dir / f"p{fragment:03d}.safetensors"

    def initialize(
        self, layout: FragmentLayout, config: dict, *, shard: tuple[int, int] = (0, 1)
    ) -> None:
        """Create the directory, or check that an existing one holds the same model and, for a
        sharded syncer, the same shard (``--shard i/S``; a directory written before shards
        existed counts as 0/1). Temporary files a crash left behind are removed. A new
        directory gets a new lineage; an existing one's is read into ``lineage``."""
        self.fragment_dir.mkdir(parents=True, exist_ok=True)
        for leftover in [
            *self.root.glob("*" + TMP_SUFFIX),
            *self.fragment_dir.glob("*" + TMP_SUFFIX),
        ]:
            leftover.unlink(missing_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError) as exc:
                raise StateError(
                    f"{meta_path} is unreadable ({exc}); move the state directory away to start fresh"
                ) from None
            if meta.get("layout_hash") != layout.hash:
                raise StateError(
                    f"{self.root} holds the state of another model or fragmentation "
                    f"(layout hash {meta.get('layout_hash')!r} != {layout.hash!r}); use another --state-dir"
                )
            had = tuple(meta.get("shard", (0, 1)))
            if had != tuple(shard):
                raise StateError(
                    f"{self.root} holds the state of shard {had[0]}/{had[1]}, this syncer is "
                    f"shard {shard[0]}/{shard[1]}; give each shard its own --state-dir"
                )
            lineage = meta.get("lineage")
            self.lineage = lineage if isinstance(lineage, str) and lineage else None
            self.layout = layout
            return
        meta = {
            "layout_hash": layout.hash,
            "layout": layout.to_dict(),
            "config": config,
            "shard": list(shard),
            "lineage": new_lineage(),
        }
        self._write_meta(meta)
        self.lineage, self.created = meta["lineage"], True
        self.layout = layout

    def set_lineage(self, lineage: str) -> None:
        """Make ``lineage`` the directory's (a rollback the operator accepted, or a
        directory made before lineages): ``meta.json`` rewritten, whole or not at all."""
        meta = json.loads((self.root / "meta.json").read_text())
        self._write_meta({**meta, "lineage": lineage})
        self.lineage = lineage

    def _write_meta(self, meta: dict) -> None:
        meta_path = self.root / "meta.json"
        replace_atomically(  # on disk before the rename makes it the directory's meta.json
            meta_path,
            json.dumps(meta, indent=1).encode(),
            tmp=meta_path.with_suffix(TMP_SUFFIX),
            fence=self.fence,
        )

    def save(
        self,
        fragment: int,
        version: int,
        params: torch.Tensor,
        momentum: dict[str, torch.Tensor],
        *,
        wire: torch.Tensor | None = None,
        commits: list[dict] | None = None,
        merged_tokens: int | None = None,
    ) -> None:
        """Atomically write fragment ``fragment`` at ``version`` (returns once it is on disk).

        ``wire``: the value learners holding ``version`` hold (``diloco.syncer.service``);
        ``commits``: the fragment's last commit logs (``receipts.CommitLog.to_json``), this
        version's last; ``merged_tokens``: the tokens its commits merged in all
        (``RoundClosing.merged_tokens``; None: not kept). Raises ``OSError`` (disk full, I/O
        error) with the old file intact and no temporary file left; whatever ``fence``
        raises (``Superseded``) before the rename, with the old file intact, or after it."""
        tensors = {"params": params.detach().contiguous()}
        if "momentum" in momentum:
            tensors["momentum"] = momentum["momentum"].detach().contiguous()
        if wire is not None:
            tensors["wire"] = wire.detach().contiguous()
        logs = json.dumps(commits or [], separators=(",", ":")) if commits else ""
        tokens = "" if merged_tokens is None else str(int(merged_tokens))
        meta = {
            "fragment": str(fragment),
            "version": str(version),
            "sha256": file_digest(tensors, str(fragment), str(version), logs, tokens),
        }
        if logs:
            meta["commits"] = logs
        if tokens:
            meta["merged_tokens"] = tokens
        final = self.path(fragment)
        tmp = final.with_name(final.name + f".{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        replace_atomically_with(
            final, lambda file: write_snapshot(file, tensors, meta), tmp=tmp, fence=self.fence
        )

    def load(
        self, fragment: int, numel: int
    ) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None:
        """Return ``(version, params, state)`` of a fragment as its last commit made it, or
        ``None`` (never committed): its snapshot with the commit journal's records after it
        replayed (``diloco.syncer.replay``); ``state`` holds ``"momentum"`` and ``"wire"``
        where they were kept. The commit logs and merged tokens are read by
        ``load_commits`` and ``load_merged_tokens``; ``replayed`` says how many records
        were replayed. Raises ``StateError`` if a file is corrupt (bad format, checksum,
        shape) or the journal does not follow its snapshot. A reader beside a running
        syncer (no ``fence``) tries again when a snapshot landed while it read."""
        for attempt in range(1 if self.fence is not None else 3):
            try:
                return self._recover(fragment, numel)
            except StateError:
                if attempt == (0 if self.fence is not None else 2):
                    raise
        return None

    def _recover(self, fragment: int, numel: int):
        with self.times.timing("journal"):
            if self.path(fragment).exists():  # (a fragment without one has no journal to write)
                self.journal.begin_epoch(fragment)
        snapshot = self.load_snapshot(fragment, numel)
        with self.times.timing("journal"):
            records = self.journal.read(fragment)
        if snapshot is None:
            if records:
                raise StateError(
                    f"{self.path(fragment)} is missing (its journal is not). {_RECOVER}"
                )
            return None
        version, params, state = snapshot
        history, tokens = self.load_commits(fragment), self.load_merged_tokens(fragment)
        recovered = Recovered(version, params, state, history, tokens)
        pending = after_snapshot(records, history, version)
        if pending:
            with self.times.timing("replay", count=len(pending)):
                replay(recovered, pending, self._pieces(fragment), self.path(fragment))
        self._commits[fragment] = recovered.history
        self._merged_tokens[fragment] = recovered.merged_tokens
        self.replayed[fragment] = recovered.replayed
        self.digests[fragment] = recovered.digest
        return recovered.version, recovered.params, recovered.state

    def _pieces(self, fragment: int):
        """The fragment's pieces (``fragments.Fragment``), from ``meta.json`` if need be."""
        if self.layout is None:
            meta = json.loads((self.root / "meta.json").read_text())
            self.layout = FragmentLayout.from_dict(meta["layout"])
        return self.layout.fragments[fragment]

    def load_snapshot(
        self, fragment: int, numel: int
    ) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None:
        """``load`` of the fragment's snapshot file alone (no journal replayed)."""
        path = self.path(fragment)
        if not path.exists():
            return None
        try:
            read = read_snapshot(path)
        except Exception as exc:  # (a damaged file: bad header or ranges, cut short, unreadable)
            raise StateError(f"{path} is corrupt ({exc}). {_RECOVER}") from None
        tensors, meta = read.tensors, read.metadata
        self.times.add("read", read.read_s)
        self.times.add("checksum", read.checksum_s)
        if meta.get("sha256") != digest_of_file(
            read.tensor_digest,
            str(meta.get("fragment")),
            str(meta.get("version")),
            meta.get("commits", ""),
            meta.get("merged_tokens", ""),
        ):
            raise StateError(f"{path} is corrupt: checksum mismatch. {_RECOVER}")
        if meta.get("fragment") != str(fragment) or "params" not in tensors:
            raise StateError(f"{path} does not hold fragment {fragment}")
        params = tensors["params"]
        if params.dtype != torch.float32 or params.numel() != numel:
            raise StateError(
                f"{path}: expected {numel} float32 values, found {params.numel()} {params.dtype}"
            )
        try:
            version = int(meta["version"])
        except (KeyError, ValueError):
            raise StateError(f"{path}: missing or bad version") from None
        if version < 0:
            raise StateError(f"{path}: negative version {version}")
        extra = {k: tensors[k] for k in ("momentum", "wire") if k in tensors}
        for name, t in extra.items():
            if t.dtype != torch.float32 or t.shape != params.shape:
                raise StateError(f"{path}: {name} does not match the parameters' shape or dtype")
        self._commits[fragment] = _parse_commits(path, meta.get("commits", ""), fragment)
        self._merged_tokens[fragment] = _parse_merged_tokens(path, meta.get("merged_tokens"))
        return version, params, extra

    def load_commits(self, fragment: int) -> list[CommitLog]:
        """The commit logs saved with the fragment ``load`` read last (oldest first; empty
        for a file written before logs were kept)."""
        return list(self._commits.get(fragment, ()))

    def load_merged_tokens(self, fragment: int) -> int | None:
        """The merged tokens saved with the fragment ``load`` read last (None: a file
        written before they were kept)."""
        return self._merged_tokens.get(fragment)


def _parse_merged_tokens(path: Path, text: str | None) -> int | None:
    """The merged tokens of a fragment file's metadata (checksummed already)."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()):
        raise StateError(f"{path}: bad merged tokens {text[:32]!r}. {_RECOVER}")
    return int(text)


def _parse_commits(path: Path, text: str, fragment: int) -> list[CommitLog]:
    """The commit logs of a fragment file's metadata (checksummed already)."""
    if not text:
        return []
    try:
        logs = [CommitLog.from_json(item) for item in json.loads(text)]
    except (ValueError, TypeError) as exc:
        raise StateError(f"{path}: unreadable commit logs ({exc}). {_RECOVER}") from None
    if any(log.fragment != fragment for log in logs):
        raise StateError(f"{path}: commit logs of another fragment. {_RECOVER}")
    return logs


class EventTape:
    """Append-only JSONL log of decisions; safe to share between processes.

    ``append`` raises ``OSError`` when the line could not be written whole (disk full):
    the committer retries its records and fails the syncer when it cannot. A line cut short
    by such an error is closed by the next append's leading newline, so it stays one
    unreadable line (skipped by readers) and never swallows the next record.
    ``try_append`` is for records the run can do without (joins, refusals): it logs the
    error and goes on.

    A failed ``fsync`` (``append(sync=True)``) raises ``SyncFailed``, and so does every later
    ``append(sync=True)``, without writing: the record whose fsync failed is in the file or
    lost, and no later fsync can say which, so none may report a success. It is never written
    again either (the tape is shared and append-only: there is no taking a line back). The
    syncer fails; its restart reads the tape and writes a ``recovered`` record for every
    commit on disk the tape lacks (``server.recovered_record``), so the commit is taped once.
    What the restart cannot see: a record the page cache still shows whose writeback failed,
    evicted later (a machine whose disk fails under it; its fragment files, synced, stay
    whole)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._torn = not _ends_a_line(self.path)  # an earlier process's line cut short
        self._sync_failed: SyncFailed | None = None
        """The failed fsync that ends this tape's synced appends (see the class docstring)."""
        self.errors = 0
        """Records ``try_append`` could not write."""
        self.end = 0
        """The tape offset just past the line the last ``append`` wrote."""

    def append(self, record: dict, *, sync: bool = False) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                return
            if sync and self._sync_failed is not None:
                raise self._sync_failed
            data = b"\n" + line if self._torn else line
            self._torn = True  # until the whole line is known to be written
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write to the event tape {self.path}")
            self._torn = False
            self.end = os.lseek(self._fd, 0, os.SEEK_CUR)  # (O_APPEND: just past this line)
            if sync:
                try:
                    os.fsync(self._fd)
                except OSError as exc:
                    self._sync_failed = SyncFailed.of(self.path, exc)
                    raise self._sync_failed from exc

    def try_append(self, record: dict) -> bool:
        """``append``; an ``OSError`` is logged (once per 100) and counted, not raised."""
        try:
            self.append(record)
            return True
        except OSError as exc:
            self.errors += 1
            if self.errors % 100 == 1:
                log.warning("event tape %s: %s (%d records lost)", self.path, exc, self.errors)
            return False

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _ends_a_line(path: Path) -> bool:
    """Whether the file is empty or its last byte ends a line."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass
class Taped:
    """What a tape records of the commits: the newest version of each fragment (``round``
    and ``recovered`` records) and ``(fragment, upload id)`` of every upload a ``dropped``
    record (or a recovered log of one) names. ``lineages``: the same newest versions per
    lineage (``diloco.syncer.lineage``): a record of fragment p belongs to the lineage of the
    last ``start`` record serving p before it (``serving``), whose own versions count too
    (None: a start record, or none, from before lineages). ``read_from``: the tape offset
    this reading began at (0: the whole tape); ``end``: the offset just past the last whole
    line read."""

    versions: dict[int, int] = field(default_factory=dict)
    dropped: set[tuple[int, int]] = field(default_factory=set)
    lineages: dict[str | None, dict[int, int]] = field(default_factory=dict)
    serving: dict[int, str | None] = field(default_factory=dict)
    read_from: int = 0
    end: int = 0

    def of_lineage(self, lineage: str | None) -> Taped:
        """What the tape records of one lineage's versions, with those of no lineage (a
        tape from before lineages: the same directory's, as far as anyone can tell); the
        uploads dropped: all."""
        versions = dict(self.lineages.get(None, {}))
        for p, v in self.lineages.get(lineage, {}).items():
            versions[p] = max(v, versions.get(p, 0))
        return Taped(versions, self.dropped, self.lineages, dict(self.serving))

    def holds(self, log: CommitLog) -> bool:
        """Whether the tape has a record of this persisted commit log."""
        if log.version > log.admitted:  # a commit: by its version
            return log.version <= self.versions.get(log.fragment, 0)
        ids = {(log.fragment, u.upload_id) for parts in log.excluded.values() for u in parts}
        return ids <= self.dropped  # a dropped round (no version): by its uploads

    def add(self, record: dict) -> None:
        """Take in one tape record (any event; only starts' and commits' records count)."""
        for p, v in _started(record, self.serving).items():
            lineage = self.lineages.setdefault(self.serving[p], {})
            lineage[p] = max(v, lineage.get(p, 0))
        for p, v in taped_versions([record]).items():
            self.versions[p] = max(v, self.versions.get(p, 0))
            lineage = self.lineages.setdefault(self.serving.get(p), {})
            lineage[p] = max(v, lineage.get(p, 0))
        event = record.get("event")
        if event == "dropped":
            for parts in record.get("excluded_uploads", {}).values():
                self.dropped.update((int(record["fragment"]), int(u[0])) for u in parts)
        for log in record.get("commits", []) if event == "recovered" else []:
            if log["version"] == log["admitted"]:
                for parts in log["excluded"].values():
                    self.dropped.update((int(log["fragment"]), int(u[0])) for u in parts)


WANTED = (b'"round"', b'"recovered"', b'"dropped"', b'"start"')
"""The tape records ``read_taped`` parses (the others are passed over unparsed)."""


def read_taped(path: str | os.PathLike, *, start: int = 0, taped: Taped | None = None) -> Taped:
    """``Taped`` of the tape at ``path`` from offset ``start`` on, added to ``taped`` (a
    tape index's, ``diloco.syncer.tape_index``), read a line at a time (a restart does not
    hold the tape in memory); empty when there is no tape."""
    from diloco.runtime.jsonl import parse_lines

    taped = taped if taped is not None else Taped()
    taped.read_from = taped.end = start
    try:
        with open(path, "rb") as f:
            f.seek(start)
            for line in f:
                if line.endswith(b"\n"):
                    taped.end += len(line)
                if not any(k in line for k in WANTED):
                    continue  # (most records: decided without parsing them)
                for r in parse_lines([line]):
                    taped.add(r)
    except FileNotFoundError:
        pass
    return taped


def _started(record: dict, serving: dict[int, str | None]) -> dict[int, int]:
    """For a ``start`` record: note in ``serving`` that its lineage serves its fragments
    from here on, and return the version it started each at; ``{}`` for other records."""
    if record.get("event") != "start":
        return {}
    versions = record.get("versions") or []
    fragments = record.get("fragments")
    owned = range(len(versions)) if fragments is None else fragments
    lineage = record.get("lineage")
    started = {}
    for p in owned:
        serving[int(p)] = lineage
        if 0 <= int(p) < len(versions):
            started[int(p)] = int(versions[int(p)])
    return started


def read_tape(path: str | os.PathLike) -> list[dict]:
    """All complete records of a tape (a torn last line from a crash is skipped); raises
    ``OSError`` if there is no tape."""
    from diloco.runtime.jsonl import read_jsonl

    return read_jsonl(path, missing_ok=False)


def taped_versions(records: list[dict]) -> dict[int, int]:
    """The newest version of each fragment that the tape records as committed (``round``
    records, and ``recovered`` records written by a restart)."""
    newest: dict[int, int] = {}
    for r in records:
        if r.get("event") in ("round", "recovered"):
            p, v = int(r["fragment"]), int(r["version"])
            newest[p] = max(v, newest.get(p, 0))
    return newest

"""Full fragment snapshots, written in the background at a bounded interval (a part the
committer holds: ``Committer.snapshots``).

A fragment's first commit has no snapshot to replay onto: it is written whole, at once
(``first``); its first cycle is shorter by a head start that spreads the fragments'
snapshots over the clock's cycles (``first_cycle_head_start``). Every later commit appends
its journal record (``diloco.syncer.journal``); once a fragment's records past its snapshot
make a new one due (``diloco.syncer.snapshot_interval``: by their bytes, or every
``SyncerConfig.commits_per_snapshot`` records), the committer asks for it
(``after_commit``): the journal moves on to a new segment and the snapshot's tensors
(copies of the commit's Θ_p and momentum, and the new wire image, which nothing changes
afterwards) go to the writer thread. A commit never waits for a snapshot; a newer
request for a fragment replaces one still waiting. The writer renames the file into place
(``FragmentStore.save``: temp file, fsync, fenced rename, directory fsync), then deletes the
journal segments the snapshot holds. A snapshot that cannot be written (disk full) is tried
again after the fragment's next commit, its journal kept meanwhile; one refused by the claim
(``fencing.Superseded``) fails the syncer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.syncer.fencing import Superseded
from diloco.syncer.records import Commit, copied
from diloco.syncer.snapshot_interval import (
    MAX_RECORDS,
    first_cycle_head_start,
    records_per_snapshot,
    snapshot_bytes,
    snapshot_due,
)
from diloco.syncer.stage_times import StageTimes
from diloco.syncer.store import FragmentStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """One fragment's state after a commit, to write whole; ``segment``: the journal segment
    that commit's successors go to (the segments below it are then let go)."""

    commit: Commit
    wire: torch.Tensor
    segment: int


class Snapshots:
    """Decides when each fragment is snapshotted and writes the snapshots on its thread."""

    def __init__(
        self,
        store: FragmentStore,
        every: int,
        since: dict[int, int | None],
        *,
        numel: dict[int, int],
        journal_bytes: dict[int, int] | None = None,
        on_failure: Callable[[BaseException], None],
        note: Callable[[dict], None],
        stage_times: StageTimes | None = None,
    ) -> None:
        """``every``: K, 0 for the automatic interval (``snapshot_interval``); ``since``:
        per fragment, the journal records past its snapshot at start (None: no snapshot
        yet); ``numel``: per fragment, its values; ``journal_bytes``: per fragment, the
        bytes of those records at start; ``on_failure``: called with ``Superseded`` (the
        syncer must stop writing); ``note``: a tape record the run can do without;
        ``stage_times``: where each snapshot's write is timed (its ``snapshot`` stage)."""
        self.store = store
        self.every = every
        self.since = dict(since)
        self.full_bytes = {p: snapshot_bytes(numel[p]) for p in since}
        """Per fragment, a snapshot's bytes (``snapshot_interval.snapshot_bytes``)."""
        self.journal_bytes = {p: (journal_bytes or {}).get(p, 0) for p in since}
        """Per fragment, the bytes of its journal records past its snapshot."""
        self.rank = {p: rank for rank, p in enumerate(sorted(since))}
        """Per fragment, its rank among the served: where its first cycle starts
        (``snapshot_interval.first_cycle_head_start``)."""
        self._first_cycle: set[int] = set()
        """Fragments written whole whose first record is still to come (its head start)."""
        self.on_failure = on_failure
        self.note = note
        self.stage_times = stage_times if stage_times is not None else StageTimes()
        self.written = 0
        """Snapshots the writer has put in place."""
        self._waiting: dict[int, Snapshot] = {}
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="snapshots", daemon=True)
        """Started with the first snapshot asked for: a syncer that never commits (or is
        never started) holds no thread, and the thread holds nothing of it."""

    def first(self, fragment: int) -> bool:
        """Whether the fragment has no snapshot yet: its commit is written whole, at once
        (then ``written_whole``), not journalled."""
        return self.since.get(fragment) is None

    def written_whole(self, fragment: int) -> None:
        """A commit of the fragment was written as a snapshot, synchronously: its next one is
        due after an interval less its head start (taken at its first record, whose size
        says the interval)."""
        with self._cond:
            self.since[fragment], self.journal_bytes[fragment] = 0, 0
            self._first_cycle.add(fragment)

    def after_commit(self, commit: Commit, wire: torch.Tensor, record_bytes: int) -> None:
        """A commit's journal record (``record_bytes`` long) is on disk: count it, and hand
        the fragment to the writer when a snapshot is due (committer thread, never
        blocking). The counters change under the lock the writer takes to mark a failed
        snapshot due again, so neither update is lost."""
        p = commit.fragment
        full = self.full_bytes.get(p) or snapshot_bytes(commit.params.numel())
        with self._cond:
            since = (self.since.get(p) or 0) + 1
            journal = self.journal_bytes.get(p, 0) + record_bytes
            if p in self._first_cycle:
                self._first_cycle.discard(p)
                interval = records_per_snapshot(record_bytes, full, self.every)
                ahead = first_cycle_head_start(self.rank.get(p, 0), len(self.rank), interval)
                since, journal = since + ahead, journal + ahead * record_bytes
            due = snapshot_due(since, journal, full, self.every) and not self._closed
            self.since[p], self.journal_bytes[p] = (0, 0) if due else (since, journal)
        if not due:
            return
        job = Snapshot(copied(commit), wire, self.store.journal.rotate(p))
        with self._cond:
            if self._closed:
                return
            self._waiting[p] = job
            self._cond.notify()
            if not self._thread.is_alive():
                self._thread.start()

    def idle(self) -> bool:
        """Whether no snapshot is waiting or being written."""
        with self._cond:
            return not self._waiting and not self._busy

    def close(self, timeout: float) -> None:
        """Stop taking requests; let the snapshot being written finish (at most ``timeout``
        seconds), drop those waiting (their commits are in the journal)."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                fragment = min(self._waiting)
                job = self._waiting.pop(fragment)
                self._busy = True
            try:
                self._write(job)
            finally:
                del job  # (its tensors are not kept until the next snapshot)
                with self._cond:
                    self._busy = False

    def _write(self, job: Snapshot) -> None:
        commit = job.commit
        try:
            with self.stage_times.timing("snapshot"):
                self.store.save(
                    commit.fragment,
                    commit.version,
                    commit.params,
                    commit.momentum,
                    wire=job.wire,
                    commits=commit.history,
                    merged_tokens=commit.merged_tokens,
                )
            self.store.journal.drop_below(commit.fragment, job.segment)
            self.written += 1
        except Superseded as exc:
            self.on_failure(exc)
        except OSError as exc:  # the journal holds the commits: tried again later
            log.warning("snapshot of fragment %d failed: %s", commit.fragment, exc)
            with self._cond:  # (due again at the fragment's next commit)
                self.since[commit.fragment] = self.every or MAX_RECORDS
            self.note({"event": "snapshot_failed", "fragment": commit.fragment, "error": str(exc)})

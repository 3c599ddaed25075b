"""Fencing a state directory where ``flock`` does not work (issue 46, defect 2): a syncer
superseded while a write of its own is in flight must not leave that write where its
successor's readers take it. The lock is disabled the way a filesystem without locks
disables it (``flock`` fails with ENOLCK: the claim then fences by its epoch alone).

Real servers on loopback, a raw client whose uploads each close a round at once (one
commit per upload), the real claim, commit journal and snapshots.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import pytest
import torch
from kit import join_and_upload, local_syncer, tiny_model, wait_until

from diloco.syncer.config import SyncerConfig
from diloco.syncer.fencing import Superseded
from diloco.syncer.journal import SUFFIX, CommitJournal, parse
from diloco.syncer.receipts import CommitLog
from diloco.syncer.replay import RoundInputs
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import FragmentStore, StateError, read_tape

P = 2


@pytest.fixture
def no_locks(monkeypatch):
    """A filesystem that does not lock: every ``flock`` fails with ENOLCK."""

    def flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def start_syncer(state_dir, **options) -> SyncerServer:
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0, **options.pop("config", {}))
    return local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=P,
        state_dir=state_dir,
        **options,
    )


def taped_round(tape, version: int, learner: str) -> bool:
    """Whether the tape holds the round record of fragment 0's ``version`` by ``learner``."""
    if not tape.exists():
        return False
    return any(
        r["event"] == "round"
        and r["fragment"] == 0
        and r["version"] == version
        and r["participants"] == [learner]
        for r in read_tape(tape)
    )


def test_a_stale_syncers_journal_append_after_its_successor_claimed_is_ignored(tmp_path, no_locks):
    """Found by review: (1) the stale syncer's check before its append passes; (2) the
    successor claims the directory and reads the journal; (3) the stale append lands (the
    check after it fails the stale syncer); (4) the successor commits the same version. The
    journal held two records from version 1, and every later restore replayed the stale one
    and then failed on a gap in the journal."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    old = start_syncer(state, tape_path=tape)
    successor: list[SyncerServer] = []
    try:
        assert join_and_upload(old, 1).accepted  # version 1: the fragment's snapshot
        wait_until(lambda: taped_round(tape, 1, "a"), timeout=60)
        checked = old.store.journal.fence

        def check_then_a_successor_claims() -> None:
            checked()
            if not successor:
                successor.append(start_syncer(state, tape_path=tape))

        old.store.journal.fence = check_then_a_successor_claims
        assert join_and_upload(old, 2, base=1).accepted  # version 2: a journal record
        wait_until(lambda: old.failure is not None, timeout=60)
        assert isinstance(old.failure, Superseded)
        (new,) = successor
        assert new.state.versions[0] == 1
        assert join_and_upload(new, 3, learner_id="b", base=1).accepted
        wait_until(lambda: taped_round(tape, 2, "b"), timeout=60)
        served = new.state.params[0].clone()
    finally:
        old.stop()
        for server in successor:
            server.stop()
    numel = old.layout.fragments[0].numel
    version, params, _ = FragmentStore(state).load(0, numel)
    assert version == 2 and torch.equal(params, served)
    restarted = start_syncer(state)
    try:
        assert restarted.state.versions[0] == 2
        assert torch.equal(restarted.state.params[0], served)
    finally:
        restarted.stop()


def test_a_stale_syncers_late_snapshot_does_not_replace_its_successors(
    tmp_path, no_locks, monkeypatch
):
    """The snapshot's window: the stale syncer's snapshot writer passes its check, then
    stalls before its rename while the successor claims the directory, commits, writes a
    newer snapshot and deletes the journal before it. Were the stale rename to land, every
    later restore would go back to the stale version. It does not: the successor removes
    the temporary files it finds once it has claimed the directory, so a rename whose check
    passed before the claim finds no file to rename (a stale snapshot is a snapshot of a
    commit the successor restored, never one it does not know)."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    every_second = {"config": {"commits_per_snapshot": 2}}
    real_replace = os.replace
    stalled, go_on = threading.Event(), threading.Event()

    def replace(src, dst):
        snapshot = str(dst).endswith(".safetensors")
        if snapshot and threading.current_thread().name == "snapshots" and not stalled.is_set():
            stalled.set()  # (the first background snapshot: the stale syncer's)
            go_on.wait(60)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    old = start_syncer(state, tape_path=tape, **every_second)
    new = None
    try:
        for version in (1, 2, 3):  # a snapshot at 1, journalled 2 and 3, a snapshot of 3 due
            assert join_and_upload(old, version, base=version - 1).accepted
            wait_until(lambda v=version: taped_round(tape, v, "a"), timeout=60)
        assert stalled.wait(60)  # its check passed; its rename waits
        new = start_syncer(state, tape_path=tape, **every_second)
        assert new.state.versions[0] == 3
        for version in (4, 5, 6):
            assert join_and_upload(new, version, learner_id="b", base=version - 1).accepted
            wait_until(lambda v=version: taped_round(tape, v, "b"), timeout=60)
        snapshots = new.service.committer.snapshots
        wait_until(lambda: snapshots.written == 2 and snapshots.idle(), timeout=60)
        served = new.state.params[0].clone()
        go_on.set()
        stale = old.service.committer.snapshots
        wait_until(stale.idle, timeout=60)
        assert stale.written == 0  # its rename found no file
    finally:
        go_on.set()
        old.stop()
        if new is not None:
            new.stop()
    version, params, _ = FragmentStore(state).load(0, old.layout.fragments[0].numel)
    assert version == 6 and torch.equal(params, served)


# ------------------------------------------------------------------ the journal's reader


def record(journal: CommitJournal, admitted: int) -> bytes:
    """Append a commit of fragment 0 from ``admitted`` (a record of no upload: only its log
    matters here) and return the bytes it added."""
    path = journal.dir / f"p000.{journal.current(0):06d}{SUFFIX}"
    before = path.read_bytes() if path.exists() else b""
    log = CommitLog(fragment=0, version=admitted + 1, admitted=admitted)
    journal.append(RoundInputs(fragment=0, log=log, merged_tokens=admitted + 1))
    return path.read_bytes()[len(before) :]


def read_versions(directory) -> list[int]:
    return [r.version for r in CommitJournal(directory).read(0)]


def test_records_of_a_superseded_epoch_after_a_claim_marker_are_passed_over(tmp_path):
    """Records written before epochs (no epoch in their header) still load; a claim marker
    makes every later record of a lower epoch not count, in its segment and in those after
    it, for every reader."""
    legacy = CommitJournal(tmp_path)
    record(legacy, 1)
    header = next(iter(legacy.segments(0)))[1].read_bytes()[16:80]
    assert b'"epoch"' not in header  # the format before epochs, unchanged
    stale, successor = CommitJournal(tmp_path, epoch=1), CommitJournal(tmp_path, epoch=2)
    record(stale, 2)
    successor.begin_epoch(0)
    record(stale, 3)  # landed after the successor's claim: passed over
    stale.rotate(0)
    record(stale, 3)  # in a later segment too
    successor.rotate(0)
    record(successor, 3)  # the successor's own commit of that version
    assert read_versions(tmp_path) == [2, 3, 4]


def test_bad_bytes_count_as_a_stale_append_cut_short_only_before_a_higher_claim(tmp_path):
    """A superseded syncer killed in the middle of its append, its successor's marker after
    it: the bytes cut short are passed over. Bad bytes before anything else are corruption."""
    stale = CommitJournal(tmp_path, epoch=1)
    record(stale, 1)
    (path,) = (p for _, p in stale.segments(0))
    whole = path.read_bytes()
    torn = record(stale, 2)[:-5]
    path.write_bytes(whole + torn)
    CommitJournal(tmp_path, epoch=2).begin_epoch(0)
    data = path.read_bytes()  # the torn tail cut off first, then the marker
    marker, end = parse(data, len(whole))
    assert (marker.epoch, marker.inputs, end) == (2, None, len(data))
    assert read_versions(tmp_path) == [2]
    path.write_bytes(whole + torn + data[len(whole) :])  # cut short just before the marker
    assert read_versions(tmp_path) == [2]
    path.write_bytes(whole + torn + whole)  # before a record: not a torn tail
    with pytest.raises(StateError, match="corrupt"):
        CommitJournal(tmp_path).read(0)

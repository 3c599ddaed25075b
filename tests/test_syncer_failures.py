"""The syncer's own failures (issue 32, "Nothing lost"): a disk that fills up, a restart
that finds what its predecessor persisted, a stop while a commit is being written.

Real gRPC on loopback and a real small filesystem (a tmpfs, root only) that fills up; a raw
client sends uploads so that each test controls exactly which upload id goes where.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import grpc
import pytest
from kit import Peer, join_request, local_syncer, tiny_model, wait_until
from torch import nn

from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import FragmentStore, read_tape

P = 2


def make_model() -> nn.Module:
    return tiny_model(0, (16, 32, 4), tanh=False)


def joined(server: SyncerServer, learner_id: str = "a") -> Peer:
    """A raw learner (``kit.Peer``), joined: its uploads go in the syncer's up codec."""
    peer = Peer(server, learner_id)
    peer.join()
    return peer


def send(peer: Peer, upload_id: int, *, base: int = 0, steps: int = 4, **fields):
    """``peer`` uploads a small delta (of fragment 0 unless told) with ``upload_id``, against
    version ``base``: ``steps`` steps of 8 tokens."""
    return peer.upload(upload_id=upload_id, base=base, steps=steps, tokens=8 * steps, **fields)


def on_disk(server: SyncerServer, state_dir) -> int:
    """The version of fragment 0 in the state directory (0: none yet)."""
    loaded = FragmentStore(state_dir).load(0, server.layout.fragments[0].numel)
    return loaded[0] if loaded is not None else 0


def start_syncer(state_dir, tape, **cfg) -> SyncerServer:
    """A syncer on the learners' schedule (a learner's upload opens its round, which closes
    at once when it is the only learner): each upload below makes one commit."""
    config = SyncerConfig(**{"schedule": "learner", "norm_guard_k": 0.0, **cfg})
    return local_syncer(make_model(), config, num_fragments=P, state_dir=state_dir, tape_path=tape)


def test_a_full_disk_fails_the_syncer_instead_of_leaving_it_half_dead(small_disk):
    """Defect 1: an OSError from the store used to end the committer thread silently while
    Join, Heartbeat and Upload kept answering "accepted". Now the commit is retried (bounded)
    and then the syncer fails: every call is refused UNAVAILABLE, Status says why, the
    caller's ``on_failure`` hook is told (``diloco syncer`` exits non-zero)."""
    server = start_syncer(small_disk.path / "state", small_disk.path / "events.jsonl")
    client = joined(server)
    try:
        assert send(client, 11).accepted
        wait_until(lambda: on_disk(server, small_disk.path / "state") == 1, timeout=10)
        small_disk.fill()
        t0 = time.monotonic()
        assert send(client, 12).accepted  # admitted in memory: its commit cannot be written
        wait_until(lambda: server.failure is not None, timeout=15)
        assert time.monotonic() - t0 < 10  # retried for ~3 s, then failed
        assert isinstance(server.failure, OSError)
        for call in (lambda: send(client, 13), client.join):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "No space" in server.status().failure or "ENOSPC" in server.status().failure
        # what is on disk is the last commit that could be written, whole
        small_disk.free()
        version, _, _ = FragmentStore(small_disk.path / "state").load(
            0, server.layout.fragments[0].numel
        )
        assert version == 1
        assert not list((small_disk.path / "state" / "fragments").glob("*.tmp"))
    finally:
        client.close()
        server.stop()


def test_a_resend_to_a_restarted_syncer_after_its_commit_is_answered_not_merged_again(tmp_path):
    """Defect 4: accepted upload ids lived only in memory, so an upload whose reply was lost
    and that was sent again to a restarted syncer after its round had committed was merged a
    second time. What each commit merged is persisted with it."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    first = start_syncer(state, tape)
    client = joined(first)
    try:
        reply = send(client, 21)
        assert reply.accepted and reply.current_version == 0
        wait_until(lambda: first.state.versions[0] == 1, timeout=10)
    finally:
        client.close()
        first.stop()
    second = start_syncer(state, tape)  # the restarted syncer, on the same state directory
    client = joined(second)
    try:
        again = send(client, 21)  # the resend: its first reply never reached the learner
        assert again.accepted and again.reason == "already accepted"
        assert again.current_version == 0  # merged by version 1, which is on disk
        time.sleep(0.3)
        assert second.state.versions[0] == 1 and not second.state.rounds
        fresh = send(client, 22)  # a new upload is merged as usual
        assert fresh.accepted and fresh.current_version == 1
        wait_until(lambda: second.state.versions[0] == 2, timeout=10)
    finally:
        client.close()
        second.stop()
    merged = [
        uid
        for r in read_tape(tape)
        if r["event"] == "round"
        for parts in r["uploads"].values()
        for uid, _, _ in parts
    ]
    assert sorted(merged) == [21, 22]


def test_a_commit_persisted_but_not_taped_is_recovered_with_what_it_merged(tmp_path, small_disk):
    """Defect 17: a syncer that died between persisting a commit and taping its round left a
    ``recovered`` record without participants or steps, so the tape alone could not prove
    what that commit merged. The commit's log is persisted with it (same file, same rename)
    and the restarted syncer's ``recovered`` record carries it."""
    state, full_tape = tmp_path / "state", small_disk.path / "events.jsonl"
    server = start_syncer(state, full_tape)
    client = joined(server)
    try:
        assert send(client, 31, steps=5).accepted
        wait_until(lambda: on_disk(server, state) == 1, timeout=10)
        # (and its round on the tape: the record is written after the commit is persisted)
        wait_until(lambda: [r for r in read_tape(full_tape) if r["event"] == "round"], 10)
        small_disk.fill()  # the tape's disk: the next commit is persisted, its record is not
        small_disk.pad(full_tape)
        assert send(client, 32, steps=7).accepted
        wait_until(lambda: server.failure is not None, timeout=15)
    finally:
        client.close()
        server.stop()
    small_disk.free()
    restarted = start_syncer(state, full_tape)
    restarted.stop()
    records = read_tape(full_tape)
    (recovered,) = [r for r in records if r["event"] == "recovered"]
    assert (recovered["fragment"], recovered["version"], recovered["taped_version"]) == (0, 2, 1)
    assert recovered["participants"] == ["a"] and recovered["steps"] == [7]
    assert recovered["uploads"] == {"a": [[32, 7, 56]]}


def test_leftover_temporary_files_are_removed_and_meta_is_synced_before_its_rename(
    tmp_path, disk_events
):
    """Defect 11 (durability): ``meta.json`` was renamed into place without an fsync, so a
    power loss could leave an empty one; temporary files of a crash were never removed."""
    state = tmp_path / "state"
    (state / "fragments").mkdir(parents=True)
    leftovers = [state / "meta.tmp", state / "fragments" / "p000.safetensors.99.1.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a file")
    events = disk_events
    server = start_syncer(state, tmp_path / "events.jsonl")
    server.stop()
    assert not any(path.exists() for path in leftovers)
    meta_tmp = str(state / "meta.tmp")
    renamed = events.index(("replace", meta_tmp))
    assert ("fsync", meta_tmp) in events[:renamed]


class SlowStore(FragmentStore):
    """A store whose writes hang until released (a stalled disk), counting concurrent ones."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.writing = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def save(self, *args, **kwargs) -> None:
        with self._lock:
            self.writing += 1
            self.most_at_once = max(self.most_at_once, self.writing)
        try:
            self.release.wait(30)
            super().save(*args, **kwargs)
        finally:
            with self._lock:
                self.writing -= 1


def test_stop_never_publishes_beside_a_committer_still_writing(tmp_path, monkeypatch):
    """Defect 11 (stop): ``stop`` joined the committer for at most 10 s and then committed
    the last rounds itself, while the committer could still be inside ``_publish``: two
    threads moving the same wire image. Now a stop that finds the committer writing leaves
    the last commits to it."""
    from diloco.syncer import committer

    monkeypatch.setattr(committer, "STOP_WAIT_S", 0.5)
    server = start_syncer(tmp_path / "state", tmp_path / "events.jsonl")
    slow = SlowStore(tmp_path / "state")
    server.service.committer.store = slow
    client = joined(server)
    stopper = threading.Thread(target=server.stop)
    try:
        assert send(client, 41).accepted  # its round closes; the commit hangs in the store
        wait_until(lambda: slow.writing == 1, timeout=10)
        assert send(client, 43, fragment=1).accepted  # a round the committer cannot reach
        stopper.start()
        # the old stop gave up on the committer after 10 s and wrote fragment 1 itself
        wait_until(lambda: slow.writing == 2 or not stopper.is_alive(), timeout=20)
        slow.release.set()
        stopper.join(timeout=20)
        assert not stopper.is_alive()
    finally:
        slow.release.set()
        client.close()
    assert slow.most_at_once == 1


def test_a_restart_reads_its_tape_without_holding_it_in_memory(tmp_path):
    """Defect 11 (memory): a restart read the whole event tape into memory to find the
    versions it records; a long run's tape is hundreds of MB. It is read a line at a time."""
    tape = tmp_path / "events.jsonl"
    line = '{"event":"tick","t":1.0,"fragment":0,"version":0,"asked":4,"pad":"' + "x" * 150 + '"}\n'
    with open(tape, "w") as f:
        f.write(line * 150_000)  # ~30 MB of records a restart has no use for
        f.write('{"event":"round","t":2.0,"fragment":0,"version":0}\n')
    tracemalloc.start()
    try:
        server = start_syncer(tmp_path / "state", tape)
        server.stop()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.0f} MiB while starting"


def test_a_tape_line_cut_short_by_a_full_disk_does_not_swallow_the_next_record(tmp_path):
    """A syncer that could write only part of a record (disk full) and then died left a
    line without its newline; the next syncer's first record was appended to it and lost
    with it (seen in a torture run: a ``start`` record unreadable)."""
    from diloco.syncer.store import EventTape

    tape_path = tmp_path / "events.jsonl"
    tape_path.write_text('{"event":"round","fragment":0,"version":1}\n{"event":"sta')
    tape = EventTape(tape_path)
    tape.append({"event": "start", "versions": [1]})
    tape.close()
    records = read_tape(tape_path)
    assert [r["event"] for r in records] == ["round", "start"]


def test_a_restarted_syncer_remembers_every_upload_its_commit_logs_hold():
    """Found by review: receipts kept 1024 ids per learner while the logs persisted for P =
    24 fragments hold up to 64 x 24: a restarted syncer forgot the uploads of the first
    fragments it restored (a resend merged again, a rejoining learner told they were not)."""
    from diloco.syncer.receipts import PERSISTED_COMMITS, CommitLog, Receipts, UploadPart

    logs = [
        CommitLog(p, v + 1, v, {"a": [UploadPart(1000 * p + v + 1, 4, 32)]})
        for p in range(24)
        for v in range(PERSISTED_COMMITS)
    ]
    receipts = Receipts()
    receipts.restore(logs)
    assert len(receipts.committed("a")) == 24 * PERSISTED_COMMITS
    assert receipts.admitted("a", 1, fragment=0) == 0  # fragment 0's oldest log


def test_a_tape_record_whose_fsync_failed_is_not_written_twice(tmp_path, monkeypatch):
    """Found by review: the committer retries a record whose write succeeded but whose fsync
    failed (EIO, ENOSPC on delayed allocation): the retry appended it a second time. A
    failed fsync of the tape is now final (``SyncFailed``: the syncer fails, see
    test_syncer_hygiene), and the record is still never written twice."""
    from diloco.syncer.store import EventTape

    tape = EventTape(tmp_path / "events.jsonl")
    real, calls = os.fsync, []

    def failing_once(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing_once)
    record = {"event": "round", "fragment": 0, "version": 1}
    with pytest.raises(OSError):
        tape.append(record, sync=True)
    with pytest.raises(OSError):  # a retry: refused (a later fsync cannot vouch for it)
        tape.append(record, sync=True)
    tape.close()
    assert [r["version"] for r in read_tape(tmp_path / "events.jsonl")] == [1]


def test_a_commit_that_hangs_on_its_disk_fails_the_syncer(tmp_path, monkeypatch):
    """Found by review: a disk that hangs instead of failing (a blocking fsync) held the
    committer forever while the syncer kept answering: a stall without end. A commit still
    being written after ``COMMIT_DEADLINE_S`` fails the syncer as a write error does."""
    from diloco.syncer import committer

    monkeypatch.setattr(committer, "COMMIT_DEADLINE_S", 1.0)
    server = start_syncer(tmp_path / "state", tmp_path / "events.jsonl")
    slow = SlowStore(tmp_path / "state")
    server.service.committer.store = slow
    client = joined(server)
    try:
        assert send(client, 51).accepted
        wait_until(lambda: server.failure is not None, timeout=10)
        assert isinstance(server.failure, TimeoutError)
    finally:
        slow.release.set()
        client.close()
        server.stop()


def test_a_dropped_round_persisted_but_not_taped_is_recovered(tmp_path):
    """Found by review: a round the direction check left empty keeps the version, so a
    restart that compared versions only never taped the uploads it left out (their
    learners' books then disagreed with the tape). Persisted logs the tape lacks are
    recovered by their uploads."""
    from diloco.syncer.receipts import CommitLog, UploadPart

    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    first = start_syncer(state, tape)
    client = joined(first)
    try:
        assert send(client, 61).accepted
        wait_until(lambda: on_disk(first, state) == 1, timeout=10)
    finally:
        client.close()
        first.stop()
    # what a killed syncer left: a dropped round's log persisted, its record never taped
    store = FragmentStore(state)
    version, params, extra = store.load(0, first.layout.fragments[0].numel)
    logs = store.load_commits(0) + [CommitLog(0, 1, 1, {}, {"a": [UploadPart(62, 3, 24)]})]
    store.save(0, version, params, extra, wire=extra["wire"], commits=[g.to_json() for g in logs])
    start_syncer(state, tape).stop()
    (recovered,) = [r for r in read_tape(tape) if r["event"] == "recovered"]
    assert recovered["commits"] == [logs[-1].to_json()]


def test_a_rejoining_learner_is_told_of_its_uploads_still_in_an_open_round(tmp_path):
    """Found by review: a learner killed before the answer to an accepted upload, restored
    from its checkpoint, asks at its first join which of its previous life's uploads the
    syncer holds. One in a round still open was not listed (only committed ones were), so
    the new life sent its steps again and the open round merged them as well."""
    server = start_syncer(tmp_path / "state", tmp_path / "events.jsonl", wait_for_all=2)
    client = joined(server)
    try:
        assert send(client, 31).accepted  # the round waits for a second learner: open
        time.sleep(0.2)
        assert server.state.rounds and server.state.versions[0] == 0
        reply = client.stub.Join(join_request(server.layout, "a"), timeout=5)  # a new life
        assert 31 in reply.committed_uploads
        # ... told apart from the committed ones (issue 46): open, admitted at version 0
        assert reply.HasField("fates") and list(reply.fates.excluded) == []
        assert [(o.upload_id, o.admitted) for o in reply.fates.open] == [(31, 0)]
    finally:
        client.close()
        server.stop()


def commit_many(server: SyncerServer, client: Peer, count: int, first_id: int) -> None:
    """``count`` commits of fragment 0, each merging one upload of ``client``."""
    for i in range(count):
        v = server.state.versions[0]
        assert send(client, first_id + i, base=v).accepted
        wait_until(lambda v=v: server.state.versions[0] == v + 1, timeout=10)


def merged_ids(tape) -> list[int]:
    return sorted(
        uid
        for r in read_tape(tape)
        if r["event"] == "round"
        for parts in r["uploads"].values()
        for uid, _, _ in parts
    )


def test_a_resend_after_a_partition_longer_than_64_commits_and_a_restart_is_not_merged_again(
    tmp_path,
):
    """Issue 46, defect 1: a restarted syncer rebuilt its receipts from the last 64 commit
    logs of each fragment, so an upload merged, whose reply was lost, resent by a learner
    cut off while 70 more commits of its fragment were made and the syncer restarted, was
    refused as stale and its progress sent again (merged twice). The receipt log keeps
    every commit's log; the resend is answered with its admission."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    first = start_syncer(state, tape)
    a, b = joined(first, "a"), joined(first, "b")
    try:
        assert send(a, 21).accepted  # merged by version 1; its answer never reaches a
        wait_until(lambda: first.state.versions[0] == 1, timeout=10)
        commit_many(first, b, 70, first_id=1000)
    finally:
        a.close(), b.close()
        first.stop()
    second = start_syncer(state, tape)
    a = joined(second, "a")
    try:
        again = send(a, 21, resend=True)
        assert again.accepted and again.reason == "already accepted", again
        assert again.current_version == 0 and not again.fate_unknown
        assert second.state.logged_from()[0] == 0  # every commit's log is kept
    finally:
        a.close()
        second.stop()
    assert merged_ids(tape).count(21) == 1


def test_a_resend_older_than_every_log_kept_is_answered_fate_unknown_and_changes_nothing(
    tmp_path,
):
    """Past the logs a syncer keeps (``commit_logs_kept``, here 8) the fate of an upload
    cannot be told: a resend of one is answered ``fate_unknown`` (neither merged as new nor
    refused as stale, which would make its learner send it again); a first send of the same
    base is refused as stale, as ever; the kept logs stay bounded."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    first = start_syncer(state, tape, commit_logs_kept=8)
    a, b = joined(first, "a"), joined(first, "b")
    try:
        assert send(a, 21).accepted
        wait_until(lambda: first.state.versions[0] == 1, timeout=10)
        commit_many(first, b, 30, first_id=1000)
    finally:
        a.close(), b.close()
        first.stop()
    second = start_syncer(state, tape, commit_logs_kept=8)
    a = joined(second, "a")
    try:
        assert second.state.logged_from()[0] > 1  # version 0's log was let go
        digest = second.service.state_digest()
        unknown = send(a, 21, resend=True)
        assert unknown.fate_unknown and not unknown.accepted
        assert second.service.state_digest() == digest and not second.state.rounds
        stale = send(a, 22)  # a first send: never accepted before, so refused as stale
        assert not stale.accepted and stale.resync and not stale.fate_unknown
        lines = (state / "receipts.jsonl").read_text().splitlines()
        assert len(lines) <= 1 + 2 * 8
    finally:
        a.close()
        second.stop()
    assert merged_ids(tape).count(21) == 1

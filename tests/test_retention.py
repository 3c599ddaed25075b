"""Commit logs kept until the learners that may ask have acknowledged them (issue 46, defect
1): a learner reports, per fragment, its oldest unsettled admission (``unsettled_from``) at
every join and heartbeat; the syncer keeps every log from there on, bounded by
``commit_logs_max`` (past it: dropped, counted and taped), and a pin ends
``commit_log_pin_s`` after its learner's lease (``diloco.syncer.retention``).

Real syncers on loopback with a state directory, a raw client (``kit.Peer``) that controls
which upload id goes where, and the real ``Receipts`` with a fake clock.
"""

from __future__ import annotations

import grpc
import pytest
from kit import Peer, local_syncer, tiny_model, wait_until

import diloco
from diloco.learner.inbox import Rejoin
from diloco.learner.settling import HELD, fate_at_rejoin
from diloco.syncer.config import SyncerConfig
from diloco.syncer.receipt_log import RECEIPT_LOG
from diloco.syncer.receipts import CommitLog, Receipts, UploadPart
from diloco.syncer.retention import LOGS_DROPPED, PIN_EXPIRED
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape
from diloco.wire import diloco_pb2 as pb

P = 2


def start_syncer(state_dir, tape, **cfg) -> SyncerServer:
    """A syncer on the learners' schedule: each upload below makes one commit of its own."""
    config = SyncerConfig(**{"schedule": "learner", "norm_guard_k": 0.0, **cfg})
    model = tiny_model(0, (16, 32, 4), tanh=False)
    return local_syncer(model, config, num_fragments=P, state_dir=state_dir, tape_path=tape)


def send(peer: Peer, upload_id: int, *, base: int = 0, **fields):
    return peer.upload(upload_id=upload_id, base=base, steps=4, tokens=32, **fields)


def commit_many(server: SyncerServer, client: Peer, count: int, first_id: int) -> None:
    """``count`` commits of fragment 0, each merging one upload of ``client``."""
    for i in range(count):
        v = server.state.versions[0]
        assert send(client, first_id + i, base=v).accepted
        wait_until(lambda v=v: server.state.versions[0] == v + 1, timeout=10)


def joined(server: SyncerServer, learner_id: str, **fields) -> Peer:
    peer = Peer(server, learner_id)
    peer.join(**fields)
    return peer


def test_an_unsettled_admission_pins_the_logs_across_a_partition_and_a_restart(tmp_path):
    """A learner's upload is merged, its answer lost, and it is cut off while its fragment
    gets 32 commits (4 x ``commit_logs_kept`` = 8), with a syncer restart in the middle.
    Before: the syncer let the log go by count, and at rejoin the upload's fate was unknown
    (its steps neither merged nor sent again). Now the learner's report at join (its oldest
    unsettled admission, 0) pins the logs; the restarted syncer holds every log until the
    learners report again: at rejoin the upload is listed (held: merged once) and a resend is
    answered with its admission."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    first = start_syncer(state, tape, commit_logs_kept=8)
    a, b = joined(first, "a", unsettled_from=[0, 0]), joined(first, "b")
    try:
        assert send(a, 21).accepted  # merged by version 1; its answer never reaches a
        wait_until(lambda: first.state.versions[0] == 1, timeout=10)
        commit_many(first, b, 20, first_id=1000)  # (past 2 x 8: the file is compacted)
    finally:
        a.close(), b.close()
        first.stop()
    second = start_syncer(state, tape, commit_logs_kept=8)
    b = joined(second, "b")
    try:
        commit_many(second, b, 12, first_id=2000)
        a = Peer(second, "a")
        reply = a.join(unsettled_from=[0, 0])
        assert 21 in reply.committed_uploads and reply.logged_from[0] == 0
        rejoin = Rejoin(
            "s",
            reply.syncer_id,
            list(reply.versions),
            (0, 1),
            frozenset(reply.committed_uploads),
            tuple(reply.logged_from),
        )
        assert fate_at_rejoin(rejoin, 0, 0, 21) == HELD
        again = send(a, 21, resend=True)
        assert again.accepted and again.current_version == 0 and not again.fate_unknown
        a.close()
    finally:
        b.close()
        second.stop()
    lines = (state / RECEIPT_LOG).read_text().splitlines()
    assert len(lines) == 1 + 33  # every log the pin needs is on disk too


def test_past_the_bound_pinned_logs_are_dropped_counted_and_taped(tmp_path):
    """``commit_logs_max`` bounds what pins keep: past it the oldest logs go anyway, the
    tape says so (``commit_logs_dropped``, with their count) and a resend of an upload they
    held is answered ``fate_unknown`` (never merged again, never refused as stale)."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    server = start_syncer(state, tape, commit_logs_kept=4, commit_logs_max=8)
    a, b = joined(server, "a", unsettled_from=[0, 0]), joined(server, "b")
    try:
        assert send(a, 21).accepted
        wait_until(lambda: server.state.versions[0] == 1, timeout=10)
        commit_many(server, b, 11, first_id=1000)
        wait_until(lambda: server.state.receipts.logs_dropped == 4, timeout=10)
        assert server.state.receipts.kept == 8
        assert server.state.logged_from()[0] == 4
        unknown = send(a, 21, resend=True)
        assert unknown.fate_unknown and not unknown.accepted
    finally:
        a.close(), b.close()
        server.stop()
    dropped = [r for r in read_tape(tape) if r["event"] == LOGS_DROPPED]
    assert sum(r["logs"] for r in dropped) == 4 and dropped[-1]["logged_from"] == 4


def test_a_malformed_report_is_refused_and_changes_nothing(tmp_path):
    """``unsettled_from`` must be empty or one version >= -1 per fragment: a join (or
    heartbeat) with another is refused ``INVALID_ARGUMENT`` and changes nothing; a valid
    heartbeat moves the pin, an empty one leaves it."""
    server = start_syncer(tmp_path / "state", tmp_path / "events.jsonl")
    try:
        for bad in ([0], [0, 0, 0], [0, -2]):
            with pytest.raises(grpc.RpcError) as refused:
                Peer(server, "a").join(unsettled_from=bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a" not in server.state.learners and server.state.receipts.pins.of("a") is None
        peer = joined(server, "a", unsettled_from=[-1, 3])  # -1: the syncer's own version
        assert server.state.receipts.pins.of("a") == {0: 0, 1: 3}
        beat = {"learner_id": "a", "session": peer.session}
        peer.stub.Heartbeat(pb.HeartbeatRequest(**beat, unsettled_from=[2, 4]), timeout=5)
        assert server.state.receipts.pins.of("a") == {0: 2, 1: 4}  # a heartbeat moves it
        with pytest.raises(grpc.RpcError) as refused:
            peer.stub.Heartbeat(pb.HeartbeatRequest(**beat, unsettled_from=[1]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        peer.stub.Heartbeat(pb.HeartbeatRequest(**beat), timeout=5)  # (empty: left as it was)
        assert server.state.receipts.pins.of("a") == {0: 2, 1: 4}
        peer.close()
    finally:
        server.stop()


def log_of(version: int, upload_id: int, fragment: int = 0) -> CommitLog:
    return CommitLog(fragment, version + 1, version, {"b": [UploadPart(upload_id, 1, 1)]})


def test_a_pin_expires_after_the_lease_and_the_pin_time():
    """A learner that stops reporting pins the logs for ``pin_s`` (lease + pin time) after
    its last report, then no more: the logs go by count again and the tape says why."""
    receipts = Receipts(retained_logs=2, max_logs=100, pin_s=10.0)
    receipts.pin("a", [0, 0], [0, 0], now=0.0)
    for v in range(6):
        receipts.settle(log_of(v, 100 + v), now=5.0)
    assert receipts.kept == 6 and receipts.complete_from.get(0, 0) == 0
    receipts.settle(log_of(6, 106), now=10.0)  # (expired at 0 + 10)
    assert receipts.kept == 2 and receipts.complete_from[0] == 5
    assert receipts.take_events() == [{"event": PIN_EXPIRED, "learner": "a"}]
    assert receipts.pins.expired == 1


def test_pins_move_with_each_report_and_only_the_least_pins():
    """Each report replaces the learner's pin; the logs older than every pin go (by count
    past ``retained_logs``), those some pin needs stay."""
    receipts = Receipts(retained_logs=1, max_logs=100, pin_s=100.0)
    receipts.pin("a", [2, 0], [0, 0], now=0.0)
    receipts.pin("c", [4, 0], [0, 0], now=0.0)
    for v in range(6):
        receipts.settle(log_of(v, 100 + v), now=1.0)
    assert receipts.complete_from[0] == 2 and receipts.kept == 4
    receipts.pin("a", [5, 0], [0, 0], now=2.0)
    receipts.settle(log_of(6, 106), now=2.0)
    assert receipts.complete_from[0] == 4 and receipts.admitted("b", 104, 0) == 4
    assert receipts.admitted("b", 103, 0) is None


def test_a_restarted_syncer_holds_every_log_until_the_learners_report_again():
    """Pins are not persisted: a syncer restored from its state holds every log for one pin
    time, in which each learner that may ask rejoins and pins again; then only those
    reported pins keep logs."""
    receipts = Receipts(retained_logs=2, max_logs=100, pin_s=10.0)
    receipts.restore([log_of(v, 100 + v) for v in range(5)], {0: 0}, now=0.0)
    for v in range(5, 8):
        receipts.settle(log_of(v, 100 + v), now=5.0)
    assert receipts.kept == 8 and receipts.complete_from[0] == 0
    receipts.pin("a", [3, 0], [8, 8], now=6.0)
    receipts.settle(log_of(8, 108), now=11.0)  # the hold is over; a's pin is not
    assert receipts.complete_from[0] == 3 and receipts.admitted("b", 103, 0) == 3


def test_a_learner_reports_what_it_may_still_ask_about_at_join():
    """A real ``Learner`` sends its ``unsettled_from`` with its join (and every heartbeat):
    holding version 0 of each fragment with nothing unsettled, it pins every fragment from 0."""
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0)
    server = local_syncer(tiny_model(0, (16, 32, 4), tanh=False), config, num_fragments=P)
    model = tiny_model(0, (16, 32, 4), tanh=False)
    learner = diloco.Learner(model, syncer=server.address, num_fragments=P, learner_id="l")
    try:
        wait_until(lambda: server.state.receipts.pins.of("l") == {0: 0, 1: 0}, timeout=30)
    finally:
        learner.close(flush=False)
        server.stop()

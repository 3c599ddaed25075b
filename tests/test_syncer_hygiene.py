"""Issue 46's hygiene items: what a syncer answers while it stops, what its tape's fsync
failures mean, what a slow stream holds, what a restart reads.

Real syncers on loopback (``kit.local_syncer``) and real files; each test names the hole it
closes.
"""

from __future__ import annotations

import errno
import os
import threading

import grpc
import pytest
import torch
from kit import Peer, join_request, local_syncer, tiny_model, wait_until

from diloco.learner.listener import LinkListener
from diloco.learner.uploads import UploadJob, UploadResult
from diloco.syncer.config import SyncerConfig
from diloco.syncer.store import FragmentStore
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc

P = 2


def start_syncer(tmp_path, bind: str = "127.0.0.1:0", **cfg):
    """A syncer on the learners' schedule with a state directory and a tape: an upload of
    the only learner opens its round, which closes at once (one upload, one commit)."""
    config = SyncerConfig(**{"schedule": "learner", "norm_guard_k": 0.0, "up_codec": "fp32", **cfg})
    return local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=P,
        state_dir=tmp_path / "state",
        tape_path=tmp_path / "events.jsonl",
        bind=bind,
    )


def on_disk(server, state_dir, fragment: int = 0) -> int:
    """The version of ``fragment`` in the state directory (0: none yet)."""
    loaded = FragmentStore(state_dir).load(fragment, server.layout.fragments[fragment].numel)
    return loaded[0] if loaded is not None else 0


def test_an_upload_arriving_once_stop_began_is_refused_unavailable_not_accepted(tmp_path):
    """Issue 46, item 1: ``stop`` makes the last commits (the final poll) and only then does
    the gRPC server stop taking calls; an upload arriving in between was answered "accepted"
    and was never committed (its learner took it as on its way to a merge and never sent it
    again). Once stopping has begun an upload is refused ``UNAVAILABLE``: its learner's link
    takes that as "no answer" and sends it again, to the successor."""
    server = start_syncer(tmp_path)
    peer = Peer(server, "a")
    delta = torch.full((server.layout.fragments[0].numel,), 1e-3)
    try:
        peer.join()
        assert peer.upload(0, delta).accepted
        wait_until(lambda: on_disk(server, tmp_path / "state") == 1, timeout=10)
        server.service.stop()  # stop began: the last commits are made, calls still arrive
        with pytest.raises(grpc.RpcError) as refused:
            reply = peer.upload(0, delta)
            raise AssertionError(f"answered while stopping: {reply}")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert not server.state.rounds  # nothing admitted that no commit will take
    finally:
        peer.close()
        server.stop()
    assert on_disk(server, tmp_path / "state") == 1


def fsync_failing_once_on(name: str, monkeypatch) -> list[str]:
    """Make the first ``os.fsync`` of a file called ``name`` fail with EIO (as a failed
    writeback reports it: once); returns the list of the names of the files fsynced."""
    real, seen = os.fsync, []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(os.path.basename(path))
        if os.path.basename(path) == name and seen.count(name) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_failed_fsync_of_the_tape_fails_the_syncer_and_its_restart_tapes_the_commit_once(
    tmp_path, monkeypatch
):
    """Issue 46, item 2 (fsyncgate): after a failed fsync the kernel may have dropped the
    dirty pages, and a second fsync reports success for a record never written. The
    committer "retried" a round record whose fsync failed by fsyncing again: the commit was
    broadcast on the strength of that. A failed fsync of the tape now fails the syncer (no
    retry); the restarted syncer tapes the commit from its fragment file if the tape lacks
    it, and never twice."""
    from diloco.syncer.store import SyncFailed, read_tape

    server = start_syncer(tmp_path)
    peer = Peer(server, "a")
    delta = torch.full((server.layout.fragments[0].numel,), 1e-3)
    try:
        peer.join()
        fsync_failing_once_on("events.jsonl", monkeypatch)
        assert peer.upload(0, delta).accepted
        wait_until(lambda: server.failure is not None, timeout=10, what="the syncer failed")
        assert isinstance(server.failure, SyncFailed), server.failure
        assert server.state.versions[0] == 1 and on_disk(server, tmp_path / "state") == 1
    finally:
        peer.close()
        server.stop()
        monkeypatch.undo()
    start_syncer(tmp_path).stop()  # the restart: tapes what the tape lacks
    start_syncer(tmp_path).stop()  # and the next one (through the tape's index) nothing
    records = read_tape(tmp_path / "events.jsonl")
    taped = [r for r in records if r["event"] in ("round", "recovered") and r["fragment"] == 0]
    assert [r["version"] for r in taped] == [1], taped


def test_an_event_tape_refuses_every_sync_after_a_failed_fsync(tmp_path, monkeypatch):
    """The tape itself: once an fsync failed, no later ``append(sync=True)`` may report a
    success (the earlier record may be lost whatever a later fsync says): each raises
    ``SyncFailed`` and writes nothing; a record the run can do without still goes."""
    from diloco.syncer.store import EventTape, SyncFailed, read_tape

    tape = EventTape(tmp_path / "events.jsonl")
    fsync_failing_once_on("events.jsonl", monkeypatch)
    with pytest.raises(SyncFailed):
        tape.append({"event": "round", "fragment": 0, "version": 1}, sync=True)
    with pytest.raises(SyncFailed):
        tape.append({"event": "round", "fragment": 0, "version": 1}, sync=True)
    with pytest.raises(SyncFailed):
        tape.append({"event": "round", "fragment": 0, "version": 2}, sync=True)
    assert tape.try_append({"event": "failed"})
    tape.close()
    assert [r["event"] for r in read_tape(tmp_path / "events.jsonl")] == ["round", "failed"]


def test_a_receipt_log_line_whose_fsync_and_truncate_failed_is_not_appended_twice(
    tmp_path, monkeypatch
):
    """The receipt log takes back a line whose write or fsync failed (truncating to the old
    size) and its retry writes the line again from scratch, re-dirtying every page the failed
    one touched: honest. But when the truncate fails too the line may be whole in the file;
    the committer's retry appended it a second time. That is now ``SyncFailed``: the syncer
    fails, and its restart appends what the fragment files hold and the log lacks."""
    from diloco.syncer.committer import retrying
    from diloco.syncer.receipt_log import RECEIPT_LOG, ReceiptLog
    from diloco.syncer.receipts import CommitLog, UploadPart
    from diloco.syncer.store import SyncFailed

    receipts = ReceiptLog(tmp_path)
    receipts.open({0: 0}, {})
    fsync_failing_once_on(RECEIPT_LOG, monkeypatch)

    def truncate_fails(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "ftruncate", truncate_fails)
    log = CommitLog(0, 1, 0, {"a": [UploadPart(7, 4, 32)]})
    with pytest.raises(SyncFailed):
        retrying(lambda: receipts.append(log))
    monkeypatch.undo()
    lines = (tmp_path / RECEIPT_LOG).read_text().splitlines()
    assert len(lines) <= 2, lines  # the header and the log at most once


class Answers(LinkListener):
    """A link's owner that holds nothing and keeps every answer."""

    def __init__(self) -> None:
        self.results: list[tuple[UploadJob, UploadResult]] = []

    def on_result(self, job: UploadJob, result: UploadResult) -> None:
        self.results.append((job, result))


def test_a_resend_to_a_syncer_restarted_with_another_up_codec_carries_its_first_bytes(tmp_path):
    """Issue 46, item 3: an upload whose reply was lost was encoded again, in the codec of
    the syncer it was resent to. A syncer restarted with another ``--up-codec`` answered the
    resend from its commit log (the first send, in the old codec, was merged), and the learner
    recorded as ``sent`` (its error feedback) the new encoding, not what was merged. A resend
    now carries the bytes of its first send, in their codec, which the syncer accepts for a
    resend, so what the learner records is what the syncer decoded."""
    from diloco.algorithm import codecs
    from diloco.launch.relay import Relay
    from diloco.learner.link import SyncerLink

    first = start_syncer(tmp_path, up_codec="int8")
    address = first.address
    relay = Relay(address)
    relay.lose_replies(1.0)  # the first send is merged; its answer never arrives
    answers = Answers()
    link = SyncerLink(relay.address, "a", first.layout, answers, max_backoff_s=0.2)
    torch.manual_seed(0)
    delta = torch.randn(first.layout.fragments[0].numel) * 1e-2
    job = UploadJob(0, base_version=0, steps=4, tokens=32, delta=delta, step_time_s=0.1)
    second = None
    try:
        link.start()
        wait_until(link.connected.is_set, timeout=10, what="joined")
        link.submit(job)
        wait_until(lambda: on_disk(first, tmp_path / "state") == 1, timeout=10, what="merged")
        wait_until(lambda: relay.replies_lost, timeout=10, what="the reply lost")
        first.stop()
        relay.lose_replies(0.0)
        second = start_syncer(tmp_path, up_codec="int4", bind=address)
        wait_until(lambda: answers.results, timeout=30, what="an answer")
    finally:
        link.close()
        relay.close()
        first.stop()
        if second is not None:
            second.stop()
    [(answered, result)] = answers.results
    assert result.outcome == "accepted" and result.admitted == 0, result
    merged = codecs.decode(codecs.encode(delta, "int8"), delta.numel(), "int8")
    assert torch.equal(result.sent, merged), "the resend recorded another encoding as sent"


def live_keyframes() -> list:
    """Every ``Keyframe`` this process still holds (each a full fragment: 4 bytes per value
    of W, and 4 more once its fp32 payload was made)."""
    import gc

    from diloco.syncer.broadcast import Keyframe

    gc.collect()
    return [o for o in gc.get_objects() if type(o) is Keyframe]


def upload_in_chunks(peer: Peer, fragment: int, value: float) -> pb.UploadReply:
    """``peer`` uploads a delta of ``value`` everywhere to ``fragment``, in fp32, chunked."""
    from diloco.wire.protocol import CHUNK_BYTES

    numel = peer.server.layout.fragments[fragment].numel
    delta = torch.full((numel,), value)
    return peer.upload(
        fragment, delta, steps=4, tokens=32, codec="fp32", chunk_bytes=CHUNK_BYTES, timeout=30
    )


@pytest.mark.slow
def test_streams_that_never_read_pin_at_most_one_old_keyframe_each():
    """Issue 46, item 4: a stream whose learner does not read took every fragment's
    keyframe at once and stalled sending the first: the keyframes of all the others stayed
    referenced by it (a whole model, 8 bytes per parameter, per slow stream, each of another
    version). A stream now takes one fragment at a time; what waits is the newest version
    only (a newer keyframe replaces an unsent one), which the syncer holds anyway. So the
    syncer holds the newest keyframe of each fragment plus at most one per slow stream."""
    fragments, slow_streams = 4, 2
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0, up_codec="fp32")
    # 8.4 M parameters: a fragment's keyframe (~8 MB) is far more than a stream's window
    server = local_syncer(
        tiny_model(0, (1024, 4096, 1024), tanh=False), config, num_fragments=fragments
    )
    writer = Peer(server, "writer")
    channels, streams = [], []

    def commit_every_fragment() -> None:
        for p in range(fragments):
            v = server.state.versions[p]
            assert upload_in_chunks(writer, p, 1e-4).accepted
            wait_until(lambda p=p, v=v: server.state.versions[p] > v, timeout=30)

    def subscribe_and_never_read(name: str) -> None:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.SyncerStub(channel)
        session = stub.Join(join_request(server.layout, name, observer=True), timeout=5).session
        stream = stub.Subscribe(pb.SubscribeRequest(learner_id=name, session=session))
        channels.append(channel)
        streams.append(stream)
        assert next(stream).chunk_index == 0  # its handler is sending keyframes: read no more

    try:
        writer.join()
        for i in range(slow_streams):
            subscribe_and_never_read(f"slow-{i}")
            commit_every_fragment()  # each slow stream stalls at another version
        for _ in range(3):
            commit_every_fragment()
        keyframes = live_keyframes()
        held = len(keyframes)
        assert held <= fragments + slow_streams, f"{held} keyframes held"
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
        writer.close()
        server.stop()


TICK = '{"event":"tick","t":1.0,"fragment":0,"version":0,"asked":4}\n'


def test_a_restart_reads_only_the_tape_written_since_the_last_index(tmp_path):
    """Issue 46, item 5: the tape is never rotated and every restart parsed all of it (a
    long run's tape: millions of records) to find, per fragment, the newest taped version
    and the dropped uploads its records name. A syncer keeps that in a small side file,
    ``events.jsonl.index``, with the tape's offset it covers; a restart reads the tail
    written since, and the whole tape only when the index does not match it."""
    from diloco.syncer.store import read_taped
    from diloco.syncer.tape_index import TapeIndex

    tape = tmp_path / "events.jsonl"
    with open(tape, "w") as f:
        f.write(TICK * 1000)
        f.write('{"event":"round","t":2.0,"fragment":1,"version":7}\n')
        f.write('{"event":"dropped","t":2.0,"fragment":0,"excluded_uploads":{"a":[[5,4,32]]}}\n')
    server = start_syncer(tmp_path)
    peer = Peer(server, "a")
    try:
        peer.join()
        assert peer.upload(0, torch.full((server.layout.fragments[0].numel,), 1e-3)).accepted
        wait_until(lambda: on_disk(server, tmp_path / "state") == 1, timeout=10)
    finally:
        peer.close()
        server.stop()
    indexed = tape.stat().st_size
    with open(tape, "a") as f:
        f.write(TICK * 1000)  # written since: by another process sharing the tape
        f.write('{"event":"round","t":3.0,"fragment":1,"version":8}\n')
    taped = TapeIndex(tape).read()
    assert taped.read_from >= indexed - 512  # the tail only (from the syncer's last record)
    full = read_taped(tape)
    assert taped.versions == full.versions == {0: 1, 1: 8}
    # of the dropped uploads, the index keeps those of the commit logs a restart checks
    assert (0, 5) in full.dropped and taped.dropped <= full.dropped
    # the tape replaced under its index (another run's tape): read whole
    tape.write_text('{"event":"round","t":2.0,"fragment":1,"version":3}\n' + TICK * 40)
    again = TapeIndex(tape).read()
    assert again.read_from == 0 and again.versions == {1: 3}


def test_a_draining_learner_flushes_again_what_a_restarted_syncer_never_committed(tmp_path):
    """Issue 46, item 6: a learner draining at its clean stop (its finals accepted, waiting
    for them to come back merged) left as soon as its link dropped. When the link dropped
    because the syncer restarted, the finals that syncer had accepted and not committed were
    lost: nobody was left to rejoin and hear that the successor does not hold them. The
    drain now waits for the link (within its bound); at the rejoin the successor's answer
    returns those deltas to the learner's progress, which it flushes again and drains."""
    from diloco.learner.learner import Learner
    from diloco.syncer.store import read_tape

    steps = 12
    # the first syncer waits for two learners: this one's uploads stay in open rounds
    first = start_syncer(tmp_path, wait_for_all=2)
    address = first.address
    model = tiny_model(0, (16, 32, 4), tanh=False)
    learner = Learner(
        model, syncer=address, num_fragments=P, learner_id="a", tokens_per_step=8,
        drain_timeout_s=30.0, flush_timeout_s=10.0,
    )  # fmt: skip
    second = None
    closer = threading.Thread(target=learner.close)
    try:
        # (every fragment held before training: on a loaded machine a fragment's first
        # version arrived after all 12 steps, which were then dropped, not merged)
        learner.wait_for_global(timeout=30)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=8)
        closer.start()  # flush (finals accepted, never committed here), then drain

        def finals_admitted() -> bool:
            info = first.state.learners.get("a")
            return (
                info is not None
                and bool(info.finals_delivered)
                and not (set(info.finals_due) - set(info.finals_delivered))
            )

        wait_until(finals_admitted, timeout=20, what="the finals admitted")
        assert first.state.versions == [0] * P  # nothing committed
        first.stop()  # the link drops while the learner drains
        second = start_syncer(tmp_path, bind=address)
        closer.join(timeout=60)
        assert not closer.is_alive()
    finally:
        if closer.is_alive() or not closer.ident:
            learner.close(flush=False)
        first.stop()
        if second is not None:
            second.stop()
    report = learner.close_report
    rounds = [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "round"]
    merged = [
        sum(
            n
            for r in rounds
            if r["fragment"] == p
            for who, n in zip(r["participants"], r["steps"], strict=True)
            if who == "a"
        )
        for p in range(P)
    ]
    dropped = list(learner.dropped)  # (steps trained before its first version arrived)
    assert [m + d for m, d in zip(merged, dropped, strict=True)] == [steps] * P, (merged, dropped)
    assert all(m > 0 for m in merged), merged
    assert report["drained"] and report["unsent_steps"] == 0, report

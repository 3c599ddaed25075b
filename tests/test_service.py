"""Syncer service and Learner library over real gRPC on loopback (in one process)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from kit import Peer, join_request, local_syncer, tiny_model, train_in_threads, wait_until
from torch import nn

from diloco.algorithm import codecs
from diloco.learner.learner import Learner
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.protocol import ProtocolConfig

P = 4


def make_model(seed: int) -> nn.Module:
    return tiny_model(seed, (8, 32, 1))


def make_server(tmp_path, **cfg) -> SyncerServer:
    config = SyncerConfig(
        **{
            "quorum": 1,
            "up_codec": "fp32",
            "down_codec": "fp32",
            "lease_s": 2.0,
            "heartbeat_s": 0.2,
            **cfg,
        }
    )
    return local_syncer(
        make_model(0),
        config,
        num_fragments=P,
        start=False,
        state_dir=tmp_path / "state",
        tape_path=tmp_path / "events.jsonl",
    )


def train(learner: Learner, model: nn.Module, seed: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    w = torch.linspace(-1, 1, 8)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        loss = ((model(x).squeeze(-1) - x @ w) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=16)


@pytest.mark.timeout(60)
def test_learners_train_and_end_with_the_syncers_parameters(tmp_path):
    server = make_server(tmp_path).start()
    try:
        models = [make_model(seed=10 + i) for i in range(2)]
        learners = [
            Learner(m, syncer=server.address, num_fragments=P, learner_id=f"l{i}")
            for i, m in enumerate(models)
        ]
        for lr in learners:
            assert lr.wait_for_global(timeout=10)
        # Global model replaced each learner's own init.
        for m in models:
            for p in range(P):
                assert torch.equal(
                    server.layout.gather(p, dict(m.named_parameters())), server.state.params[p]
                )
        train_in_threads(train, learners, models, 40)
        for lr in learners:
            assert lr.flush(timeout=10)
        # Every fragment committed at least once; then let the last versions reach the learners.
        wait_until(
            lambda: (
                min(server.state.versions) >= 1
                and not any(r.contributions for r in server.state.rounds.values())
            ),
            10,
            "rounds to close",
        )

        def synced() -> bool:
            for lr in learners:
                lr.apply_arrived()
            return all(lr.versions == server.state.versions for lr in learners)

        wait_until(synced, 10, "learners to receive the final versions")
        for lr, m in zip(learners, models, strict=True):
            named = dict(m.named_parameters())
            for p in range(P):  # exactly what the syncer's wire image holds, next to its master
                assert torch.equal(server.layout.gather(p, named), server.service.committer.wire(p))
                assert torch.allclose(
                    server.service.committer.wire(p), server.state.params[p], atol=1e-6
                )
            assert lr.stats["bytes_up"] > 0 and lr.stats["uploads_refused"] == 0
        for lr in learners:
            lr.close(flush=False)
    finally:
        server.stop()
    tape = read_tape(tmp_path / "events.jsonl")
    # each flush named what it sent (the syncer waits for those when nobody is live)
    stopping = [r for r in tape if r["event"] == "stopping"]
    assert sorted(r["learner"] for r in stopping) == ["l0", "l1"]
    assert all(r["finals"] == list(range(P)) for r in stopping)
    rounds = [r for r in tape if r["event"] == "round"]
    assert {r["fragment"] for r in rounds} == set(range(P))
    assert sum(r["event"] == "join" for r in tape) >= 2


@pytest.mark.timeout(30)
def test_layout_mismatch_is_refused_with_the_tensor_name(tmp_path):
    server = make_server(tmp_path).start()
    try:
        torch.manual_seed(0)
        other = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))  # head differs
        learner = Learner(other, syncer=server.address, num_fragments=P, learner_id="odd")
        wait_until(lambda: learner.link.error is not None, 10, "the refusal")
        assert "2.weight" in str(learner.link.error)
        with pytest.raises(RuntimeError, match="refused"):
            learner.step(tokens=1)
        learner.close(flush=False)
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_bad_upload_gets_a_status_and_changes_nothing(tmp_path):
    server = make_server(tmp_path).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SyncerStub(ch)
            reply = stub.Join(join_request(server.layout, "a"), timeout=5)
            numel = server.layout.fragments[0].numel
            good = codecs.encode(torch.ones(numel), "fp32")
            before = server.service.committed_hash()

            def upload(**kw):
                fields = dict(
                    learner_id="a",
                    session=reply.session,
                    fragment=0,
                    base_version=0,
                    steps=1,
                    tokens=1,
                    codec="fp32",
                    numel=numel,
                    chunk_index=0,
                    num_chunks=1,
                    data=good,
                )
                fields.update(kw)
                return stub.Upload(iter([pb.UploadChunk(**fields)]), timeout=5)

            for bad, code in [
                ({"fragment": 99}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"data": good[:-4]}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"codec": "zip"}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"numel": numel + 1}, grpc.StatusCode.INVALID_ARGUMENT),
                ({"session": "nope"}, grpc.StatusCode.FAILED_PRECONDITION),
                (
                    {"data": codecs.encode(torch.ones(numel), "fp32")[:-4] + b"\x00\x00\xc0\x7f"},
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
            ]:
                with pytest.raises(grpc.RpcError) as info:
                    upload(**bad)
                assert info.value.code() == code, bad
            assert server.service.committed_hash() == before and not server.state.rounds
            status = stub.Status(pb.StatusRequest(), timeout=5)
            assert status.refused == 6
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_synchronous_learner_waits_for_the_round_of_what_it_sent(tmp_path):
    # wait-for-all 2: a round closes only when both learners sent the fragment
    server = make_server(
        tmp_path,
        wait_for_all=2,
        gamma=0.0,
        schedule="learner",
        protocol=ProtocolConfig(sync_every=4, num_fragments=P),
    ).start()
    try:
        models = [make_model(seed=20 + i) for i in range(2)]
        learners = [
            Learner(m, syncer=server.address, num_fragments=P, learner_id=f"s{i}")
            for i, m in enumerate(models)
        ]
        for lr in learners:
            assert lr.wait_for_global(timeout=10)
        train(learners[0], models[0], seed=1, steps=1)  # sends the fragment due at step 1
        assert learners[0].progress.awaited  # in flight
        stop = threading.Event()
        assert learners[0].wait_for_merges(1, timeout=0.1)  # lag 1: one more step allowed
        t0 = time.monotonic()
        assert not learners[0].wait_for_merges(0, timeout=1.0, stop=stop)  # peer has not sent
        assert time.monotonic() - t0 >= 0.9
        train(learners[1], models[1], seed=2, steps=1)  # the peer sends: the round closes
        assert learners[0].wait_for_merges(0, timeout=10)
        assert learners[1].wait_for_merges(0, timeout=10)
        assert learners[0].versions == learners[1].versions
        assert max(learners[0].versions) >= 1
        stop.set()
        train(learners[0], models[0], seed=1, steps=1)
        assert not learners[0].wait_for_merges(0, timeout=10, stop=stop)  # stop ends the wait
    finally:
        for lr in learners:
            lr.close(flush=False)
        server.stop()


@pytest.mark.timeout(60)
def test_an_upload_its_client_cancelled_is_refused_as_cancelled_and_admits_nothing(tmp_path):
    """A client that goes away mid-upload (cancels its call, or its connection closes) is
    not said to be late: the refusal on the tape says it cancelled; nothing is admitted."""
    server = make_server(tmp_path).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.SyncerStub(ch)
            reply = stub.Join(join_request(server.layout, "a"), timeout=5)
            numel = server.layout.fragments[0].numel
            data = codecs.encode(torch.ones(numel), "fp32")
            first_sent, hold = threading.Event(), threading.Event()

            def chunks():
                yield pb.UploadChunk(
                    learner_id="a",
                    session=reply.session,
                    fragment=0,
                    base_version=0,
                    steps=1,
                    tokens=1,
                    codec="fp32",
                    numel=numel,
                    chunk_index=0,
                    num_chunks=1,
                    data=data[: len(data) // 2],  # (its end never comes)
                    upload_id=7,
                )
                first_sent.set()  # (asked for the second chunk: the first one went out)
                hold.wait(30)  # the second chunk never comes: the client goes away first

            before = server.service.state_digest()
            call = stub.Upload.future(chunks(), timeout=30)
            wait_until(lambda: server.service.limits.open("upload") == 1, 30, "the upload held")
            first_sent.wait(10)  # (most often the syncer has its first chunk: not needed)
            call.cancel()
            hold.set()

            def refused():
                return [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "refused"]

            wait_until(lambda: refused(), 30, "the refusal on the tape")
            (record,) = refused()
            # (gRPC may hand the syncer the cancel as the stream's end: then it says that)
            assert record["code"] in ("CANCELLED", "INVALID_ARGUMENT"), record
            assert record["learner"] in ("a", ""), record  # ("": before its first chunk)
            said = record["reason"]
            assert "in time" not in said and "deadline" not in said, said
            assert "cancelled" in said or "went away" in said or "stream ended" in said, said
            assert server.service.state_digest() == before and not server.state.rounds
            assert server.state.receipts.admitted("a", 7, 0) is None
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_an_upload_past_its_deadline_is_refused_as_late(tmp_path):
    server = make_server(tmp_path).start()
    server.service.first_chunk_s = 0.5
    release = threading.Event()
    try:
        with Peer(server, "a") as peer:
            peer.join()
            (call,) = peer.silent_uploads(1, release)
            with pytest.raises(grpc.RpcError) as ended:
                call.result(timeout=30)
            assert ended.value.code() == grpc.StatusCode.CANCELLED
        release.set()
        # (the call ends on the client before the server's handler has written its record)
        refused = lambda: [  # noqa: E731
            r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "refused"
        ]
        (record,) = wait_until(refused, 10, "the refusal on the tape")
        assert record["code"] == "CANCELLED", record
        assert "did not arrive within its deadline of 0.5 s" in record["reason"], record
        assert not server.state.rounds
    finally:
        release.set()
        server.stop()

"""When a standalone syncer's run is over (``diloco syncer --stop-when-learners-leave``,
``--max-tokens``): the stop rule on real syncers' statuses, driven by raw wire clients.

The budget counts the tokens the syncer *merged*, never what learners claim in heartbeats;
a learner is gone only once it left (or its stream closed) with nothing of it still due.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from kit import join_request, local_syncer, tiny_model, wait_until

from diloco.algorithm import codecs
from diloco.config.service import ServiceConfig
from diloco.launch.syncer_stopping import StopRule
from diloco.syncer.config import SyncerConfig
from diloco.syncer.limits import DEFAULT_MAX_LEARNERS
from diloco.syncer.store import FragmentStore, StateError
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc

P = 2
LEASE_S = 0.4


def make_server(state_dir=None, **overrides):
    settings = {"up_codec": "fp32", "lease_s": LEASE_S, **overrides}
    model = tiny_model(0, (16, 16, 4), tanh=False)
    return local_syncer(model, SyncerConfig(**settings), num_fragments=P, state_dir=state_dir)


class WirePeer:
    """A learner speaking the wire protocol itself: it sends what the test says, when."""

    def __init__(self, server, learner_id: str) -> None:
        self.server, self.learner_id = server, learner_id
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.session = ""
        self.stream = None

    def join(self) -> None:
        self.session = self.stub.Join(
            join_request(self.server.layout, self.learner_id), timeout=5
        ).session

    def subscribe(self) -> None:
        """Open its subscription and read its first message (the stream is registered)."""
        request = pb.SubscribeRequest(learner_id=self.learner_id, session=self.session)
        self.stream = self.stub.Subscribe(request, timeout=60)
        next(self.stream)

    def heartbeat(self, tokens: int = 0) -> None:
        request = pb.HeartbeatRequest(
            learner_id=self.learner_id, session=self.session, tokens=tokens, steps_per_s=10.0
        )
        assert self.stub.Heartbeat(request, timeout=5).known

    def upload(self, fragment: int, *, tokens: int, final_fragments=()) -> pb.UploadReply:
        numel = self.server.layout.fragments[fragment].numel
        delta = 1e-4 * torch.ones(numel)
        chunk = pb.UploadChunk(
            learner_id=self.learner_id,
            session=self.session,
            fragment=fragment,
            base_version=self.server.state.versions[fragment],
            steps=4,
            tokens=tokens,
            codec="fp32",
            numel=numel,
            chunk_index=0,
            num_chunks=1,
            data=codecs.encode(delta, "fp32"),
            step_time_s=0.1,
            final=bool(final_fragments),
            final_fragments=list(final_fragments),
        )
        reply = self.stub.Upload(iter([chunk]), timeout=10)
        assert reply.accepted, reply.reason
        return reply

    def leave(self) -> None:
        self.stub.Leave(
            pb.LeaveRequest(learner_id=self.learner_id, session=self.session), timeout=5
        )

    def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.channel.close()


def over_after_linger(rule: StopRule, status, now: float = 100.0) -> str | None:
    """What ``rule`` says of ``status`` seen now and again well past its linger."""
    rule.check(status, now)
    return rule.check(status, now + 10 * rule.linger_s)


def row(learner_id: str = "a", **fields) -> pb.LearnerStatus:
    return pb.LearnerStatus(learner_id=learner_id, **fields)


# ---------------------------------------------------------------- the budget: merged tokens
def test_tokens_claimed_in_heartbeats_never_spend_the_budget():
    rule = StopRule(max_tokens=1000)
    claimed = pb.StatusReply(learners=[row(live=True, connected=True, tokens=2**62)])
    assert rule.check(claimed, now=0.0) is None
    assert rule.check(pb.StatusReply(learners=claimed.learners, merged_tokens=999), 1.0) is None
    merged = pb.StatusReply(learners=claimed.learners, merged_tokens=1000)
    assert rule.check(merged, 2.0) == "the syncer merged 1,000 tokens (budget 1,000)"


# ------------------------------------------------------------ gone: left, nothing still due
@pytest.mark.timeout(60)
def test_a_learner_whose_lease_expired_with_its_stream_open_keeps_the_run_going():
    server = make_server()
    peer = WirePeer(server, "slow")
    try:
        peer.join()
        peer.subscribe()
        peer.heartbeat()
        status = wait_until(
            lambda: (s := server.status()).learners[0].state == "lease expired" and s,
            10,
            "the learner's lease to expire",
        )
        assert not status.learners[0].live
        rule = StopRule(when_learners_leave=True, linger_s=LEASE_S)
        assert over_after_linger(rule, status) is None
    finally:
        peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_stopping_learner_keeps_the_run_going_until_its_finals_are_merged():
    server = make_server()
    peer = WirePeer(server, "flushing")
    try:
        peer.join()
        peer.subscribe()
        peer.heartbeat()
        peer.upload(0, tokens=40, final_fragments=[0, 1])  # one of its two finals
        status = server.status()
        assert not status.learners[0].live  # stopping: no longer asked, still flushing
        rule = StopRule(when_learners_leave=True, linger_s=LEASE_S)
        assert over_after_linger(rule, status) is None
        peer.upload(1, tokens=40, final_fragments=[0, 1])
        peer.leave()
        wait_until(lambda: server.status().waiting == 0, 10, "the finals to be merged")
        status = server.status()
        assert list(status.versions) == [1, 1]
        assert over_after_linger(rule, status) == "every learner left (1 joined)"
    finally:
        peer.close()
        server.stop()


def test_the_run_is_over_once_every_learner_left_with_nothing_due_for_the_linger():
    rule = StopRule(when_learners_leave=True, linger_s=5.0)
    left = row("a", state="left")
    closed = row("b", state="stream closed")
    assert rule.check(pb.StatusReply(), now=0.0) is None  # nobody joined yet: wait
    assert rule.check(pb.StatusReply(learners=[left, closed]), now=1.0) is None  # lingers
    back = row("b", connected=True, live=True)  # ... and b restarted within the linger
    assert rule.check(pb.StatusReply(learners=[left, back]), now=4.0) is None
    assert rule.check(pb.StatusReply(learners=[left, closed]), now=5.0) is None
    assert rule.check(pb.StatusReply(learners=[left, closed]), now=10.0) == (
        "every learner left (2 joined)"
    )
    for still_in, why in [
        ([left, row("b", connected=True, state="lease expired")], "its stream is open"),
        ([left, row("b", connected=True, finals_due=3)], "its finals are due"),
        ([left, row("b", finals_due=1)], "a final is due"),
    ]:
        rule = StopRule(when_learners_leave=True, linger_s=5.0)
        assert over_after_linger(rule, pb.StatusReply(learners=still_in)) is None, why
    rule = StopRule(when_learners_leave=True, linger_s=5.0)  # a round still holds theirs
    assert over_after_linger(rule, pb.StatusReply(learners=[left, closed], waiting=2)) is None
    assert StopRule().check(pb.StatusReply(learners=[left]), now=100.0) is None  # no rule
    assert not StopRule().active and rule.active and StopRule(max_tokens=1).active


@pytest.mark.timeout(60)
def test_learners_that_leave_or_whose_streams_close_after_their_finals_merged_end_the_run():
    server = make_server()
    peers = [WirePeer(server, "a"), WirePeer(server, "b")]
    try:
        for peer in peers:
            peer.join()
            peer.subscribe()
            peer.heartbeat()
        rule = StopRule(when_learners_leave=True, linger_s=LEASE_S)
        for peer in peers:
            for p in range(P):
                peer.upload(p, tokens=40, final_fragments=list(range(P)))
        assert over_after_linger(rule, server.status()) is None
        peers[0].leave()
        peers[1].stream.cancel()  # (a learner that died: its stream closes)
        status = wait_until(
            lambda: (
                (s := server.status()).waiting == 0
                and not any(ls.connected for ls in s.learners)
                and s
            ),
            10,
            "the finals merged and both learners gone",
        )
        assert list(status.versions) == [1] * P and status.merged_tokens == 2 * 40
        assert over_after_linger(rule, status) == "every learner left (2 joined)"
    finally:
        for peer in peers:
            peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_the_budget_ends_the_run_once_that_many_tokens_are_merged():
    server = make_server(schedule="learner")
    peer = WirePeer(server, "a")
    rule = StopRule(max_tokens=300)
    try:
        peer.join()
        peer.heartbeat(tokens=10**9)  # what it claims: never counted
        peer.upload(0, tokens=200)
        peer.upload(1, tokens=200)
        status = wait_until(
            lambda: (s := server.status()).waiting == 0 and s, 10, "both rounds merged"
        )
        assert status.merged_tokens == 200 and rule.check(status, now=0.0) is None
        peer.upload(0, tokens=200)  # fragment 0 merged 400, fragment 1 200: 300 in all
        status = wait_until(
            lambda: (s := server.status()).merged_tokens >= 300 and s, 10, "the third round"
        )
        assert rule.check(status, now=1.0) == "the syncer merged 300 tokens (budget 300)"
    finally:
        peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_merged_tokens_are_persisted_with_each_commit_and_restored_at_restart(tmp_path):
    state_dir = tmp_path / "state"
    server = make_server(state_dir, schedule="learner")
    peer = WirePeer(server, "a")
    try:
        peer.join()
        for fragment, tokens in [(0, 120), (1, 80), (0, 60)]:
            peer.upload(fragment, tokens=tokens)
            wait_until(lambda: server.status().waiting == 0, 10, "the round merged")
        assert server.status().merged_tokens == (180 + 80) // P
    finally:
        peer.close()
        server.stop()
    again = make_server(state_dir, schedule="learner")
    try:
        assert again.status().merged_tokens == (180 + 80) // P
    finally:
        again.stop()
    # A fragment file written before the total was kept: what its commit logs merged.
    store = FragmentStore(state_dir)
    version, params, extra = store.load(0, again.layout.fragments[0].numel)
    logs = [log.to_json() for log in store.load_commits(0)]
    store.save(0, version, params, extra, wire=extra["wire"], commits=logs)
    assert store.load(0, params.numel()) and store.load_merged_tokens(0) is None
    older = make_server(state_dir, schedule="learner")
    try:
        assert older.state.closing.merged_tokens == {0: 180, 1: 80}
    finally:
        older.stop()


def test_a_tampered_merged_token_count_fails_the_fragment_files_checksum(tmp_path):
    store = FragmentStore(tmp_path)
    store.fragment_dir.mkdir()
    params = torch.zeros(4)
    store.save(0, 3, params, {}, merged_tokens=500)
    assert store.load(0, 4)[0] == 3 and store.load_merged_tokens(0) == 500
    path = store.path(0)
    data = path.read_bytes()
    assert b'"merged_tokens":"500"' in data
    path.write_bytes(data.replace(b'"merged_tokens":"500"', b'"merged_tokens":"900"'))
    with pytest.raises(StateError, match="checksum mismatch"):
        store.load(0, 4)


def test_diloco_syncer_takes_max_learners_and_max_learner_ids_as_flags():
    from diloco.cli import build_parser
    from diloco.cli.common import config_from_args

    def parsed(*flags: str) -> ServiceConfig:
        return config_from_args(ServiceConfig, build_parser().parse_args(["syncer", *flags]))

    config = parsed("--max-learners", "200", "--max-learner-ids", "4000")
    assert (config.max_learners, config.syncer.max_learner_ids) == (200, 4000)
    assert parsed().max_learners == DEFAULT_MAX_LEARNERS
    for flags in (["--max-learners", "0"], ["--max-learners", "2000"]):
        with pytest.raises(ValueError, match=r"--max-learners must be in \[1, --max-learner-ids"):
            parsed(*flags)
    with pytest.raises(ValueError, match="max_learner_ids must be >= 1"):
        parsed("--max-learner-ids", "0")

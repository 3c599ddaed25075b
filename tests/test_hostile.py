"""A hostile fleet: one participant with valid credentials attacks a real syncer over gRPC.

One test per class of attack (docs/security.md "A hostile learner"): each runs honest
clients beside the attacker and asserts that the honest ones keep being served, that their
contributions keep landing, and (where the attack aims at the model) that the merged update
keeps a positive cosine with the honest learners' mean.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until

from diloco.launch.syncer_stopping import StopRule
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape
from diloco.wire import auth
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.protocol import ProtocolConfig

P = 2
SECRET = "hostile-fleet-secret-0123456789"


def make_server(tmp_path, config: SyncerConfig, **kwargs) -> SyncerServer:
    model = tiny_model(0, (32, 32, 8), tanh=False)
    return local_syncer(
        model, config, num_fragments=P, tape_path=tmp_path / "events.jsonl", **kwargs
    )


def config(**overrides) -> SyncerConfig:
    base = {
        "up_codec": "fp32",
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "schedule": "learner",
        "quorum": 1,
    }
    return SyncerConfig(**{**base, **overrides})


def numel(server: SyncerServer, fragment: int) -> int:
    return server.layout.fragments[fragment].numel


def rounds(tmp_path) -> list[dict]:
    return [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "round"]


def refusals(tmp_path) -> list[dict]:
    return [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "refused"]


# ------------------------------------------------------------------ 1. guard poisoning
@pytest.mark.timeout(60)
def test_a_flood_of_tiny_and_zero_deltas_does_not_poison_the_norm_guard(tmp_path):
    server = make_server(tmp_path, config(gamma=0.0))
    honest = [Peer(server, f"honest-{i}") for i in range(2)]
    mallory = Peer(server, "mallory")
    try:
        for peer in (*honest, mallory):
            peer.join()
        gen = torch.Generator().manual_seed(1)

        def honest_round():
            replies = [
                peer.upload(0, 0.01 * torch.randn(numel(server, 0), generator=gen))
                for peer in honest
            ]
            return all(r.accepted for r in replies)

        def room_in_the_round() -> bool:
            with server.service.lock:
                round_ = server.state.rounds.get(0)
                return round_ is None or "mallory" not in round_.contributions

        def flood(delta: torch.Tensor) -> None:
            """One of mallory's flood uploads, accepted: one over the uploads a learner may
            add to a round (``receipts.UPLOADS_PER_ROUND``) goes again after its commit."""
            while True:
                try:
                    assert mallory.upload(0, delta).accepted
                    return
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                wait_until(room_in_the_round, 10, "the commit of mallory's full round")

        for _ in range(3):  # history of honest sizes
            assert honest_round()
        for _ in range(80):  # one learner floods the fragment with tiny deltas ...
            flood(torch.full((numel(server, 0),), 1e-9))
        for _ in range(3):  # ... honest uploads of ordinary size are still accepted
            assert honest_round()
        for _ in range(40):  # ... then with zeros (a median of zeros turned the check off)
            flood(torch.zeros(numel(server, 0)))
        for _ in range(2):
            assert honest_round()
        # The guard is still on: 30x the honest size (within the fragment's own bound) is
        # refused by the per-step check (once mallory's flood is committed: a round full of
        # its uploads would refuse this one for that, on a busy machine).
        wait_until(room_in_the_round, 10, "the commit of mallory's last flood")
        with pytest.raises(grpc.RpcError) as info:
            mallory.upload(0, 0.3 * torch.randn(numel(server, 0), generator=gen))
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "median" in info.value.details()
        guarded = [r for r in refusals(tmp_path) if r["code"] == "OUT_OF_RANGE"]
        assert len(guarded) == 1 and guarded[0]["learner"] == "mallory"

        def merged(lid: str) -> int:
            return sum(
                r["increments"][r["participants"].index(lid)]
                for r in rounds(tmp_path)
                if lid in r["participants"]
            )

        # Each of the 8 honest uploads of each honest learner is merged (once).
        wait_until(lambda: merged("honest-0") == merged("honest-1") == 8, 10, "honest merges")
    finally:
        for peer in (*honest, mallory):
            peer.close()
        server.stop()


# ------------------------------------------------------------ 2. stalling by timing claims
@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["learner", "syncer"])
def test_a_claimed_slow_step_time_does_not_stall_the_rounds(tmp_path, schedule):
    server = make_server(tmp_path, config(schedule=schedule, protocol=ProtocolConfig(sync_every=4)))
    alice, mallory = Peer(server, "alice"), Peer(server, "mallory")
    try:
        alice.join(), mallory.join()
        mallory.heartbeat(steps_per_s=1 / 3599)
        mallory.upload(1, torch.zeros(numel(server, 1)), step_time_s=3599.0)
        started = time.monotonic()
        while time.monotonic() - started < 4.0:  # alice answers whatever is asked, 10 steps/s
            alice.heartbeat(steps_per_s=10.0)
            mallory.heartbeat(steps_per_s=1 / 3599)
            for p in range(P):
                alice.upload(
                    p, 1e-3 * torch.ones(numel(server, p)), steps=2, tokens=240, step_time_s=0.1
                )
            time.sleep(0.1)
        assert server.state.estimates().step_s == pytest.approx(0.1)
        merged = [r for r in rounds(tmp_path) if "alice" in r["participants"]]
        assert len(merged) >= 10, f"only {len(merged)} rounds merged alice's deltas in 4 s"
        assert max(r["wait_s"] for r in merged) < 1.0
    finally:
        alice.close(), mallory.close()
        server.stop()


# ------------------------------------------------------------- 3. thread-pool exhaustion
@pytest.mark.timeout(60)
def test_streams_without_a_first_chunk_cannot_fill_the_pool(tmp_path):
    server = make_server(tmp_path, config(), token=SECRET, learner_tokens=True, max_learners=8)
    server.service.first_chunk_s = 2.0
    mallory = Peer(server, "mallory", token=auth.learner_token(SECRET, "mallory"))
    alice = Peer(server, "alice", token=auth.learner_token(SECRET, "alice"))
    release = threading.Event()
    try:
        mallory.join()
        calls = mallory.silent_uploads(150, release)
        subs = [
            mallory.stub.Subscribe(
                pb.SubscribeRequest(learner_id="mallory", session=mallory.session),
                timeout=30,
                metadata=mallory.metadata,
            )
            for _ in range(30)
        ]
        time.sleep(0.5)
        # An honest learner joins at once and its contribution lands.
        t0 = time.monotonic()
        alice.join(timeout=5)
        assert time.monotonic() - t0 < 2.0
        assert alice.upload(0, 1e-3 * torch.ones(numel(server, 0))).accepted
        assert server.service.limits.open("upload") <= 4  # mallory's own cap
        assert server.service.limits.open("subscribe") <= 2
        # Past the first-chunk deadline mallory's held uploads are cancelled.
        wait_until(lambda: all(c.done() for c in calls), 10, "the silent uploads to end")
        codes = {c.exception().code() for c in calls if c.exception() is not None}
        assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
        assert grpc.StatusCode.CANCELLED in codes
        # (a call ends on the client before the server's handler has let go of its slot)
        wait_until(lambda: server.service.limits.open("upload") == 0, 10, "the slots freed")
        for s in subs:
            s.cancel()
    finally:
        release.set()
        alice.close(), mallory.close()
        server.stop()
    left = [t for t in threading.enumerate() if t.name.startswith("syncer-rpc")]
    assert not left, f"{len(left)} pool threads outlived SyncerServer.stop()"


@pytest.mark.timeout(60)
def test_with_a_shared_token_silent_streams_still_leave_room_for_joins(tmp_path):
    server = make_server(tmp_path, config(), token=SECRET, max_learners=8)
    server.service.first_chunk_s = 1.5
    mallory = Peer(server, "mallory", token=SECRET)
    release = threading.Event()
    try:
        mallory.join()
        calls = mallory.silent_uploads(150, release)
        time.sleep(0.5)
        assert server.service.limits.open("upload") <= 8
        for i in range(5):
            t0 = time.monotonic()
            Peer(server, f"newcomer-{i}", token=SECRET).join(timeout=5)
            assert time.monotonic() - t0 < 2.0
        wait_until(lambda: all(c.done() for c in calls), 10, "the silent uploads to end")
        alice = Peer(server, "alice", token=SECRET)
        alice.join()
        assert alice.upload(0, 1e-3 * torch.ones(numel(server, 0))).accepted
    finally:
        release.set()
        mallory.close()
        server.stop()


# ---------------------------------------------------------------------------- 4. identity
@pytest.mark.timeout(60)
def test_a_learner_token_cannot_take_over_another_learners_id(tmp_path):
    server = make_server(tmp_path, config(), token=SECRET, learner_tokens=True)
    alice = Peer(server, "alice", token=auth.learner_token(SECRET, "alice"))
    try:
        alice.join()
        for token in (auth.learner_token(SECRET, "mallory"), SECRET):
            thief = Peer(server, "alice", token=token)
            with pytest.raises(grpc.RpcError) as info:
                thief.join()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            thief.close()
        forged = Peer(
            server, "alice", token=auth.learner_token("another-secret-0123456789", "alice")
        )
        with pytest.raises(grpc.RpcError) as info:
            forged.join()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        forged.close()
        assert alice.heartbeat() and alice.upload(0, torch.ones(numel(server, 0))).accepted
        # The shared secret still reads the status.
        status = pb_grpc.SyncerStub(alice.channel).Status(
            pb.StatusRequest(), timeout=5, metadata=auth.call_metadata(SECRET)
        )
        assert [x.learner_id for x in status.learners] == ["alice"]
    finally:
        alice.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_learner_token_cannot_heartbeat_or_leave_for_another_learner(tmp_path):
    server = make_server(tmp_path, config(), token=SECRET, learner_tokens=True)
    alice = Peer(server, "alice", token=auth.learner_token(SECRET, "alice"))
    mallory = Peer(server, "alice", token=auth.learner_token(SECRET, "mallory"))
    try:
        alice.join()
        mallory.session = alice.session  # mallory knows alice's session
        before = server.service.state_digest()
        for call in (mallory.heartbeat, mallory.leave):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert server.service.state_digest() == before
        info = server.state.learners["alice"]
        assert info.connected and info.live and info.state == "joined"
        assert [r["rpc"] for r in refusals(tmp_path)] == ["Heartbeat", "Leave"]
        assert alice.heartbeat() and alice.upload(0, torch.ones(numel(server, 0))).accepted
    finally:
        alice.close(), mallory.close()
        server.stop()


@pytest.mark.timeout(60)
def test_ids_that_joined_and_left_do_not_lock_out_new_learners(tmp_path):
    server = make_server(tmp_path, config(max_learner_ids=16))
    try:
        for i in range(16):
            sybil = Peer(server, f"sybil-{i}")
            sybil.join()
            sybil.leave()
            sybil.close()
        newcomer = Peer(server, "newcomer")
        newcomer.join()
        assert newcomer.upload(0, torch.ones(numel(server, 0))).accepted
        assert len(server.state.learners) == 16 and "sybil-0" not in server.state.learners
        newcomer.close()
        # A table full of *live* ids still refuses a new one.
        live = [Peer(server, f"live-{i}") for i in range(15)]
        for peer in live:
            peer.join()
        with pytest.raises(grpc.RpcError) as info:
            Peer(server, "one-too-many").join()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_idle_ids_do_not_dilute_the_honest_rounds(tmp_path):
    server = make_server(tmp_path, config(quorum=2, gamma=0.0))
    alice, bob = Peer(server, "alice"), Peer(server, "bob")
    idle = [Peer(server, f"idle-{i}") for i in range(200)]
    try:
        alice.join(), bob.join()
        for i, peer in enumerate(idle):
            peer.join()
            peer.heartbeat(tokens=10**6 * (i + 1))
        for p in range(P):
            for peer in (alice, bob):
                assert peer.upload(p, torch.ones(numel(server, p))).accepted
        wait_until(lambda: len(rounds(tmp_path)) >= P, 10, "the honest rounds")
        shares = [r["share"] for r in rounds(tmp_path)]
        assert shares == [1.0] * P, shares
    finally:
        for peer in (alice, bob, *idle):
            peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_synchronous_rounds_are_not_closed_by_ids_that_only_joined_and_left(tmp_path):
    server = make_server(tmp_path, config(wait_for_all=2, gamma=0.0))
    alice, bob = Peer(server, "alice"), Peer(server, "bob")
    try:
        alice.join(), bob.join()
        for i in range(5):
            sybil = Peer(server, f"sybil-{i}")
            sybil.join()
            sybil.leave()
            sybil.close()
        assert alice.upload(0, torch.ones(numel(server, 0))).accepted
        time.sleep(1.0)
        assert rounds(tmp_path) == []  # still waiting for bob
        assert bob.upload(0, torch.ones(numel(server, 0))).accepted
        wait_until(lambda: len(rounds(tmp_path)) == 1, 10, "the synchronous round")
        assert rounds(tmp_path)[0]["participants"] == ["alice", "bob"]
    finally:
        alice.close(), bob.close()
        server.stop()


# ------------------------------------------------------------------ 5. weight and step claims
def honest_deltas(n: int, count: int, agreement: float, seed: int) -> list[torch.Tensor]:
    """``count`` deltas of one size sharing a common direction: pairwise cosine ~``agreement``."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=gen)
    own = [torch.randn(n, generator=gen) for _ in range(count)]
    a = agreement**0.5
    return [0.01 * (a * common + (1 - agreement) ** 0.5 * x) for x in own]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agreement", [0.1, 0.5])
def test_inflated_tokens_and_a_reversed_delta_cannot_turn_the_merged_update(tmp_path, agreement):
    server = make_server(tmp_path, config(quorum=4, gamma=0.0, outer_scale="none"))
    honest = [Peer(server, f"honest-{i}") for i in range(3)]
    mallory = Peer(server, "mallory")
    try:
        for peer in honest:
            peer.join(tokens_per_step=10)
        mallory.join(tokens_per_step=1 << 24)  # declares the most a step may hold
        n = numel(server, 0)
        for seed in range(3):
            deltas = honest_deltas(n, 3, agreement, seed)
            mean = torch.stack(deltas).mean(0)
            before = server.state.params[0].clone()
            for peer, d in zip(honest, deltas, strict=True):
                assert peer.upload(0, d, steps=24, tokens=240).accepted
            reversed_ = -mean / mean.norm() * deltas[0].norm()  # the honest size, turned
            assert mallory.upload(0, reversed_, steps=24, tokens=24 << 24).accepted
            wait_until(lambda s=seed: len(rounds(tmp_path)) == s + 1, 10, "the round")
            record = rounds(tmp_path)[-1]
            assert record["excluded"].keys() == {"mallory"}, record
            update = before - server.state.params[0]  # outer lr 1, no momentum: the merge
            cos = torch.nn.functional.cosine_similarity(update, mean, dim=0)
            assert cos > 0.5, f"merged update against the honest mean: cosine {cos:.3f}"
        # Left out of every checked round, mallory is now suspect: in a round too small to
        # check (two honest learners left) it is left out too.
        for peer in honest[1:]:
            peer.leave()
        deltas = honest_deltas(n, 1, agreement, seed=9)
        before = server.state.params[0].clone()
        assert honest[0].upload(0, deltas[0], steps=24, tokens=240).accepted
        assert mallory.upload(0, -deltas[0], steps=24, tokens=24 << 24).accepted
        wait_until(lambda: len(rounds(tmp_path)) == 4, 10, "the small round")
        record = rounds(tmp_path)[-1]
        assert record["participants"] == ["honest-0"] and record["excluded"] == {
            "mallory": "suspect"
        }
        update = before - server.state.params[0]
        assert torch.nn.functional.cosine_similarity(update, deltas[0], dim=0) > 0.99
    finally:
        for peer in (*honest, mallory):
            peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_weight_claims_are_capped_when_the_direction_is_ordinary(tmp_path):
    server = make_server(tmp_path, config(quorum=3, gamma=0.0, direction_floor=-1.0))
    peers = [Peer(server, name) for name in ("honest-0", "honest-1", "mallory")]
    try:
        for peer in peers[:2]:
            peer.join(tokens_per_step=10)
        peers[2].join(tokens_per_step=1 << 24)
        d = torch.ones(numel(server, 0))
        for peer in peers[:2]:
            assert peer.upload(0, d, steps=24, tokens=240).accepted
        assert peers[2].upload(0, d, steps=24, tokens=24 << 24).accepted
        wait_until(lambda: rounds(tmp_path), 10, "the round")
        record = rounds(tmp_path)[0]
        weights = dict(zip(record["participants"], record["weights"], strict=True))
        # tokens²/steps = 2400 for the honest ones; mallory's claim is capped at 3x that
        assert weights == {"honest-0": 2400.0, "honest-1": 2400.0, "mallory": 7200.0}
    finally:
        for peer in peers:
            peer.close()
        server.stop()


@pytest.mark.timeout(60)
def test_an_inflated_step_count_does_not_let_a_huge_delta_through(tmp_path):
    server = make_server(tmp_path, config(gamma=0.0))
    alice, mallory = Peer(server, "alice"), Peer(server, "mallory")
    try:
        alice.join(), mallory.join()
        alice.heartbeat(steps_per_s=10.0), mallory.heartbeat(steps_per_s=10.0)
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            d = 0.01 * torch.randn(numel(server, 0), generator=gen)
            assert alice.upload(0, d, steps=24).accepted
        theta = server.state.params[0]
        huge = torch.randn(numel(server, 0), generator=gen)
        huge = huge / huge.norm() * 9.0 * theta.norm()  # 9x the fragment's own norm
        with pytest.raises(grpc.RpcError) as info:
            mallory.upload(0, huge, steps=1 << 20, tokens=1 << 20)
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert alice.upload(0, 0.01 * torch.randn(numel(server, 0), generator=gen)).accepted
    finally:
        alice.close(), mallory.close()
        server.stop()


@pytest.mark.timeout(60)
def test_an_undeclared_learner_cannot_inflate_its_tokens_per_step_later(tmp_path):
    server = make_server(tmp_path, config(gamma=0.0))
    mallory = Peer(server, "mallory")
    try:
        mallory.join(tokens_per_step=0)  # 0: not declared
        ones = torch.ones(numel(server, 0))
        assert mallory.upload(0, 1e-3 * ones, steps=24, tokens=240).accepted  # 10 per step
        for rejoin in (False, True):  # the bound is kept across rejoins
            if rejoin:
                mallory.join(tokens_per_step=0)
            before = server.state.learners["mallory"].contributions
            with pytest.raises(grpc.RpcError) as info:
                mallory.upload(0, 1e-3 * ones, steps=24, tokens=24_000)  # 1000 per step
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tokens per step" in info.value.details()
            assert server.state.learners["mallory"].contributions == before
            # The same batch as before is always accepted (and a little more, or less).
            for tokens in (240, 480, 24):
                assert mallory.upload(0, 1e-3 * ones, steps=24, tokens=tokens).accepted
    finally:
        mallory.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_heartbeat_claiming_2_62_tokens_does_not_end_a_standalone_run(tmp_path):
    """``diloco syncer --max-tokens`` counts the tokens the syncer merged, never claims."""
    server = make_server(tmp_path, config())
    mallory, alice = Peer(server, "mallory"), Peer(server, "alice")
    budget = StopRule(max_tokens=1000)
    try:
        mallory.join(), alice.join()
        assert mallory.heartbeat(tokens=2**62)
        assert alice.upload(0, 1e-3 * torch.ones(numel(server, 0)), tokens=240).accepted
        status = wait_until(
            lambda: (s := server.status()).waiting == 0 and s, 10, "alice's round merged"
        )
        claimed = {ls.learner_id: ls.tokens for ls in status.learners}
        assert claimed["mallory"] == 2**62  # shown as claimed ...
        assert status.merged_tokens == 240 // P  # ... counted as merged: alice's, 1 of P
        assert budget.check(status, now=0.0) is None
    finally:
        alice.close(), mallory.close()
        server.stop()

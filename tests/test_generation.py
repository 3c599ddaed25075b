"""One live process per learner id (issue 46, defect 4): a zombie beside its replacement.

Contract (docs/algorithm.md, "Syncer failures: what a learner may assume", Fencing; and
"Learner side"): a join names its process's generation; the syncer keeps the highest per id
(in its state directory, across restarts) and refuses a lower one for good, which ends that
learner with an error; a refused resend's fate is unknown unless the syncer proves it was
never admitted.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until

import diloco
from diloco.learner.refusals import upload_refusal
from diloco.learner.uploads import UploadResult
from diloco.syncer.generations import GENERATIONS_FILE
from diloco.wire.protocol import NOT_ADMITTED_KEY, SUPERSEDED_KEY


def make_model():
    return tiny_model(0, (4, 3), tanh=False)


def refused_join(peer: Peer) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        peer.join()
    return caught.value


def test_a_superseded_process_is_refused_and_its_uploads_never_merged(tmp_path):
    server = local_syncer(make_model(), num_fragments=1, tape_path=tmp_path / "tape.jsonl")
    zombie = Peer(server, "L", generation=5)
    replacement = Peer(server, "L", generation=6)
    try:
        zombie.join()
        replacement.join()
        err = refused_join(zombie)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "superseded" in err.details() and "5" in err.details() and "6" in err.details()
        assert dict(err.trailing_metadata())[SUPERSEDED_KEY] == "6"
        with pytest.raises(grpc.RpcError) as upload:  # its old session is gone
            zombie.upload(0, torch.full((server.layout.fragments[0].numel,), 1e-3))
        assert upload.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert server.state.rounds.get(0) is None or not server.state.rounds[0].contributions
        assert replacement.heartbeat()  # the replacement's session stands
        assert replacement.join().session  # and it may rejoin at its generation
    finally:
        server.stop()


def test_generation_zero_neither_fences_nor_is_fenced():
    server = local_syncer(make_model(), num_fragments=1)
    try:
        Peer(server, "L", generation=7).join()
        assert Peer(server, "L").join().session  # (a client that predates generations)
        assert Peer(server, "L", generation=7).join().session
    finally:
        server.stop()


def test_the_fence_survives_a_syncer_restart(tmp_path):
    state_dir = tmp_path / "state"
    server = local_syncer(make_model(), num_fragments=1, state_dir=state_dir)
    try:
        Peer(server, "L", generation=6).join()
    finally:
        server.stop()
    assert (state_dir / GENERATIONS_FILE).exists()
    server = local_syncer(make_model(), num_fragments=1, state_dir=state_dir)
    try:
        err = refused_join(Peer(server, "L", generation=5))  # the zombie reaches it first
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert Peer(server, "L", generation=6).join().session
    finally:
        server.stop()


def test_a_corrupt_generations_file_stops_the_syncer_at_start(tmp_path):
    state_dir = tmp_path / "state"
    local_syncer(make_model(), num_fragments=1, state_dir=state_dir, start=False).stop()
    (state_dir / GENERATIONS_FILE).write_text('{"L": -1}')
    with pytest.raises(diloco.syncer.store.StateError, match=GENERATIONS_FILE):
        local_syncer(make_model(), num_fragments=1, state_dir=state_dir, start=False)


def test_a_learner_superseded_by_a_newer_process_stops_with_an_error():
    model = make_model()
    server = local_syncer(model, num_fragments=1)
    learner = diloco.Learner(
        make_model(), syncer=server.address, num_fragments=1, learner_id="L", generation=5
    )
    try:
        assert learner.link.connected.wait(10)
        Peer(server, "L", generation=6).join()  # its replacement
        learner.link.reconnect()  # (it would on its next heartbeat: "unknown session")
        wait_until(lambda: learner.link.error is not None, 10, "the link gives up")
        with pytest.raises(RuntimeError, match="superseded by a newer process"):
            learner.step(1)
    finally:
        learner.close(flush=False)
        server.stop()


def test_a_refused_resend_is_unknown_unless_the_syncer_proves_it_was_never_admitted():
    refused = grpc.StatusCode.FAILED_PRECONDITION
    assert upload_refusal(refused, (), resend=False) == "refused"
    assert upload_refusal(grpc.StatusCode.OUT_OF_RANGE, (), resend=False) == "guard"
    assert upload_refusal(refused, (), resend=True) == "unknown"
    assert upload_refusal(refused, ((NOT_ADMITTED_KEY, "1"),), resend=True) == "refused"
    assert upload_refusal(grpc.StatusCode.UNAVAILABLE, (), resend=True) is None


def test_a_resend_sent_with_a_stale_session_is_answered_from_the_receipts(tmp_path):
    """Found by review: the syncer checked an upload's session before its receipts, so the
    resend of an accepted upload sent before its learner rejoined was refused "unknown
    session" and the learner sent that progress again: merged twice."""
    server = local_syncer(make_model(), num_fragments=1)
    peer = Peer(server, "L", generation=1)
    try:
        peer.join()
        stale = peer.session
        first = peer.upload(upload_id=77, base=0, steps=4, tokens=40)
        assert first.accepted
        peer.join()  # a new session; the first reply was "lost"
        peer.session = stale  # the resend goes out with the session it was first sent with
        again = peer.upload(upload_id=77, base=0, steps=4, tokens=40, resend=True)
        assert again.accepted and again.current_version == first.current_version
        with pytest.raises(grpc.RpcError) as caught:  # never admitted: the refusal says so
            peer.upload(upload_id=78, base=0, steps=4, tokens=40, resend=True)
        assert dict(caught.value.trailing_metadata()).get(NOT_ADMITTED_KEY) == "1"
    finally:
        server.stop()


def test_a_resend_refused_without_proof_is_counted_unknown_not_sent_again():
    """A resend whose refusal does not prove it never admitted (``upload_refusal``):
    counted unknown by the learner, off its ledger, its progress not returned."""
    model = torch.nn.Linear(4, 3, bias=False)
    learner = diloco.Learner(model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me")
    try:
        learner.listener.on_rejoin("127.0.0.1:1", "first", [0], (0,))
        learner.listener.on_fragment(0, 1, torch.zeros(12), frozenset())
        learner.apply_arrived()
        with torch.no_grad():
            model.weight.add_(0.5)
        learner.steps_since[0] += 2
        learner.tokens_since[0] += 20
        assert learner._queue(0)
        job = learner.link.withdraw(0)
        job.attempts = 1
        outcome = upload_refusal(grpc.StatusCode.FAILED_PRECONDITION, (), resend=True)
        learner.listener.on_result(job, UploadResult(outcome))
        learner.apply_arrived()
        books = learner.accounting()
        assert books.unknown == (2,) and books.unsent == (0,)
    finally:
        learner.close(flush=False)


def test_a_replacement_after_a_backward_clock_step_still_supersedes_its_zombie(
    tmp_path, monkeypatch
):
    """The default generation is taken from a counter in the learner's work directory
    (``generation_file``), never below the last one taken there: a wall clock stepped back
    between two starts (NTP, a VM resumed) cannot give the replacement the lower one."""
    import time

    server = local_syncer(make_model(), num_fragments=1)
    workdir_file = tmp_path / "generation"
    learners = []

    def start(wall_ns: int) -> diloco.Learner:
        monkeypatch.setattr(time, "time_ns", lambda: wall_ns)
        learner = diloco.Learner(
            make_model(),
            syncer=server.address,
            num_fragments=1,
            learner_id="L",
            generation_file=str(workdir_file),
        )
        learners.append(learner)
        assert learner.link.connected.wait(10)
        return learner

    try:
        start(2_000_000_000_000_000_000)
        first = server.state.roster.generations.highest["L"]
        start(2_000_000_000_000_000_000 - 60 * 10**9)  # the clock went back a minute
        second = server.state.roster.generations.highest["L"]
        assert second > first
    finally:
        for learner in learners:
            learner.close(flush=False)
        server.stop()

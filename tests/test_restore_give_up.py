"""A learner restored from its checkpoint that starts training before its first join
(issue 46, review of the restore changes): nothing guessed.

The previous life queued an upload after its checkpoint that carried the checkpointed
progress, and the syncer merged it. The restored learner cannot reach the syncer within
its join timeout and trains on (as ``diloco learner`` and the integrations do after a
restart). That upload's fate is unknown to it: the progress it may have carried is
counted *unknown* (neither merged nor sent again), and the steps it reached past the
checkpoint are skipped, so the exactly-once audit balances whatever the fate was. Real
parts: a syncer on a state directory, stopped and started again on the same address.
"""

import socket

import pytest
import torch
from kit import Peer, local_syncer, wait_until
from test_restore_accepted import (
    CHECKPOINT_STEP,
    UPLOAD_STEP,
    P,
    audit_of,
    config,
    make_learner,
    make_model,
    restored_life,
    train_to,
)

import diloco
from diloco.learner.journal import UploadJournal


def free_address() -> str:
    """A loopback address nothing listens on (yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def merged_previous_life(tmp_path):
    """A previous life whose upload of fragment 0 (8 steps: the checkpoint's 6 and 2 more)
    was merged; the syncer then stops, and comes back only when the caller starts it."""
    state_dir, tape = tmp_path / "state", tmp_path / "events.jsonl"
    address = free_address()
    server = local_syncer(
        make_model(), config(), num_fragments=P, state_dir=state_dir, tape_path=tape, bind=address
    )
    first = None
    try:
        model = make_model()
        first = make_learner(tmp_path, model, address)
        first.wait_for_global(timeout=30)
        train_to(first, model, CHECKPOINT_STEP)
        state = first.state_dict()
        trained = [first.layout.gather(p, first.params) for p in range(P)]
        train_to(first, model, UPLOAD_STEP)
        assert first._queue(0)
        wait_until(lambda: server.state.versions[0] == 1, 20, "the upload's commit")
    finally:
        if first is not None:
            first.close(flush=False)
        server.stop()
    return address, state, trained


def successor_of(tmp_path, address: str):
    return local_syncer(
        make_model(),
        config(),
        num_fragments=P,
        state_dir=tmp_path / "state",
        tape_path=tmp_path / "events.jsonl",
        bind=address,
    )


def send_everything(learner, successor) -> None:
    """Rejoin the successor, send both fragments' progress and take the merges back."""
    wait_until(
        lambda: learner.apply_arrived() is not None and learner.link.joined_versions is not None,
        30,
        "the restored learner to join the successor",
    )
    for p in range(P):
        learner._queue(p)
    wait_until(
        lambda: learner.apply_arrived() is not None and not list(learner._ledger.items()),
        30,
        "the merges to come back",
    )


@pytest.mark.timeout(150)
def test_a_first_join_given_up_counts_the_carried_progress_unknown_and_skips_its_steps(
    tmp_path,
):
    """The join times out (``wait_for_global`` gives False): the restored learner only
    logged a warning, so the checkpoint's 6 steps of fragment 0, already merged under the
    previous life's upload, were sent again and merged twice (the audit said so)."""
    address, state, trained = merged_previous_life(tmp_path)
    restored = successor = None
    try:
        restored = restored_life(tmp_path, state, trained, address)
        assert not restored.wait_for_global(timeout=0.5, required=False)
        assert restored.unknown_steps == [CHECKPOINT_STEP, 0]
        assert restored.steps_since == [0, CHECKPOINT_STEP]
        assert restored.ahead_on_restore == UPLOAD_STEP - CHECKPOINT_STEP
        restored.skip(restored.ahead_on_restore, tokens=20)
        assert restored.accounting().balanced()

        successor = successor_of(tmp_path, address)
        send_everything(restored, successor)
        restored.close()
        assert audit_of(tmp_path, restored) == []
    finally:
        if restored is not None:
            restored.close(flush=False)
        if successor is not None:
            successor.stop()


@pytest.mark.timeout(150)
def test_a_first_join_waiting_in_the_inbox_is_settled_before_the_first_step_gives_up(
    tmp_path,
):
    """The rejoin arrives just after the join timeout, before the first ``step``: ``step``
    gave up the unconfirmed uploads before settling, so the rejoin that would have said the
    upload was merged was thrown away and the checkpoint's progress sent again."""
    address, state, trained = merged_previous_life(tmp_path)
    restored = successor = None
    try:
        restored = restored_life(tmp_path, state, trained, address)
        successor = successor_of(tmp_path, address)
        wait_until(lambda: restored.link.joined_versions is not None, 30, "the join")
        restored.step(10)  # (the rejoin is still in the inbox: not settled yet)
        assert restored.merged_steps[0] == CHECKPOINT_STEP
        assert restored.unknown_steps == [0, 0]
        restored.local_step -= 1  # (that step stands for one the previous life trained)
        restored.total_tokens -= 10
        restored.steps_since = [s - 1 for s in restored.steps_since]
        restored.tokens_since = [t - 10 for t in restored.tokens_since]
        restored.skip(restored.ahead_on_restore, tokens=20)
        send_everything(restored, successor)
        restored.close()
        assert audit_of(tmp_path, restored) == []
    finally:
        if restored is not None:
            restored.close(flush=False)
        if successor is not None:
            successor.stop()


def test_a_delta_a_later_life_had_back_is_not_resent_without_a_delivery_file(tmp_path):
    """The checkpoint holds an unanswered delta of fragment 0; a later life had it back
    (refused: its journal says ``returned``) and sent its steps in its next upload. A
    learner with an upload journal and no delivery file never looked (``take_back_returned``
    ran only with a delivery log): it sent the delta again under its id, merged twice."""
    address = free_address()
    journal = str(tmp_path / "uploads.jsonl")
    model = make_model()
    first = diloco.Learner(
        model, syncer=address, num_fragments=P, learner_id="me", journal_file=journal
    )
    server = local_syncer(make_model(), config(), num_fragments=P, bind=address)
    first.wait_for_global(timeout=30)
    server.stop()  # (the delta below stays unanswered)
    train_to(first, model, CHECKPOINT_STEP)
    assert first._queue(0)
    state = first.state_dict()
    first.close(flush=False)
    (entry,) = state["ledger"]
    later = UploadJournal(journal, CHECKPOINT_STEP)
    later.settled(entry["upload_id"], "returned")
    later.close()

    restored = diloco.Learner(
        make_model(),
        syncer=address,
        num_fragments=P,
        learner_id="me",
        journal_file=journal,
        state=state,
    )
    try:
        assert list(restored._ledger.items()) == []  # not resent under its id
        assert restored.steps_since == [CHECKPOINT_STEP, CHECKPOINT_STEP]
    finally:
        restored.close(flush=False)


@pytest.mark.timeout(150)
def test_an_upload_checked_against_another_lineage_counts_unknown(tmp_path):
    """The restored learner's first join meets another lineage (a state directory replaced:
    here a syncer without one) whose logs of fragment 0 begin at the checkpoint's version
    0. Its commits cannot hold the previous life's upload; the learner took that for "never
    committed" (its versions are another lineage's) and sent the carried progress again.
    Another lineage's answer says nothing of the upload: its progress counts unknown."""
    address, state, trained = merged_previous_life(tmp_path)
    other = local_syncer(make_model(), config(), num_fragments=P, bind=address)
    peer = Peer(other, "x")
    restored = None
    try:
        peer.join()
        numel = other.layout.fragments[0].numel
        assert peer.upload(0, torch.full((numel,), 1e-3), steps=1, base=0, upload_id=7).accepted
        wait_until(lambda: other.state.versions[0] == 1, 20, "the other lineage's commit")
        restored = restored_life(tmp_path, state, trained, address)
        wait_until(
            lambda: restored.apply_arrived() is not None and not restored.restorer.unconfirmed,
            30,
            "the first join",
        )
        assert restored.unknown_steps[0] == CHECKPOINT_STEP
        assert restored.steps_since[0] == 0  # not sent again
    finally:
        if restored is not None:
            restored.close(flush=False)
        peer.close()
        other.stop()

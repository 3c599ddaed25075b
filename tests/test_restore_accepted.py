"""A learner restored from its checkpoint: "accepted" is not "merged" (issue 46, review).

Its previous life queued an upload after the checkpoint and had it accepted (the delivery
log says so), then died. Accepted is not merged: the round may die with its syncer (a
syncer's admissions are durable only at commit), or the direction check may leave the
upload out. The restored learner must count those steps by what the syncer's commits say
at its first join, never as merged on the strength of the acceptance alone. Nor is "held"
merged: the join reply tells an upload sitting in a round still open (kept in flight: the
syncer may die before that round commits) and one a committed round left out (whatever
the heartbeat's note of the most recent ones says) from one merged. Real parts: a syncer
process killed with SIGKILL, a real successor on its state directory, real learners.
"""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until

import diloco
from diloco.report.exactly_once import audit
from diloco.syncer.config import SyncerConfig
from diloco.syncer.receipts import REPORTED_DROPS
from diloco.syncer.store import read_tape

P = 2
CHECKPOINT_STEP, UPLOAD_STEP = 6, 8
"""The previous life checkpoints at step 6 (6 steps of both fragments unsent), then trains
to step 8 and queues fragment 0 (8 steps: it carries the checkpoint's 6)."""
FIELDS = {"schedule": "learner", "norm_guard_k": 0.0, "up_codec": "fp32", "heartbeat_s": 0.1}

CHILD = textwrap.dedent(
    """
    import dataclasses, os, sys, threading
    sys.path.insert(0, {tests!r})
    from kit import tiny_model
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer
    state_dir, tape, port_file = sys.argv[1:4]
    config = SyncerConfig(**{fields!r})
    protocol = dataclasses.replace(config.protocol, num_fragments={P})
    config = dataclasses.replace(config, protocol=protocol)
    server = SyncerServer.for_model(
        tiny_model(0, (16, 32, 4), tanh=False), config=config, state_dir=state_dir,
        tape_path=tape,
    ).start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.port))
    os.replace(port_file + ".tmp", port_file)
    threading.Event().wait()
    """
)


def make_model() -> torch.nn.Module:
    return tiny_model(0, (16, 32, 4), tanh=False)


def config(**fields) -> SyncerConfig:
    return SyncerConfig(**{**FIELDS, **fields})


def make_learner(tmp_path, model, address: str, state=None) -> diloco.Learner:
    return diloco.Learner(
        model,
        syncer=address,
        num_fragments=P,
        learner_id="me",
        delivery_file=str(tmp_path / "delivered.json"),
        journal_file=str(tmp_path / "uploads.jsonl"),
        state=state,
    )


def train_to(learner: diloco.Learner, model, step: int) -> None:
    """Progress on both fragments up to ``step`` (none of it sent)."""
    gained = step - learner.local_step
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.01 * gained)
    learner.local_step = step
    learner.steps_since = [s + gained for s in learner.steps_since]
    learner.tokens_since = [t + 10 * gained for t in learner.tokens_since]


def previous_life(tmp_path, address: str):
    """A life that checkpoints at step 6, queues fragment 0 at step 8 and sees it accepted;
    returns it, its checkpoint, the values it held then and the delta the syncer accepted.
    The caller kills it (closes it without a flush) once the syncer is dealt with."""
    model = make_model()
    learner = make_learner(tmp_path, model, address)
    learner.wait_for_global(timeout=30)
    train_to(learner, model, CHECKPOINT_STEP)
    state = learner.state_dict()
    trained = [learner.layout.gather(p, learner.params) for p in range(P)]
    train_to(learner, model, UPLOAD_STEP)
    assert learner._queue(0)
    delivered = tmp_path / "delivered.json"
    wait_until(lambda: delivered.is_file() and "0" in json.loads(delivered.read_text()), 20)
    learner.apply_arrived()
    (entry,) = learner._ledger.of(0)
    assert entry.admitted == 0
    return learner, state, trained, entry.delta.clone()


def restored_life(tmp_path, state, trained, address: str) -> diloco.Learner:
    """The learner started again from ``state`` (the model loaded from the checkpoint)."""
    model = make_model()
    learner = make_learner(tmp_path, model, address, state)
    with torch.no_grad():
        for p in range(P):
            learner.layout.scatter(p, trained[p], learner.params)
    return learner


def rounds(tmp_path) -> list[dict]:
    return [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "round"]


def audit_of(tmp_path, learner: diloco.Learner) -> list[str]:
    """The exactly-once audit's problems, with ``learner`` (closed cleanly) as the last life."""
    final = {
        "life": learner.journal.life,
        "accounting": learner.accounting().to_dict(),
        "unanswered": learner.unanswered_uploads(),
    }
    journal = [json.loads(x) for x in (tmp_path / "uploads.jsonl").read_text().splitlines()]
    tape = read_tape(tmp_path / "events.jsonl")
    return audit(tape, {"me": journal}, {"me": final}).problems


@pytest.mark.timeout(120)
def test_an_upload_accepted_into_a_round_its_killed_syncer_never_committed_is_sent_again(
    tmp_path,
):
    """(a) The syncer waits for two learners, so the previous life's upload sits accepted in
    an open round when the syncer is SIGKILLed; the learner dies too. Restored, the learner
    took the delivery log's "accepted" as merged: the checkpoint's 6 steps of fragment 0
    counted merged, fragment 0 put back at its anchor and the 2 steps after the checkpoint
    skipped, although no commit ever held them. The successor's commits do not hold the
    upload (its round died): the progress is undelivered, sent again, merged once."""
    state_dir, tape = tmp_path / "state", tmp_path / "events.jsonl"
    script = tmp_path / "syncer.py"
    fields = {**FIELDS, "wait_for_all": 2}
    script.write_text(CHILD.format(tests=str(Path(__file__).parent), fields=fields, P=P))
    port_file = tmp_path / "port"
    child = subprocess.Popen(
        [sys.executable, str(script), str(state_dir), str(tape), str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    first = successor = restored = None
    try:
        wait_until(port_file.is_file, 60, "the child syncer's port", alive=child)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        first, state, trained, _ = previous_life(tmp_path, address)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
        first.close(flush=False)

        successor = local_syncer(
            make_model(), config(), num_fragments=P, state_dir=state_dir, tape_path=tape
        )
        restored = restored_life(tmp_path, state, trained, successor.address)
        restored.wait_for_global(timeout=30)
        assert restored.ahead_on_restore == 0 and restored.dropped_on_restore == []
        assert restored.merged_steps == [0, 0] and restored.unknown_steps == [0, 0]
        assert restored.steps_since == [CHECKPOINT_STEP, CHECKPOINT_STEP]
        assert torch.equal(restored.layout.gather(0, restored.params), trained[0])
        # It sends its progress again; the successor merges it once.
        for p in range(P):
            assert restored._queue(p)
        wait_until(lambda: successor.state.versions == [1, 1], 20)
        wait_until(
            lambda: restored.apply_arrived() is not None and not list(restored._ledger.items()), 20
        )
        books = restored.accounting()
        assert books.merged == (CHECKPOINT_STEP, CHECKPOINT_STEP) and books.balanced()
        restored.close()
        assert audit_of(tmp_path, restored) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=30)
        for learner in (first, restored):
            if learner is not None:
                learner.close(flush=False)
        if successor is not None:
            successor.stop()


@pytest.mark.timeout(120)
def test_an_accepted_upload_the_direction_check_left_out_is_not_counted_merged_on_restore(
    tmp_path,
):
    """(b) The previous life's upload is accepted into a round of three contributions whose
    direction check leaves it out (the two others point the other way); the learner dies.
    Restored, it took the acceptance as a merge: 6 steps counted merged that never reached
    the model. They are left out (excluded), as the syncer's commit log says."""
    server = local_syncer(
        make_model(),
        config(wait_for_all=3),
        num_fragments=P,
        tape_path=tmp_path / "events.jsonl",
    )
    peers = [Peer(server, name) for name in ("x", "y")]
    first = restored = None
    try:
        for peer in peers:
            peer.join()
        first, state, trained, delta = previous_life(tmp_path, server.address)
        for n, peer in enumerate(peers):
            assert peer.upload(0, -delta, steps=4, base=0, upload_id=900 + n).accepted
        wait_until(lambda: rounds(tmp_path), 20, "the round's record")
        (record,) = rounds(tmp_path)
        assert list(record["excluded_uploads"]) == ["me"], record
        first.close(flush=False)

        restored = restored_life(tmp_path, state, trained, server.address)
        restored.wait_for_global(timeout=30)
        wait_until(
            lambda: restored.apply_arrived() is not None and restored.excluded_steps[0] > 0,
            10,
            "the restored learner to count the left-out progress",
        )
        assert restored.merged_steps[0] == 0
        assert restored.excluded_steps[0] == CHECKPOINT_STEP
        assert restored.steps_since[0] == 0  # not sent again: the syncer had it
        assert restored.accounting().balanced()
    finally:
        for learner in (first, restored):
            if learner is not None:
                learner.close(flush=False)
        for peer in peers:
            peer.close()
        server.stop()


@pytest.mark.timeout(150)
def test_an_upload_in_an_open_round_is_in_flight_after_a_restore_and_sent_again_if_it_dies(
    tmp_path,
):
    """The previous life's upload sits accepted in an open round (the syncer waits for two
    learners) when the learner dies; the restored learner joins that same live syncer,
    which lists the upload among those it holds. It took "held" as merged: 6 steps counted
    merged, fragment 0 put back at its anchor. Then the syncer is SIGKILLed before the
    round commits: no commit ever merged those steps, and nothing sent them again. They
    are in flight instead: the successor's join returns them, they are sent again and
    merged exactly once (the audit is clean)."""
    state_dir, tape = tmp_path / "state", tmp_path / "events.jsonl"
    script = tmp_path / "syncer.py"
    fields = {**FIELDS, "wait_for_all": 2}
    script.write_text(CHILD.format(tests=str(Path(__file__).parent), fields=fields, P=P))
    port_file = tmp_path / "port"
    child = subprocess.Popen(
        [sys.executable, str(script), str(state_dir), str(tape), str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    first = successor = restored = None
    try:
        wait_until(port_file.is_file, 60, "the child syncer's port", alive=child)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        first, state, trained, _ = previous_life(tmp_path, address)
        first.close(flush=False)  # (its upload stays in the open round)

        restored = restored_life(tmp_path, state, trained, address)
        restored.wait_for_global(timeout=30)
        # The previous life's upload carried the checkpoint's 6 steps of fragment 0 and 2
        # more: those 2 are not trained again. The 6 are neither merged nor undelivered.
        assert restored.ahead_on_restore == UPLOAD_STEP - CHECKPOINT_STEP
        restored.skip(restored.ahead_on_restore, tokens=20)
        assert restored.merged_steps == [0, 0], "an open round's upload counted merged"
        assert restored.accounting().in_flight == (CHECKPOINT_STEP, 0)
        assert not rounds(tmp_path)  # the round is still open

        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
        successor = local_syncer(
            make_model(),
            config(),
            num_fragments=P,
            state_dir=state_dir,
            tape_path=tape,
            bind=address,
        )
        successor_id = successor.state.syncer_id
        wait_until(
            lambda: (
                restored.apply_arrived() is not None
                and restored.progress.syncer_ids.get(address) == successor_id
            ),
            30,
            "the restored learner to rejoin the successor",
        )
        # The round died with the syncer: fragment 0's 6 steps are undelivered again.
        assert restored.merged_steps == [0, 0]
        assert restored.steps_since == [CHECKPOINT_STEP, CHECKPOINT_STEP]
        assert torch.equal(restored.layout.gather(0, restored.params), trained[0])
        for p in range(P):
            assert restored._queue(p)
        wait_until(lambda: successor.state.versions == [1, 1], 20, "both fragments merged")
        wait_until(
            lambda: restored.apply_arrived() is not None and not list(restored._ledger.items()),
            20,
            "the merges to come back",
        )
        books = restored.accounting()
        assert books.merged == (CHECKPOINT_STEP, CHECKPOINT_STEP) and books.balanced()
        restored.close()
        assert audit_of(tmp_path, restored) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=30)
        for learner in (first, restored):
            if learner is not None:
                learner.close(flush=False)
        if successor is not None:
            successor.stop()


@pytest.mark.timeout(120)
def test_an_upload_in_an_open_round_that_commits_after_the_restore_is_merged_once(tmp_path):
    """As above, but the syncer lives: another learner's contribution closes the round after
    the restored learner joined. The upload kept in flight is counted merged when the
    version that merges it arrives, its progress not sent again (the audit is clean)."""
    server = local_syncer(
        make_model(), config(wait_for_all=2), num_fragments=P, tape_path=tmp_path / "events.jsonl"
    )
    other = Peer(server, "x")
    first = restored = None
    try:
        other.join()
        first, state, trained, delta = previous_life(tmp_path, server.address)
        first.close(flush=False)
        restored = restored_life(tmp_path, state, trained, server.address)
        restored.wait_for_global(timeout=30)
        restored.skip(restored.ahead_on_restore, tokens=20)
        assert restored.merged_steps == [0, 0]
        assert restored.accounting().in_flight == (CHECKPOINT_STEP, 0)

        assert other.upload(0, delta, steps=4, base=0, upload_id=900).accepted
        wait_until(
            lambda: restored.apply_arrived() is not None and restored.merged_steps[0] > 0,
            20,
            "the commit to merge the upload kept in flight",
        )
        books = restored.accounting()
        assert books.merged == (CHECKPOINT_STEP, 0) and books.in_flight == (0, 0)
        assert restored.steps_since == [0, CHECKPOINT_STEP] and books.balanced()
        restored.close(flush=False)
        assert audit_of(tmp_path, restored) == []
    finally:
        for learner in (first, restored):
            if learner is not None:
                learner.close(flush=False)
        other.close()
        server.stop()


@pytest.mark.timeout(150)
def test_an_upload_left_out_before_more_than_the_reported_drops_is_excluded_on_restore(
    tmp_path,
):
    """The previous life's upload is left out of its round's merge (the two others point
    the other way); then more than ``REPORTED_DROPS`` newer uploads of the same learner id
    are left out too, and the syncer restarts, before the restored learner joins. The
    successor's heartbeat note names only the most recent ones (and its subscription
    nothing from before it started): the restored learner was never told, and its 6 steps
    stayed merged. The join reply says which of the uploads it holds were left out."""
    state_dir, tape = tmp_path / "state", tmp_path / "events.jsonl"
    server = local_syncer(
        make_model(), config(wait_for_all=3), num_fragments=P, state_dir=state_dir, tape_path=tape
    )
    peers = [Peer(server, name) for name in ("x", "y")]
    me = Peer(server, "me")
    first = restored = successor = None
    try:
        for peer in peers:
            peer.join()
        first, state, trained, delta = previous_life(tmp_path, server.address)
        for n, peer in enumerate(peers):
            assert peer.upload(0, -delta, steps=4, base=0, upload_id=900 + n).accepted
        wait_until(lambda: rounds(tmp_path), 20, "the round's record")
        first.close(flush=False)

        # More than REPORTED_DROPS uploads of "me" left out after it (fragment 1's rounds).
        me.join()
        numel = server.layout.fragments[1].numel
        for n in range(REPORTED_DROPS + 1):
            base = server.state.versions[1]
            assert me.upload(1, torch.full((numel,), 1e-3), steps=1, upload_id=5000 + n).accepted
            for k, peer in enumerate(peers):
                down = torch.full((numel,), -1e-3)
                reply = peer.upload(1, down, steps=1, base=base, upload_id=6000 + 2 * n + k)
                assert reply.accepted
            wait_until(lambda b=base: server.state.versions[1] == b + 1, 20, "the round")
        wait_until(
            lambda: (
                len([r for r in rounds(tmp_path) if "me" in r["excluded_uploads"]])
                == REPORTED_DROPS + 2
            ),
            20,
            "every round to leave out the upload of me",
        )
        me.leave()
        for peer in (*peers, me):
            peer.close()
        server.stop()  # (a restart: the successor's subscriptions know no earlier notes)
        successor = local_syncer(
            make_model(), config(), num_fragments=P, state_dir=state_dir, tape_path=tape
        )

        restored = restored_life(tmp_path, state, trained, successor.address)
        restored.wait_for_global(timeout=30)
        wait_until(
            lambda: restored.apply_arrived() is not None and restored.excluded_steps[0] > 0,
            10,
            "the restored learner to count the left-out progress",
        )
        assert restored.merged_steps[0] == 0
        assert restored.excluded_steps[0] == CHECKPOINT_STEP
        assert restored.steps_since[0] == 0  # not sent again: the syncer had it
        assert restored.accounting().balanced()
    finally:
        for learner in (first, restored):
            if learner is not None:
                learner.close(flush=False)
        for peer in (*peers, me):
            peer.close()
        server.stop()
        if successor is not None:
            successor.stop()

"""A state directory rolled back (issue 46, defect 3): restored from a backup, it holds older
versions than the ones its tape and its learners have seen.

Contract (docs/algorithm.md, "Syncer failures: what a learner may assume"): a syncer whose
tape records versions of its state directory's lineage beyond the ones on disk refuses to
start unless the operator accepts the rollback; then it starts a new lineage (a new random
id, a ``rollback`` record on the tape). A learner that rejoins a syncer of another lineage,
or one behind the versions it holds, settles its accepted deltas of that syncer's
fragments as unknown and takes a keyframe of each, keeping its undelivered progress.

Real servers on loopback with real state directories and tapes; the learner's side also
with the link's reports handed to it directly (as tests/test_learner_apply.py does).
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch
from kit import join_and_upload, join_request, local_syncer, tiny_model, wait_until

import diloco
from diloco.learner.link import UploadResult
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import StateError, read_tape
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.protocol import ProtocolConfig

P = 2


def start_syncer(state_dir, tape, **server_options) -> SyncerServer:
    """A syncer on the learners' schedule: each upload below closes its round at once and
    makes one commit of fragment 0."""
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0)
    return local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=P,
        state_dir=state_dir,
        tape_path=tape,
        **server_options,
    )


def join(server: SyncerServer, learner_id: str = "a") -> tuple[pb_grpc.SyncerStub, pb.JoinReply]:
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.SyncerStub(channel)
    return stub, stub.Join(join_request(server.layout, learner_id), timeout=5)


def upload(server: SyncerServer, upload_id: int, base: int, learner_id: str = "a"):
    """Join and upload a small delta of fragment 0 against version ``base``."""
    return join_and_upload(server, upload_id, learner_id=learner_id, base=base)


def commit(server: SyncerServer, upload_id: int) -> None:
    """One commit of fragment 0 (an upload against its current version), waited for until
    it is broadcast: persisted and on the tape (the state's version moves first)."""
    version = server.state.versions[0]
    assert upload(server, upload_id, version).accepted
    wait_until(lambda: taped(server, version + 1), timeout=10)


def taped(server: SyncerServer, version: int) -> bool:
    """Whether version ``version`` of fragment 0 is on the server's tape, or without a tape
    in its receipt log (both are written after the fragment's file)."""
    if server.tape is not None:
        records = read_tape(server.tape.path)
        return any(
            r["event"] == "round" and r["fragment"] == 0 and r["version"] == version
            for r in records
        )
    logs = [
        json.loads(line)
        for line in server.service.committer.receipt_log.path.read_text().splitlines()[1:]
    ]
    return any(log["fragment"] == 0 and log["version"] == version for log in logs)


def test_a_state_directory_restored_from_a_backup_refuses_to_start_unless_accepted(tmp_path):
    """The issue: restoring a backup, as docs/security.md advised, started the syncer at the
    backup's versions with nothing said; learners ahead of them were refused forever, and
    once the versions moved on, their numbers named other values. The tape (outside the
    state directory) records the versions the directory's lineage reached: a directory
    behind it is refused, with one line naming the fragment, both versions and the flag."""
    state, tape, backup = tmp_path / "state", tmp_path / "events.jsonl", tmp_path / "backup"
    server = start_syncer(state, tape)
    try:
        _, joined = join(server)
        lineage = joined.lineage
        assert len(lineage) == 16 and int(lineage, 16) >= 0
        for upload_id in (1, 2):
            commit(server, upload_id)
        shutil.copytree(state, backup)  # the backup, taken while it runs
        for upload_id in (3, 4):
            commit(server, upload_id)
    finally:
        server.stop()
    shutil.rmtree(state)
    shutil.copytree(backup, state)  # restored
    with pytest.raises(StateError) as refused:
        start_syncer(state, tape)
    message = str(refused.value)
    assert "fragment 0" in message and "version 4" in message and "version 2" in message
    assert "--accept-rollback" in message and "\n" not in message

    rolled = start_syncer(state, tape, accept_rollback=True)
    try:
        assert rolled.state.versions[0] == 2
        _, joined = join(rolled)
        assert joined.lineage != lineage and len(joined.lineage) == 16
        new_lineage = joined.lineage
        commit(rolled, 5)  # version 3 of the new lineage
    finally:
        rolled.stop()
    (rollback,) = [r for r in read_tape(tape) if r["event"] == "rollback"]
    assert rollback["from_lineage"] == lineage and rollback["lineage"] == new_lineage
    assert rollback["fragments"] == [{"fragment": 0, "taped_version": 4, "version": 2}]
    starts = [r for r in read_tape(tape) if r["event"] == "start"]
    assert [s["lineage"] for s in starts] == [lineage, new_lineage]

    again = start_syncer(state, tape)  # the new lineage's own tape is not ahead of it
    try:
        assert again.state.versions[0] == 3
        assert join(again)[1].lineage == new_lineage
    finally:
        again.stop()


def test_a_fresh_state_directory_on_an_old_tape_starts_another_lineage(tmp_path):
    """The check is exact: versions the tape records under another lineage (a state
    directory started over, a syncer without one) are not this directory's."""
    tape = tmp_path / "events.jsonl"
    first = start_syncer(tmp_path / "first", tape)
    try:
        commit(first, 1)
        old = join(first)[1].lineage
    finally:
        first.stop()
    memory = start_syncer(None, tape)  # without a state directory: a lineage per start
    try:
        assert join(memory)[1].lineage not in ("", old)
    finally:
        memory.stop()
    fresh = start_syncer(tmp_path / "fresh", tape)
    try:
        assert fresh.state.versions[0] == 0 and join(fresh)[1].lineage not in ("", old)
    finally:
        fresh.stop()


# ------------------------------------------------------------------ the learner's side


def make_learner():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    # No syncer listens on port 1: the link just retries in the background.
    learner = diloco.Learner(model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me")
    return model, learner


def weight(model):
    return model.weight.detach().reshape(-1).clone()


def train(model, learner, by: float, steps: int) -> None:
    with torch.no_grad():
        model.weight.add_(by)
    learner.steps_since[0] += steps
    learner.tokens_since[0] += steps * 10


def accepted_delta(learner, model, steps: int, admitted: int):
    """Train, queue and have the delta accepted at ``admitted``."""
    train(model, learner, 0.5, steps)
    assert learner._queue(0)
    job = learner.link.withdraw(0)
    learner.listener.on_result(job, UploadResult("accepted", admitted=admitted, sent=job.delta))
    learner.apply_arrived()
    return job


@pytest.mark.parametrize("rejoined", ["another lineage", "behind"])
def test_a_learner_rejoining_a_rolled_back_syncer_forgets_its_accepted_deltas_as_unknown(
    rejoined,
):
    """Held at version 5 of lineage L1, with a delta accepted at 5 (unmerged) and progress
    not yet sent; the syncer comes back at version 2 (of a new lineage, or of L1 restored
    without a tape to tell). The accepted delta is unknown (neither merged nor sent again);
    the learner asks for a keyframe (it holds no version of that syncer any more), applies
    it although its version is lower, and keeps its undelivered progress."""
    model, learner = make_learner()
    try:
        learner.listener.on_rejoin("127.0.0.1:1", "s1", [0], (0,), [], [0], "a" * 16)
        g5 = torch.arange(12.0)
        learner.listener.on_fragment(0, 5, g5, frozenset())
        learner.apply_arrived()
        assert learner.versions[0] == 5
        accepted_delta(learner, model, steps=3, admitted=5)
        train(model, learner, 0.25, steps=2)  # undelivered progress: u = -0.25
        lineage = "b" * 16 if rejoined == "another lineage" else "a" * 16
        learner.listener.on_rejoin("127.0.0.1:1", "s2", [2], (0,), [], [0], lineage)
        assert learner.listener.have_versions() == [-1]  # a keyframe, not deltas from 5
        g2 = torch.arange(12.0) * 2
        learner.listener.on_fragment(0, 2, g2, frozenset())  # the keyframe of version 2
        learner.apply_arrived()
        books = learner.accounting()
        assert books.unknown == (3,) and books.merged == (0,) and books.unsent == (2,)
        assert learner.in_flight() == {}
        assert learner.versions[0] == 2 and torch.equal(learner.anchors[0], g2)
        assert torch.allclose(weight(model), g2 + 0.25)  # the undelivered progress is kept
        assert learner.state_dict()["lineages"] == {"127.0.0.1:1": lineage}
        # it trains on against the new lineage: its next delta is taken against version 2
        assert learner._queue(0)
        job = learner.link.withdraw(0)
        assert job.base_version == 2 and torch.allclose(job.delta, torch.full((12,), -0.25))
    finally:
        learner.close(flush=False)


def test_a_rejoin_of_the_same_lineage_changes_nothing():
    model, learner = make_learner()
    try:
        learner.listener.on_rejoin("127.0.0.1:1", "s1", [0], (0,), [], [0], "a" * 16)
        learner.listener.on_fragment(0, 1, torch.arange(12.0), frozenset())
        learner.apply_arrived()
        job = accepted_delta(learner, model, steps=3, admitted=1)
        learner.listener.on_rejoin("127.0.0.1:1", "s2", [1], (0,), [job.upload_id], [0], "a" * 16)
        learner.apply_arrived()
        assert learner.listener.have_versions() == [1] and learner.in_flight() == {0: 1}
    finally:
        learner.close(flush=False)


def test_a_restored_learner_compares_the_lineage_its_checkpoint_holds():
    model, learner = make_learner()
    try:
        learner.listener.on_rejoin("127.0.0.1:1", "s1", [0], (0,), [], [0], "a" * 16)
        learner.listener.on_fragment(0, 3, torch.arange(12.0), frozenset())
        learner.apply_arrived()
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    restored = diloco.Learner(
        model, syncer="127.0.0.1:1", num_fragments=1, learner_id="me", state=state
    )
    try:
        restored.listener.on_rejoin("127.0.0.1:1", "s2", [7], (0,), [], [0], "c" * 16)
        assert restored.listener.have_versions() == [-1]
    finally:
        restored.close(flush=False)


@pytest.mark.timeout(120)
def test_a_learner_ahead_of_a_rolled_back_syncer_trains_on_against_the_new_lineage(tmp_path):
    """The stall the issue describes, end to end: a real learner holds versions the
    restored syncer no longer has. Before, each of its uploads was refused (its base
    version ahead of the syncer's) and sent again, forever. Now it takes a keyframe, its
    uploads are accepted, the syncer commits past the old versions, and the learner holds
    exactly the syncer's value."""
    state, tape, backup = tmp_path / "state", tmp_path / "events.jsonl", tmp_path / "backup"
    config = SyncerConfig(
        protocol=ProtocolConfig(sync_every=2, num_fragments=1),
        schedule="learner",
        norm_guard_k=0.0,
        down_codec="fp32",
        lease_s=5.0,
        heartbeat_s=0.2,
    )

    def syncer(bind="127.0.0.1:0", **options):
        model = tiny_model(0, (16, 32, 4), tanh=False)
        return local_syncer(model, config, state_dir=state, tape_path=tape, bind=bind, **options)

    def train_until(condition, timeout=30.0) -> None:
        def one_step() -> bool:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            learner.step(tokens=8)
            return condition()

        wait_until(one_step, timeout, interval=0.01)

    def settled() -> bool:
        learner.apply_arrived()
        with server.service.lock:
            quiet = not server.state.rounds and server.service.committer.waiting() == 0
            same = learner.versions[0] == server.state.versions[0]
        return quiet and same and learner.in_flight() == {}

    server = syncer()
    model = tiny_model(0, (16, 32, 4), tanh=False)
    learner = diloco.Learner(model, syncer=server.address, num_fragments=1, learner_id="l0")
    try:
        assert learner.wait_for_global(timeout=20)
        train_until(lambda: server.state.versions[0] >= 2)
        shutil.copytree(state, backup)
        train_until(lambda: learner.versions[0] >= 6)
        address, ahead = server.address, learner.versions[0]
        server.stop(grace=0)
        shutil.rmtree(state)
        shutil.copytree(backup, state)
        server = syncer(bind=address, accept_rollback=True)
        restored = server.state.versions[0]
        assert restored < ahead
        refused_before = learner.link.stats.uploads_refused
        train_until(lambda: server.state.versions[0] > ahead + 2)
        assert learner.link.stats.uploads_refused - refused_before <= 2
        wait_until(settled, 10, "the learner holds the syncer's last version")
        with server.service.lock:
            value = server.state.params[0].clone()
        assert torch.allclose(learner.anchors[0], value, rtol=0, atol=1e-6)  # (fp32 sums)
        rounds = [r for r in read_tape(tape) if r["event"] == "round"]
        assert [r for r in rounds if r["version"] > ahead and "l0" in r["participants"]]
    finally:
        learner.close(flush=False)
        server.stop(grace=0)


def test_fragment_files_rolled_back_under_their_receipts_are_a_rollback_too(tmp_path):
    """No tape to tell, but the receipt log (not restored) holds commits above the restored
    fragment files: refused with the flag named; accepted, the logs above the files are let
    go and the directory starts a new lineage."""
    state, backup = tmp_path / "state", tmp_path / "backup"
    server = start_syncer(state, None)
    try:
        lineage = join(server)[1].lineage
        commit(server, 1)
        shutil.copytree(state / "fragments", backup)
        commit(server, 2)
    finally:
        server.stop()
    shutil.rmtree(state / "fragments")
    shutil.copytree(backup, state / "fragments")
    with pytest.raises(StateError, match="rolled back under their receipts.*--accept-rollback"):
        start_syncer(state, None)
    rolled = start_syncer(state, None, accept_rollback=True)
    try:
        assert rolled.state.versions[0] == 1
        assert join(rolled)[1].lineage not in ("", lineage)
        commit(rolled, 3)
    finally:
        rolled.stop()
    start_syncer(state, None).stop()  # its receipts agree with its files again

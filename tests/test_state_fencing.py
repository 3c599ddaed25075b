"""One syncer per state directory (issue 46, defect 2): a second syncer on a directory in use
refuses to start; a syncer superseded by another one (its lock not honoured) fails at its
next commit and writes nothing; a syncer stopped or SIGKILLed leaves the directory to the
next. And two neighbours: snapshots and exports of a state directory.

Real servers on loopback, real ``diloco syncer`` processes; a raw client sends uploads so
that each commit is one test step.
"""

from __future__ import annotations

import json
import os
import signal

import grpc
import pytest
import torch
from kit import join_and_upload, local_syncer, start_diloco, tiny_model, wait_until
from safetensors import safe_open
from safetensors.torch import load_file

from diloco.launch.syncer_process import Snapshots
from diloco.syncer.config import SyncerConfig
from diloco.syncer.export import ExportError, read_state_dirs, save_state_dict
from diloco.syncer.fencing import LOCK_FILE, Superseded, claim_state_dir
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import FragmentStore, StateError, read_tape
from diloco.wire.protocol import ProtocolConfig

P = 2


def start_syncer(state_dir, **options) -> SyncerServer:
    """A syncer on the learners' schedule: each upload below closes its round at once and
    makes one commit."""
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0)
    return local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=P,
        state_dir=state_dir,
        **options,
    )


def version_on_disk(state_dir, layout) -> int:
    loaded = FragmentStore(state_dir).load(0, layout.fragments[0].numel)
    return loaded[0] if loaded is not None else 0


def contents(state_dir) -> dict[str, bytes]:
    """Every file of a state directory but the tape, by relative path."""
    return {
        str(path.relative_to(state_dir)): path.read_bytes()
        for path in sorted(state_dir.rglob("*"))
        if path.is_file() and path.name != "events.jsonl"
    }


def test_a_second_syncer_on_a_state_directory_in_use_refuses_to_start(tmp_path):
    """Two syncers on one directory used to run side by side, the last writer winning."""
    state = tmp_path / "state"
    first = start_syncer(state)
    try:
        assert join_and_upload(first, 1).accepted
        wait_until(lambda: version_on_disk(state, first.layout) == 1, timeout=60)
        before = contents(state)
        with pytest.raises(StateError, match="in use by another syncer") as refused:
            start_syncer(state)
        assert str(state) in str(refused.value) and f"pid {os.getpid()}" in str(refused.value)
        assert contents(state) == before  # the refused one wrote nothing, not even an epoch
        assert join_and_upload(first, 2, base=1).accepted  # the first goes on committing
        wait_until(lambda: version_on_disk(state, first.layout) == 2, timeout=60)
        assert first.failure is None
    finally:
        first.stop()
    second = start_syncer(state)  # stopped: the directory is free again
    try:
        assert second.state.versions[0] == 2 and second.claim.epoch == 2
    finally:
        second.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_syncer_process_refuses_and_a_sigkilled_ones_successor_starts(tmp_path):
    """``diloco syncer`` on a directory in use exits 2 with one line naming it; the lock
    dies with a SIGKILLed syncer, so its restart starts at once."""
    state = tmp_path / "state"

    def syncer(name: str):
        return start_diloco(
            "syncer",
            "--recipe=tiny",
            "--bind=127.0.0.1:0",
            f"--state-dir={state}",
            f"--port-file={tmp_path / name}",
        )

    def wait_serving(proc, name: str) -> None:
        wait_until(lambda: (tmp_path / name).is_file(), 60, "the port file", alive=proc)

    first = syncer("first")
    procs = [first]
    try:
        wait_serving(first, "first")
        second = syncer("second")
        procs.append(second)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        (line,) = err.strip().splitlines()
        assert line.startswith("diloco syncer: ") and "in use by another syncer" in line
        assert str(state) in line and f"pid {first.pid}" in line
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        third = syncer("third")
        procs.append(third)
        wait_serving(third, "third")
        starts = [r for r in read_tape(state / "events.jsonl") if r["event"] == "start"]
        assert [r["epoch"] for r in starts] == [1, 2]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)


def test_a_superseded_syncer_fails_at_its_next_commit_and_writes_nothing(tmp_path):
    """A lock that is not honoured (a network filesystem, a lock file deleted): a successor
    claims the directory beside a syncer still running. The old one used to go on
    committing over the successor's files, with the same version numbers."""
    state, tape = tmp_path / "state", tmp_path / "state" / "events.jsonl"
    old = start_syncer(state, tape_path=tape)
    new = None
    try:
        assert join_and_upload(old, 1).accepted
        wait_until(lambda: version_on_disk(state, old.layout) == 1, timeout=60)
        # its commit is over when it is taped (after its receipt line): only then is the
        # successor started, else the old one's receipt append meets the new epoch
        wait_until(
            lambda: any(r["event"] == "round" for r in read_tape(tape)) if tape.exists() else False,
            timeout=60,
        )
        (state / LOCK_FILE).unlink(missing_ok=True)  # the lock is not honoured
        new = start_syncer(state, tape_path=tape)
        before = contents(state)
        assert join_and_upload(old, 2, base=1).accepted  # admitted in memory: its commit is refused
        wait_until(lambda: old.failure is not None, timeout=60)
        assert isinstance(old.failure, Superseded)
        assert (old.claim.epoch, new.claim.epoch) == (1, 2)
        assert "claimed by another syncer (epoch 2" in str(old.failure)
        assert contents(state) == before  # nothing of it on disk, no temporary file
        with pytest.raises(grpc.RpcError) as refused:
            join_and_upload(old, 3, base=1)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # the successor's version 2 is its own, and the tape has only its round for it
        assert join_and_upload(new, 4, learner_id="b", base=1).accepted
        wait_until(lambda: version_on_disk(state, new.layout) == 2, timeout=60)

        def rounds_of_fragment_0() -> list[dict]:
            return [r for r in read_tape(tape) if r["event"] == "round" and r["fragment"] == 0]

        # its round record is taped just after the fragment file lands: wait for it
        wait_until(lambda: any(r["version"] == 2 for r in rounds_of_fragment_0()), timeout=60)
        rounds = rounds_of_fragment_0()
        assert [(r["version"], r["participants"]) for r in rounds] == [(1, ["a"]), (2, ["b"])]
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_a_successor_claiming_between_the_check_and_the_rename_keeps_the_commit_unsent(
    tmp_path, monkeypatch
):
    """The residual window of a lock not honoured: a successor claims the directory after
    the old syncer's check and before its rename. That one commit lands, but the check after
    the rename fails the syncer before the commit is taped or broadcast."""
    state, tape = tmp_path / "state", tmp_path / "events.jsonl"
    old = start_syncer(state, tape_path=tape)
    real_replace, successor = os.replace, []

    def replace_after_a_successor_claimed(src, dst):
        if str(dst).endswith("p000.safetensors") and not successor:
            (state / LOCK_FILE).unlink(missing_ok=True)
            successor.append(claim_state_dir(state))
        return real_replace(src, dst)

    try:
        monkeypatch.setattr(os, "replace", replace_after_a_successor_claimed)
        assert join_and_upload(old, 1).accepted
        wait_until(lambda: old.failure is not None, timeout=60)
        assert isinstance(old.failure, Superseded)
        assert version_on_disk(state, old.layout) == 1  # it landed ...
        assert not [r for r in read_tape(tape) if r["event"] == "round"]  # ... and went no further
    finally:
        old.stop()
        for claim in successor:
            claim.release()


def test_the_epoch_rises_at_every_start_and_a_corrupt_epoch_file_is_a_clear_error(tmp_path):
    state = tmp_path / "state"
    for epoch in (1, 2, 3):
        server = start_syncer(state)
        on_disk = json.loads((state / "epoch").read_text())
        assert server.claim.epoch == on_disk["epoch"] == epoch
        server.stop()
    (state / "epoch").write_text("{not json")
    with pytest.raises(StateError, match="epoch is unreadable"):
        start_syncer(state)
    (state / "epoch").unlink()
    start_syncer(state).stop()  # (the refused start released its lock)


# ------------------------------------------------------------------ snapshots and exports


class CommitsDuringExport(torch.nn.Module):
    """The syncer's model whose ``state_dict`` (taken by a snapshot after it copied the
    parameters) lets a commit land first, as the committer may at that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_model(0, (16, 32, 4), tanh=False)
        self.during = None

    def state_dict(self, *args, **kwargs):
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return super().state_dict(*args, **kwargs)


def test_a_snapshot_holds_the_versions_of_the_values_it_holds(tmp_path):
    """Found by review: a snapshot copied the parameters under the lock and read the
    versions after, outside it: a commit in between labelled old values with new versions."""
    model = CommitsDuringExport()
    server = SyncerServer.for_model(
        model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=P))
    )
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    def commit() -> None:  # stands for a commit of fragment 0
        with server.service.lock:
            server.state.params[0].add_(1.0)
            server.state.versions[0] += 1

    model.during = commit
    try:
        Snapshots(str(tmp_path / "global.safetensors"), 0, server, model).write()
    finally:
        server.stop()
    with safe_open(str(tmp_path / "global.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["versions"]) == [0, 0]
    written = load_file(str(tmp_path / "global.safetensors"))
    assert all(torch.equal(written[k], initial[k]) for k in initial)


def test_a_snapshot_is_synced_before_its_rename_and_its_directory_after(tmp_path, disk_events):
    events = disk_events
    path = tmp_path / "global.safetensors"
    save_state_dict({"w": torch.ones(3)}, path, versions=[1])
    tmp = str(path) + ".tmp"
    renamed = events.index(("replace", tmp))
    assert ("fsync", tmp) in events[:renamed]
    assert ("fsync", str(tmp_path)) in events[renamed:]
    assert torch.equal(load_file(str(path))["w"], torch.ones(3))


def test_an_export_of_shards_refuses_a_missing_shard_directory(tmp_path):
    """Found by review: ``read_state_dirs`` skipped a shard's missing directory, so its
    fragments were exported at their initial values as if the run had never moved them."""
    model = tiny_model(0, (16, 32, 4), tanh=False)
    shard0 = tmp_path / "syncer-0"
    server = local_syncer(
        model,
        SyncerConfig(schedule="learner", norm_guard_k=0.0),
        num_fragments=P,
        state_dir=shard0,
        shard=(0, 2),
    )
    server.stop()
    initial = [t.clone() for t in server.state.params]
    with pytest.raises(ExportError, match="syncer-1"):
        read_state_dirs([shard0, tmp_path / "syncer-1"], server.layout, initial)
    params, versions = read_state_dirs([shard0], server.layout, initial)  # one that exists
    assert versions == [0, 0]

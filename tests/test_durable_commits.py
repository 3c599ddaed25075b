"""Durability at the cost of the exchange: a commit is made by its commit journal record (the
admitted uploads as they arrived), full snapshots are written in the background, and
recovery (the last snapshot plus the journal's records after it, replayed) gives Θ_p, the
outer momentum and the wire image bit for bit."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until

from diloco.syncer import journal
from diloco.syncer.config import SyncerConfig
from diloco.syncer.journal import SUFFIX
from diloco.syncer.server import SyncerServer
from diloco.syncer.snapshot_interval import MIN_RECORDS
from diloco.syncer.store import FragmentStore, StateError
from diloco.wire import diloco_pb2 as pb

P = 2
LEARNERS = ("a", "b", "c", "d")
SIZES = (16, 32, 4)


def config(**fields) -> SyncerConfig:
    """Synchronous rounds of every learner (their weights and share follow from the uploads
    alone), the norm guard off, leases long enough for a slow machine."""
    base = {
        "schedule": "learner",
        "wait_for_all": len(LEARNERS),
        "norm_guard_k": 0.0,
        "lease_s": 120.0,
        "up_codec": "sign1",
        "down_codec": "int8",
    }
    return SyncerConfig(**{**base, **fields})


def delta_of(round_: int, learner: str, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * round_ + LEARNERS.index(learner))
    return torch.randn(numel, generator=generator) * 1e-2


def held(server: SyncerServer, fragment: int):
    """``(Θ_p, momentum, W_p)`` a running syncer holds."""
    momentum = server.state.outer.fragment_state(fragment).get("momentum")
    return server.state.params[fragment].clone(), momentum, server.service.committer.wire(fragment)


def assert_same_bits(got, want, what: str) -> None:
    for name, a, b in zip(("theta", "momentum", "wire"), got, want, strict=True):
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32)), (
                f"{what}: {name} differs"
            )


def feed(server, peers, rounds, versions, *, first_id: int = 0) -> None:
    """Send each round (``(fragment, round number)``) from every learner and wait for its
    commit (``versions``: the versions it expects, advanced here)."""
    numel = [f.numel for f in server.layout.fragments]
    for i, (fragment, number) in enumerate(rounds):
        for peer in peers:
            delta = delta_of(number, peer.learner_id, numel[fragment])
            uid = first_id + 10 * i + LEARNERS.index(peer.learner_id)
            assert peer.upload(fragment, delta, base=versions[fragment], upload_id=uid).accepted
        versions[fragment] += 1
        wait_until(lambda f=fragment: server.state.versions[f] == versions[f], timeout=30)
        wait_until(lambda: published(server), timeout=30)


def published(server) -> bool:
    """Whether every round closed has been committed and published (its wire image moved)."""
    with server.service.lock:
        return server.service.committer.waiting() == 0


@pytest.mark.parametrize(
    "fields", [{}, {"down_codec": "sign1", "down_feedback": False, "up_codec": "int8"}]
)
def test_replaying_the_journal_onto_a_snapshot_gives_the_live_commits_bits(tmp_path, fields):
    """(a) The live commits and their replay run one code path (``diloco.syncer.replay``):
    the state directory read back (first commit's snapshot + every later commit replayed from
    its journal record) holds what the running syncer holds, bit for bit; with a snapshot
    every 3 commits, the background snapshots and the journal after them agree too."""
    for every in (1000, 3):
        state = tmp_path / f"state{every}"
        server = local_syncer(
            tiny_model(0, SIZES, tanh=False),
            config(commits_per_snapshot=every, **fields),
            num_fragments=P,
            state_dir=state,
        )
        peers = [Peer(server, lid) for lid in LEARNERS]
        try:
            for peer in peers:
                peer.join()
            versions = [0] * P
            feed(server, peers, [(r % P, r) for r in range(10)], versions)
            wait_until(server.service.committer.snapshots.idle, timeout=30)
            # the live commits ran on reused buffers (merged deltas, wire images:
            # ``runtime.buffers``), the replay below on fresh ones
            assert server.service.committer.buffers.reused
            for p in range(P):
                version, params, extra = FragmentStore(state).load(p, params_numel(server, p))
                assert version == versions[p] == 5
                loaded = (params, extra.get("momentum"), extra["wire"])
                assert_same_bits(loaded, held(server, p), f"fragment {p}, every {every}")
            journals = sorted(path.name for path in (state / "fragments").glob("*" + SUFFIX))
            # every 3: fragment 0's snapshot at version 4 (commits 2-4 journalled), then one
            # record; fragment 1's first cycle starts a record in: at version 3, then two
            if every == 3:
                assert journals == ["p000.000001.journal", "p001.000001.journal"]
                assert server.service.committer.snapshots.written == P
        finally:
            for peer in peers:
                peer.close()
            server.stop()


@pytest.mark.parametrize("every", [4, 0], ids=["K=4", "by-bytes"])
def test_the_fragments_snapshots_fall_in_different_cycles(tmp_path, every):
    """Committed round-robin, every fragment reaches its snapshot interval in the same cycle
    unless their first cycles start apart: with 4 fragments and a snapshot every 4 commits,
    one fragment is snapshotted per cycle of the clock, never all 4 at once (their copies
    waiting together for the writer, and a restart before them replaying 3 records of each).
    By bytes (the default) these small records make the interval its least, 8 records: a
    snapshot every second cycle, one fragment at a time."""
    fragments = 4
    interval = every or MIN_RECORDS
    server = local_syncer(
        tiny_model(0, (16, 32, 32, 4), tanh=False),
        config(commits_per_snapshot=every),
        num_fragments=fragments,
        state_dir=tmp_path / "state",
    )
    peers = [Peer(server, lid) for lid in LEARNERS]
    snapshots = server.service.committer.snapshots
    try:
        for peer in peers:
            peer.join()
        versions = [0] * fragments
        feed(server, peers, [(p, p) for p in range(fragments)], versions)  # written whole
        per_cycle = []
        for cycle in range(1, 2 * interval + 1):
            before = snapshots.written
            rounds = [(p, cycle * fragments + p) for p in range(fragments)]
            feed(server, peers, rounds, versions, first_id=1000 * cycle)
            wait_until(snapshots.idle, timeout=30)
            per_cycle.append(snapshots.written - before)
        assert max(per_cycle) == 1 and sum(per_cycle) == 2 * fragments, per_cycle
    finally:
        for peer in peers:
            peer.close()
        server.stop()


def test_by_bytes_one_learners_commit_makes_under_4x_what_it_merged_durable(tmp_path):
    """The default interval follows the bytes (``diloco.syncer.snapshot_interval``): one
    learner's sign1 uploads of a 90,300-value fragment make a snapshot due once the records
    past the last one hold 0.4 of a snapshot's bytes, about 30 records here (a fixed 8 would
    make each commit write about 10 × what it merged). A restarted syncer counts the records
    already in the journal, so its snapshot comes where it would have; the state reads back."""
    from diloco.syncer.snapshot_interval import JOURNAL_SHARE, snapshot_bytes

    model = tiny_model(0, (300, 300), tanh=False)  # one fragment: 300 × 300 + 300 values
    numel = sum(t.numel() for t in model.parameters())
    state = tmp_path / "state"
    one = config(wait_for_all=1)
    assert one.commits_per_snapshot == 0  # (the default)
    versions, records = [0], []

    def commit_until(server, done) -> None:
        """One commit at a time, each journal record's bytes kept, until ``done()``."""
        snapshots = server.service.committer.snapshots
        peer = Peer(server, "a")
        peer.join()
        try:
            while not done(snapshots):
                before = server.store.journal.bytes_written
                feed(server, [peer], [(0, versions[0])], versions, first_id=10 * versions[0])
                wait_until(snapshots.idle, timeout=30)
                if versions[0] > 1:  # (the first commit is written whole)
                    records.append(server.store.journal.bytes_written - before)
        finally:
            peer.close()
            server.stop()

    commit_until(
        local_syncer(model, one, num_fragments=1, state_dir=state), lambda _: len(records) == 10
    )
    restarted = local_syncer(model, one, num_fragments=1, state_dir=state)
    assert restarted.store.replayed[0] == 10
    commit_until(restarted, lambda snapshots: snapshots.written)
    full = snapshot_bytes(numel)
    every = len(records)  # records from the first commit's snapshot to the next one's
    assert sum(records[:-1]) < JOURNAL_SHARE * full <= sum(records), (records, full)
    assert 8 < every <= 64
    payload = numel / 8 + 4 * -(-numel // 128)  # sign1: a bit per value, a scale per 128
    durable = (sum(records) + (state / "fragments" / "p000.safetensors").stat().st_size) / every
    assert durable <= 4 * payload, (durable, payload)
    assert FragmentStore(state).load(0, numel)[0] == versions[0]


def params_numel(server, fragment: int) -> int:
    return server.layout.fragments[fragment].numel


def test_a_torn_journal_tail_is_cut_off_and_corruption_before_it_is_an_error(tmp_path):
    """(c) A record cut short by a crash in the middle of its append (its commit was never
    made: no receipt, tape record or broadcast follows it): readers pass over it, the
    restarted syncer cuts it off and serves the version before it. A bad record followed by
    a good one is not a torn tail: ``StateError``."""
    state = tmp_path / "state"
    model = tiny_model(0, SIZES, tanh=False)
    server = local_syncer(model, config(), num_fragments=P, state_dir=state)
    peers = [Peer(server, lid) for lid in LEARNERS]
    try:
        for peer in peers:
            peer.join()
        feed(server, peers, [(0, r) for r in range(2)], [0] * P)  # snapshot v1, record v2
    finally:
        for peer in peers:
            peer.close()
        server.stop()
    numel = params_numel(server, 0)
    (segment,) = (state / "fragments").glob("p000.*" + SUFFIX)
    record = segment.read_bytes()  # version 2's
    for cut in (5, 30, len(record) // 2, len(record) - 1):  # a version 3 torn at `cut` bytes
        segment.write_bytes(record + record[:cut])
        assert FragmentStore(state).load(0, numel)[0] == 2
        assert segment.stat().st_size == len(record) + cut  # a reader changes nothing
        restarted = local_syncer(model, config(), num_fragments=P, state_dir=state)
        try:
            assert restarted.state.versions[0] == 2
        finally:
            restarted.stop()
        # cut off where the torn record began; then the restarted syncer's claim marker
        data = segment.read_bytes()
        assert data[: len(record)] == record
        marker, end = journal.parse(data, len(record))
        assert (marker.epoch, marker.inputs, end) == (restarted.claim.epoch, None, len(data))
    flipped = bytearray(record)
    flipped[40] ^= 0xFF
    segment.write_bytes(bytes(flipped) + record)  # a whole record after the bad one
    with pytest.raises(StateError, match="corrupt at offset 0"):
        FragmentStore(state).load(0, numel)


CHILD = textwrap.dedent(
    """
    import dataclasses, io, os, signal, sys, threading
    sys.path.insert(0, {tests!r})
    from kit import tiny_model
    from diloco.syncer import journal, store
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer

    state_dir, port_file, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    calls = [0]

    def die_after_half(write, fd, data, *rest):
        write(fd, bytes(data)[: len(data) // 2], *rest)
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "append":
        real_write_all = journal.write_all
        def write_all(fd, data, path):
            if b'"marker"' not in bytes(data[:64]):  # (a commit's record, not a claim marker)
                calls[0] += 1
            if calls[0] == n:
                die_after_half(real_write_all, fd, data, path)
            real_write_all(fd, data, path)
        journal.write_all = write_all
    elif mode == "snapshot":
        real_write_snapshot = store.write_snapshot
        def write_snapshot(file, tensors, meta):
            if threading.current_thread().name == "snapshots":
                calls[0] += 1
                if calls[0] == n:
                    whole = io.BytesIO()
                    real_write_snapshot(whole, tensors, meta)
                    die_after_half(lambda f, d: (f.write(d), f.flush()), file, whole.getvalue())
            real_write_snapshot(file, tensors, meta)
        store.write_snapshot = write_snapshot
    elif mode == "drop":
        real_drop = journal.CommitJournal.drop_below
        def drop_below(self, fragment, number):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            real_drop(self, fragment, number)
        journal.CommitJournal.drop_below = drop_below
    config = SyncerConfig(**{config!r})
    protocol = dataclasses.replace(config.protocol, num_fragments={fragments})
    config = dataclasses.replace(config, protocol=protocol)
    server = SyncerServer.for_model(
        tiny_model(0, {sizes!r}, tanh=False), config=config, state_dir=state_dir
    ).start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.port))
    os.replace(port_file + ".tmp", port_file)
    threading.Event().wait()
    """
)


class ChildSyncer:
    """A syncer process on ``state_dir`` that kills itself (``SIGKILL``) at a chosen point."""

    def __init__(self, tmp_path: Path, script: Path, layout, mode: str, n: int) -> None:
        self.port_file = tmp_path / f"port{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / "state"),
                str(self.port_file),
                mode,
                str(n),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_until(self.port_file.is_file, 60, "the port file", alive=self.proc)
        self.address = f"127.0.0.1:{int(self.port_file.read_text())}"
        self.server = SimpleNamespace(layout=layout, address=self.address)
        self.peers = [Peer(self.server, lid) for lid in LEARNERS]
        for peer in self.peers:
            peer.join(timeout=30)

    def versions(self) -> list[int] | None:
        """Its versions, or None once it is gone."""
        try:
            reply = self.peers[0].stub.Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return None
        return list(reply.versions)

    def kill(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=30)


FIELDS = {
    "schedule": "learner",
    "wait_for_all": len(LEARNERS),
    "norm_guard_k": 0.0,
    "lease_s": 120.0,
    "up_codec": "sign1",
    "down_codec": "int8",
    "commits_per_snapshot": 3,
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_syncer_killed_anywhere_recovers_the_bits_of_an_uninterrupted_twin(tmp_path, seed):
    """(b) A real syncer process is killed (SIGKILL) at random points: in the middle of a
    journal append, of a background snapshot's write, between a snapshot's rename and the
    deletion of the journal it holds (by hooks in the process), and in the middle of a round
    (by the test). Each time it is restarted on its directory and the round it had not
    committed is sent again. At the end, the syncer restarted once more holds Θ_p, momentum
    and wire image bit for bit as an uninterrupted in-process twin fed the same rounds in
    the order they were committed."""
    rng = random.Random(seed)
    model = tiny_model(0, SIZES, tanh=False)
    script = tmp_path / "child.py"
    tests_dir = str(Path(__file__).parent)
    script.write_text(CHILD.format(tests=tests_dir, config=FIELDS, sizes=SIZES, fragments=P))
    twin = local_syncer(model, SyncerConfig(**FIELDS), num_fragments=P)
    layout = twin.layout
    numel = [layout.fragments[p].numel for p in range(P)]
    rounds = [(r % P, r) for r in range(36)]
    kills = [
        ("append", rng.randint(1, 16)),
        ("snapshot", 1),
        ("drop", 1),
        ("round", rng.randint(0, 2)),
    ]
    rng.shuffle(kills)
    committed: list[tuple[int, int]] = []
    versions = [0] * P
    deaths, i, uid, child = 0, 0, 0, None
    try:
        for mode, n in kills:
            child = ChildSyncer(tmp_path, script, layout, "none" if mode == "round" else mode, n)
            assert child.versions() == versions
            for sent in range(len(rounds) - i):
                fragment, number = rounds[i]
                try:
                    for peer in child.peers:
                        uid += 1
                        delta = delta_of(number, peer.learner_id, numel[fragment])
                        peer.upload(fragment, delta, base=versions[fragment], upload_id=uid)
                        if mode == "round" and sent == n:  # one upload of the round admitted
                            child.proc.send_signal(signal.SIGKILL)
                            break
                    wait_until(
                        lambda f=fragment, c=child: (
                            (v := c.versions()) is None or v[f] > versions[f]
                        ),
                        timeout=60,
                    )
                except grpc.RpcError:
                    pass
                if child.versions() is None:
                    break
                versions[fragment] += 1
                committed.append(rounds[i])
                i += 1
            assert child.proc.wait(timeout=60) == -signal.SIGKILL
            deaths += 1
            child.kill()
            child = ChildSyncer(tmp_path, script, layout, "none", 0)
            now = child.versions()
            # (a version the syncer showed may have been applied and not yet made durable)
            while committed and now[committed[-1][0]] < versions[committed[-1][0]]:
                versions[committed.pop()[0]] -= 1
                i -= 1
            if now[rounds[i][0]] > versions[rounds[i][0]]:
                versions[rounds[i][0]] += 1  # its journal record was made before the kill
                committed.append(rounds[i])
                i += 1
            assert now == versions, (now, versions)
            child.kill()
            child = None
        assert deaths == len(kills) and i >= 4
        peers = [Peer(twin, lid) for lid in LEARNERS]
        for peer in peers:
            peer.join()
        feed(twin, peers, committed, [0] * P)
        for peer in peers:
            peer.close()
        restarted = local_syncer(
            model, SyncerConfig(**FIELDS), num_fragments=P, state_dir=tmp_path / "state"
        )
        try:
            assert restarted.state.versions == versions
            for p in range(P):
                assert_same_bits(held(restarted, p), held(twin, p), f"fragment {p}")
        finally:
            restarted.stop()
    finally:
        if child is not None:
            child.kill()
        twin.stop()

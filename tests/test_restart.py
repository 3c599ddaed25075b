"""A syncer's restart: its fragments restored in parallel, each snapshot read once (checked as
it is read), no initial value made for a restored fragment, the time of each phase logged;
the state it restores is bit for bit what it held, and a damaged file is refused as before."""

from __future__ import annotations

import json
import logging
import struct
import threading

import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until
from safetensors.torch import load_file, save, save_file

from diloco.algorithm import balanced_fragments
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.snapshot_file import read_snapshot, tensor_digest, write_snapshot
from diloco.syncer.store import FragmentStore, StateError

P = 3
LEARNERS = ("a", "b")


def layout_and_params():
    model = tiny_model(0, (8, 16, 8, 2), tanh=False)
    layout = balanced_fragments(model.named_parameters(), P)
    named = dict(model.named_parameters())
    return layout, [layout.gather(p, named) for p in range(P)]


def saved_state(tmp_path, fragments=(0, 1)):
    """A state directory whose ``fragments`` have a snapshot (version 2 + p)."""
    layout, params = layout_and_params()
    store = FragmentStore(tmp_path / "state")
    store.initialize(layout, {})
    for p in fragments:
        value = params[p] + 1
        store.save(p, 2 + p, value, {"momentum": value / 2}, wire=value + 0.5)
    return store, layout, params


class Watched(list):
    """The initial values, noting which fragments' the syncer asks for."""

    def __init__(self, values):
        super().__init__(values)
        self.asked: set[int] = set()

    def __getitem__(self, p):
        self.asked.add(p)
        return super().__getitem__(p)

    def __iter__(self):
        for p in range(len(self)):
            yield self[p]


def test_a_restart_makes_no_initial_value_for_a_restored_fragment(tmp_path):
    store, layout, params = saved_state(tmp_path)
    initial = Watched(params)
    server = SyncerServer(layout, initial, SyncerConfig(), state_dir=store.root)
    try:
        assert initial.asked == {2}  # (only the fragment never committed starts from it)
        assert server.state.versions == [2, 3, 0]
        assert torch.equal(server.state.params[1], params[1] + 1)
        assert torch.equal(server.service.committer.wire(0), params[0] + 1 + 0.5)
    finally:
        server.stop()


def test_fragments_are_restored_in_parallel_and_the_first_corrupt_one_is_named(
    tmp_path, monkeypatch
):
    store, layout, params = saved_state(tmp_path, fragments=(0, 1, 2))
    monkeypatch.setattr("diloco.syncer.server.restore_threads", lambda n: 2, raising=False)
    both = threading.Barrier(2, timeout=20)
    load = FragmentStore.load

    def load_beside_another(self, fragment, numel):
        if fragment < 2:
            both.wait()  # (one restore at a time never gets past this)
        return load(self, fragment, numel)

    monkeypatch.setattr(FragmentStore, "load", load_beside_another)
    SyncerServer(layout, params, SyncerConfig(), state_dir=store.root).stop()
    both.reset()
    for p in (1, 2):  # two corrupt files: the error names the first, as one by one
        data = bytearray(store.path(p).read_bytes())
        data[-1] ^= 0x01
        store.path(p).write_bytes(bytes(data))
    with pytest.raises(StateError, match=r"p001\.safetensors is corrupt: checksum mismatch"):
        SyncerServer(layout, params, SyncerConfig(), state_dir=store.root)


def test_after_a_corrupt_fragment_the_fragments_not_begun_are_not_begun(tmp_path, monkeypatch):
    store, layout, params = saved_state(tmp_path, fragments=(0, 1, 2))
    monkeypatch.setattr("diloco.syncer.server.restore_threads", lambda n: 2, raising=False)
    data = bytearray(store.path(1).read_bytes())
    data[-1] ^= 0x01
    store.path(1).write_bytes(bytes(data))
    one_failed, begun = threading.Event(), []
    load = FragmentStore.load

    def load_noting(self, fragment, numel):
        begun.append(fragment)
        if fragment == 0:  # (still restoring while fragment 1 fails on the other thread)
            assert one_failed.wait(20)
        try:
            return load(self, fragment, numel)
        finally:
            if fragment == 1:
                one_failed.set()

    monkeypatch.setattr(FragmentStore, "load", load_noting)
    with pytest.raises(StateError, match=r"p001\.safetensors is corrupt"):
        SyncerServer(layout, params, SyncerConfig(), state_dir=store.root)
    assert sorted(begun) == [0, 1]


def commits(server: SyncerServer, rounds: int) -> None:
    """``rounds`` commits, over the fragments in turn, of both learners' uploads."""
    peers = [Peer(server, lid) for lid in LEARNERS]
    try:
        for peer in peers:
            peer.join()
        for r in range(rounds):
            p, version = r % P, server.state.versions[r % P]
            numel = server.layout.fragments[p].numel
            for i, peer in enumerate(peers):
                delta = torch.randn(numel, generator=torch.Generator().manual_seed(10 * r + i))
                assert peer.upload(p, delta * 1e-2, base=version, upload_id=10 * r + i).accepted
            wait_until(lambda p=p, v=version: server.state.versions[p] == v + 1, timeout=30)
    finally:
        for peer in peers:
            peer.close()


def test_a_restart_logs_where_its_time_went_and_restores_the_same_bits(tmp_path, caplog):
    config = SyncerConfig(
        schedule="learner",
        wait_for_all=len(LEARNERS),
        norm_guard_k=0.0,
        lease_s=120.0,
        commits_per_snapshot=1000,  # (every commit after a fragment's first is journalled)
    )
    model = tiny_model(0, (8, 16, 8, 2), tanh=False)
    state = tmp_path / "state"
    server = local_syncer(model, config, num_fragments=P, state_dir=state)
    try:
        commits(server, 3 * P)
        wait_until(lambda: server.service.committer.waiting() == 0, timeout=30)
        held = [t.clone() for t in server.state.params]
        wires = [server.service.committer.wire(p).clone() for p in range(P)]
    finally:
        server.stop()
    with caplog.at_level(logging.INFO, logger="diloco.syncer.server"):
        again = local_syncer(model, config, num_fragments=P, state_dir=state, start=False)
    try:
        for p in range(P):
            assert torch.equal(again.state.params[p].view(torch.int32), held[p].view(torch.int32))
            assert torch.equal(again.service.committer.wire(p), wires[p])
        times = again.restart_times.summary()
        assert times["fragments"] == P and times["replayed"] == 2 * P == sum(
            again.store.replayed.values()
        )
        assert times["read_s"] > 0 and times["checksum_s"] > 0 and times["replay_s"] > 0
        assert 0 < times["restore_s"] <= times["total_s"]
        [line] = [r.getMessage() for r in caplog.records if "started in" in r.getMessage()]
        assert f"restore of {P} fragments on " in line and f"({2 * P} records)" in line
        for name in ("claim", "tape", "restore", "state", "start", "read", "checksum", "replay"):
            assert f"{name} " in line
    finally:
        again.stop()


def test_the_one_pass_reader_gives_the_digest_and_tensors_safetensors_gives(tmp_path):
    store, _, _ = saved_state(tmp_path)
    read = read_snapshot(store.path(1))
    loaded = load_file(str(store.path(1)))
    assert read.tensor_digest == tensor_digest(loaded)
    assert sorted(read.tensors) == ["momentum", "params", "wire"]
    for name, tensor in loaded.items():
        assert torch.equal(read.tensors[name], tensor)
    other = tmp_path / "bf16.safetensors"  # (not the store's: read by safetensors' loader)
    tensors = {"b": torch.arange(5, dtype=torch.bfloat16), "a": torch.ones(3)}
    save_file(tensors, str(other), metadata={"k": "v"})
    read = read_snapshot(other)
    assert read.tensor_digest == tensor_digest(tensors) and read.metadata == {"k": "v"}


def rewritten(path, header_change=None, data_change=None) -> None:
    """Rewrite the safetensors file at ``path`` with its header (a dict) or its bytes after
    the header changed."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    if header_change:
        header_change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + (data_change or bytes)(data))


def overlapping(header) -> None:
    first, second = sorted(n for n in header if n != "__metadata__")[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])


def in_utf16(path) -> None:
    """The same header, in UTF-16 (JSON's other encodings are not safetensors')."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + length].decode().encode("utf-16")
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def too_long_a_header(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("names", [("params",), ("params", "wire"), ("momentum", "params", "wire")])
def test_a_snapshot_written_from_its_tensors_is_the_file_safetensors_writes(tmp_path, names):
    """The store writes a snapshot straight from the tensors (no serialised copy of them in
    memory): the bytes safetensors' own writer makes, but for the order of the metadata's
    keys (safetensors' is a hash map's: it changes between calls); safetensors and the one
    pass reader read it back bit for bit."""
    tensors = {n: torch.randn(1000 + i) for i, n in enumerate(names)}
    for meta in ({}, {"fragment": "3", "version": "7", "sha256": "ab" * 32, "commits": "[1]"}):
        path = tmp_path / "p003.safetensors"
        with path.open("wb") as f:
            write_snapshot(f, tensors, meta)
        written, theirs = path.read_bytes(), save(tensors, metadata=meta or None)
        (length,) = struct.unpack("<Q", written[:8])
        assert len(written) == len(theirs) and written[8 + length :] == theirs[8 + length :]
        assert json.loads(written[8 : 8 + length]) == json.loads(theirs[8 : 8 + length])
        if not meta:
            assert written == theirs
        loaded = load_file(path)
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[n], tensors[n]) for n in names)
        snapshot = read_snapshot(path)
        assert snapshot.metadata == meta and snapshot.tensor_digest == tensor_digest(tensors)
    with pytest.raises(ValueError, match="float32"), path.open("wb") as f:
        write_snapshot(f, {"params": torch.zeros(3, dtype=torch.float64)}, {})


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: rewritten(path, data_change=lambda data: data + b"\0" * 8),  # trailing
        lambda path: rewritten(path, data_change=lambda data: data[:-8]),  # cut short
        lambda path: rewritten(path, header_change=overlapping),
        lambda path: rewritten(path, header_change=lambda h: h["params"].update(shape=[1])),
        too_long_a_header,
        lambda path: path.write_bytes(b"\x05\0\0\0\0\0\0\0[1,2]"),  # not an object
        in_utf16,
        lambda path: rewritten(path, header_change=lambda h: h.update(__metadata__=[])),
    ],
)
def test_a_malformed_snapshot_is_refused_as_safetensors_refuses_it(tmp_path, damage):
    store, layout, _ = saved_state(tmp_path)
    damage(store.path(0))
    with pytest.raises(Exception):  # noqa: B017 - (safetensors raises several types)
        load_file(str(store.path(0)))
    with pytest.raises(StateError, match=r"p000\.safetensors is corrupt"):
        store.load(0, layout.fragments[0].numel)


def test_initial_values_of_the_wrong_count_are_refused_before_the_directory_is_claimed(tmp_path):
    store, layout, params = saved_state(tmp_path)
    for wrong in (params[:-1], [*params, params[0]]):
        with pytest.raises(ValueError, match="parameter vectors for 3 fragments"):
            SyncerServer(layout, wrong, SyncerConfig(), state_dir=store.root)
    SyncerServer(layout, params, SyncerConfig(), state_dir=store.root).stop()  # (unclaimed)

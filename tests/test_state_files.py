"""State files: checksummed, and a damaged one is a clear error at start, never loaded."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.algorithm import balanced_fragments
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import FragmentStore, StateError


def layout_and_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    layout = balanced_fragments(model.named_parameters(), 2)
    named = dict(model.named_parameters())
    return layout, [layout.gather(p, named) for p in range(2)]


def saved_store(tmp_path):
    layout, params = layout_and_params()
    store = FragmentStore(tmp_path / "state")
    store.initialize(layout, {})
    store.save(0, 3, params[0] + 1, {"momentum": torch.ones_like(params[0])})
    return store, layout, params


def test_round_trip(tmp_path):
    store, layout, params = saved_store(tmp_path)
    version, value, momentum = store.load(0, layout.fragments[0].numel)
    assert version == 3 and torch.equal(value, params[0] + 1)
    assert torch.equal(momentum["momentum"], torch.ones_like(params[0]))
    assert store.load(1, layout.fragments[1].numel) is None


def test_flipped_byte_in_the_values_is_detected(tmp_path):
    store, layout, _ = saved_store(tmp_path)
    path = store.path(0)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match=r"p000\.safetensors is corrupt: checksum mismatch"):
        store.load(0, layout.fragments[0].numel)


def test_rewritten_version_metadata_is_detected(tmp_path):
    store, layout, _ = saved_store(tmp_path)
    path = store.path(0)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(path), metadata={**meta, "version": "4"})
    with pytest.raises(StateError, match="checksum mismatch"):
        store.load(0, layout.fragments[0].numel)


def test_truncated_file_is_detected(tmp_path):
    store, layout, _ = saved_store(tmp_path)
    path = store.path(0)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(StateError, match="is corrupt"):
        store.load(0, layout.fragments[0].numel)


def test_syncer_refuses_to_start_from_a_corrupt_state_dir(tmp_path):
    store, layout, params = saved_store(tmp_path)
    path = store.path(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="p000"):
        SyncerServer(layout, params, SyncerConfig(), state_dir=tmp_path / "state")


def test_a_commit_persisted_but_not_taped_is_recorded_at_restart(tmp_path):
    """A syncer killed between persisting a commit and appending its round record restarts
    with a version the tape never saw: it writes a ``recovered`` record for it, once."""
    import json

    from diloco.syncer.receipts import CommitLog, UploadPart
    from diloco.syncer.state import fragment_digest
    from diloco.syncer.store import Taped, read_tape, taped_versions

    store, layout, params = saved_store(tmp_path)  # fragment 0 persisted at version 3
    tape = tmp_path / "events.jsonl"
    tape.write_text(json.dumps({"event": "round", "t": 1.0, "fragment": 0, "version": 2}) + "\n")
    for _ in range(2):  # the second start finds the tape complete
        server = SyncerServer(
            layout, params, SyncerConfig(), state_dir=tmp_path / "state", tape_path=tape
        )
        server.start().stop()
    records = read_tape(tape)
    (recovered,) = [r for r in records if r["event"] == "recovered"]
    assert (recovered["fragment"], recovered["version"], recovered["taped_version"]) == (0, 3, 2)
    assert recovered["digest"] == fragment_digest(params[0] + 1)
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 2 and records.index(recovered) < records.index(starts[0])
    assert taped_versions(records) == {0: 3}
    # pure: which persisted commit logs the tape holds (a commit by its version, a dropped
    # round, which keeps the version, by the uploads it left out)
    taped = Taped({0: 3}, {(0, 7)})
    assert taped.holds(CommitLog(0, 3, 2)) and not taped.holds(CommitLog(0, 4, 3))
    assert taped.holds(CommitLog(0, 3, 3, {}, {"a": [UploadPart(7, 1, 1)]}))
    assert not taped.holds(CommitLog(0, 3, 3, {}, {"a": [UploadPart(8, 1, 1)]}))

"""Issue 46's hygiene items: what a syncer answers while it stops, what its tape's fsync
failures mean, what a slow stream holds, what a restart reads.

Real syncers on loopback (``kit.local_syncer``) and real files; each test names the hole it
closes.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from kit import Peer, local_syncer, tiny_model, wait_until

from diloco.syncer.config import SyncerConfig
from diloco.syncer.store import FragmentStore

P = 2


def start_syncer(tmp_path, **cfg):
    """A syncer on the learners' schedule with a state directory and a tape: an upload of
    the only learner opens its round, which closes at once (one upload, one commit)."""
    config = SyncerConfig(**{"schedule": "learner", "norm_guard_k": 0.0, "up_codec": "fp32", **cfg})
    return local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=P,
        state_dir=tmp_path / "state",
        tape_path=tmp_path / "events.jsonl",
    )


def on_disk(server, state_dir, fragment: int = 0) -> int:
    """The version of ``fragment`` in the state directory (0: none yet)."""
    loaded = FragmentStore(state_dir).load(fragment, server.layout.fragments[fragment].numel)
    return loaded[0] if loaded is not None else 0


def test_an_upload_arriving_once_stop_began_is_refused_unavailable_not_accepted(tmp_path):
    """Issue 46, item 1: ``stop`` makes the last commits (the final poll) and only then does
    the gRPC server stop taking calls; an upload arriving in between was answered "accepted"
    and was never committed (its learner took it as on its way to a merge and never sent it
    again). Once stopping has begun an upload is refused ``UNAVAILABLE``: its learner's link
    takes that as "no answer" and sends it again, to the successor."""
    server = start_syncer(tmp_path)
    peer = Peer(server, "a")
    delta = torch.full((server.layout.fragments[0].numel,), 1e-3)
    try:
        peer.join()
        assert peer.upload(0, delta).accepted
        wait_until(lambda: on_disk(server, tmp_path / "state") == 1, timeout=10)
        server.service.stop()  # stop began: the last commits are made, calls still arrive
        with pytest.raises(grpc.RpcError) as refused:
            reply = peer.upload(0, delta)
            raise AssertionError(f"answered while stopping: {reply}")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert not server.state.rounds  # nothing admitted that no commit will take
    finally:
        peer.close()
        server.stop()
    assert on_disk(server, tmp_path / "state") == 1

"""The torchft peer: real lighthouse and replica-group processes training the tiny recipe.

Skipped when torchft is not installed (``make setup-peers``). The helpers that do not need
torchft are tested unconditionally.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from diloco.baselines.torchft.netbytes import SocketBytes
from diloco.baselines.torchft.peer import parse_slow
from diloco.baselines.torchft.replica import split_fragments
from diloco.wire.comms import DEFAULT_SETTING

CORE_FIELDS = (
    "mode",
    "stopped_by",
    "learners",
    "wall_s",
    "tokens",
    "tokens_per_s",
    "train_s",
    "params",
    "val_loss",
    "rounds",
    "bytes",
    "per_learner",
    "goodput",
    "peer",
)


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (to prove nothing was left running)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry))
    return pids


def test_split_fragments_balances_whole_tensors_and_keeps_the_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    assert split_fragments(model, 1) == [model]
    parts = split_fragments(model, 3)
    held = [p for part in parts for p in part.parameters()]
    assert sorted(map(id, held)) == sorted(id(p) for p in model.parameters())
    sizes = [sum(p.numel() for p in part.parameters()) for part in parts]
    assert max(sizes) - min(sizes) <= 64  # the largest tensor (8x8) alone in one fragment
    with pytest.raises(ValueError):
        split_fragments(model, 7)


def test_parse_slow():
    assert parse_slow(["1=3", "0=1.5"]) == {1: 3.0, 0: 1.5}
    with pytest.raises(ValueError):
        parse_slow(["3"])


def test_socket_bytes_counts_tcp_payload_both_ways():
    counter = SocketBytes()
    sent0, received0 = counter.sample()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        client.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(peer.recv(65536))
        peer.sendall(b"y" * 5_000)
        got = 0
        while got < 5_000:
            got += len(client.recv(65536))
        sent, received = counter.sample()
        client.close()
        peer.close()
    # Both ends live in this process: each direction is counted once as sent, once as received.
    assert 105_000 <= sent - sent0 <= 105_010
    assert 105_000 <= received - received0 <= 105_010
    assert counter.sample() == (sent, received)  # closed sockets keep their last sample


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_replica_groups_train_a_few_rounds_and_the_loss_falls(tmp_path):
    pytest.importorskip("torchft")
    from diloco.baselines.torchft.peer import run_torchft

    rounds, sync_every = 4, 16
    summary = run_torchft(
        learners=2,
        recipe="tiny",
        minutes=0,
        rounds=rounds,
        sync_every=sync_every,
        slow={1: 3.0},  # (2.0 left too little margin: see below)
        run_dir=tmp_path / "run",
        start_timeout_s=60.0,
        stop_timeout_s=20.0,
    )
    for field in CORE_FIELDS:
        assert field in summary, field
    assert summary["stopped_by"] == "rounds"
    assert summary["rounds"] == rounds
    assert summary["val_loss"]["final"] < summary["val_loss"]["initial"] - 0.5
    assert summary["replicas_max_diff"] == 0.0  # every replica holds the same global model
    fast, slow = summary["per_learner"]["learner-0"], summary["per_learner"]["learner-1"]
    for ln in (fast, slow):
        assert ln["exit_code"] == 0
        assert ln["steps"] == rounds * sync_every
        assert ln["contributions"] == rounds
        assert ln["bytes_up"] > rounds * 4 * summary["params"] / 2  # at least the all-reduces
    assert summary["tokens"] == 2 * rounds * sync_every * 8 * 32
    # One replica is three times as slow: it computes longer, the fast one waits for it at
    # syncs. (Each replica's own steps are stretched, and 64 steps of ~9 ms are a short
    # sample: beside other test processes the fast one's own steps once took 1.57 times the
    # slow one's, and at 2x its compute was only 1.28 times the fast one's.)
    assert slow["compute_s"] > 1.4 * fast["compute_s"]
    assert fast["sync_s"] > slow["sync_s"]
    assert 0 < summary["goodput"] <= 1.0
    assert summary["peer"]["name"] == "torchft"
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_time_budget_stops_every_replica_after_the_same_commit(tmp_path):
    pytest.importorskip("torchft")
    from diloco.baselines.torchft.peer import run_torchft

    summary = run_torchft(
        learners=2, recipe="tiny", minutes=0.25, run_dir=tmp_path / "run", stop_timeout_s=20.0
    )
    assert summary["stopped_by"] == "time"
    rounds = summary["rounds"]
    assert rounds >= 1
    for ln in summary["per_learner"].values():
        assert ln["exit_code"] == 0
        assert ln["contributions"] == rounds  # every replica ends after the same commit
        h = DEFAULT_SETTING.sync_every  # the peer's H is ours
        assert ln["useful_tokens"] == rounds * h * 8 * 32
        # A replica may have trained part of the next interval before its peer stopped.
        assert rounds * h <= ln["steps"] < (rounds + 1) * h
    assert summary["replicas_max_diff"] == 0.0
    assert summary["wall_s"] < 0.25 * 60 + 15
    assert summary["val_loss"]["final"] < summary["val_loss"]["initial"]
    assert _processes_mentioning(str(tmp_path)) == []

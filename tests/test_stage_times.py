"""Where a commit's time goes (issue 48, "Real sizes"): the syncer's stage recorder
(``diloco.syncer.stage_times``) on a fake clock, and a real syncer that fills it."""

from __future__ import annotations

import pytest
from kit import Peer, local_syncer, tiny_model, wait_until

from diloco.syncer.config import SyncerConfig
from diloco.syncer.stage_times import STAGES, StageTimes, percentile

COMMIT_PATH = [s for s in STAGES if s != "snapshot"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_recorder_times_blocks_on_its_clock_and_summarises_each_stage():
    clock = FakeClock()
    times = StageTimes(clock, keep=3)
    for seconds in (0.1, 0.2, 0.3, 0.4):
        with times.timing("merge"):
            clock.now += seconds
    with pytest.raises(RuntimeError), times.timing("persist"):  # a failed write counts too
        clock.now += 2.0
        raise RuntimeError("disk")
    times.add("decode", 0.01)
    summary = times.summary()
    assert list(summary) == ["decode", "merge", "persist"]  # in the commit's order
    merge = summary["merge"]
    assert merge["count"] == 4 and merge["total_s"] == pytest.approx(1.0)  # every sample
    assert merge["p50_s"] == pytest.approx(0.3) and merge["max_s"] == pytest.approx(0.4)  # kept 3
    assert summary["persist"]["total_s"] == pytest.approx(2.0)
    assert times.take() == summary
    assert times.summary() == {}  # a new window
    with pytest.raises(ValueError, match="unknown stage 'fsync'"):
        times.add("fsync", 1.0)
    assert times.summary() == {}


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 0.95) == 19.0 and percentile(values, 0.5) == 10.0
    assert percentile(values, 1.0) == 20.0 and percentile(values, 0.0) == 1.0
    assert percentile([], 0.5) == 0.0


def test_a_real_syncer_times_every_stage_of_its_commits(tmp_path):
    """Uploads through gRPC to a syncer with a state directory and a tape: its committer's
    recorder holds a sample of every stage of the commit path, one decode per upload, and the
    background snapshot once one is written."""
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0, commits_per_snapshot=1)
    server = local_syncer(
        tiny_model(0, (16, 32, 4), tanh=False),
        config,
        num_fragments=2,
        state_dir=tmp_path / "state",
        tape_path=tmp_path / "events.jsonl",
    )
    peer = Peer(server, "a")
    try:
        peer.join()
        recorder = server.service.committer.stage_times
        for upload_id, base in ((1, 0), (2, 1)):  # the first commit is written whole
            assert peer.upload(upload_id=upload_id, base=base, steps=4, tokens=32).accepted
            wait_until(lambda b=base: server.state.versions[0] == b + 1, timeout=10)
        wait_until(lambda: "snapshot" in recorder.summary(), timeout=10)
        summary = recorder.summary()
        assert [s for s in summary if s != "snapshot"] == COMMIT_PATH
        assert summary["decode"]["count"] == 2
        assert summary["merge"]["count"] == summary["persist"]["count"] == 2
        assert all(summary[s]["total_s"] > 0 for s in COMMIT_PATH)
    finally:
        peer.close()
        server.stop()

"""The syncer scale benchmark's short form (``benchmarks/bench_syncer_scale.py``, issue 48):
a real syncer process at a few million parameters, 2 synthetic learners, a few seconds of
commits and a restart; the report is complete and consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.syncer.stage_times import STAGES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_syncer_scale.py"


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mounts``, longest mount point)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


@pytest.mark.slow
def test_the_short_form_reports_every_stage_bytes_memory_and_a_restart(tmp_path):
    out = tmp_path / "scale.json"
    argv = [sys.executable, str(BENCH), "--params", "2M", "--learners", "2", "--step", "0.2"]
    argv += ["--duration", "2", "--state-root", str(tmp_path / "state"), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| stage | ms/commit |" in done.stdout and "| made / due |" in done.stdout
    [row] = json.loads(out.read_text())
    assert (row["learners"], row["fragments"]) == (2, 24)
    assert 1.9e6 <= row["params"] <= 2e6
    commit_path = [s for s in STAGES if s != "snapshot"]
    assert [s for s in row["stages"] if s != "snapshot"] == commit_path
    for stage in commit_path:
        assert row["stages"][stage]["samples"] >= 1 and row["stages"][stage]["ms_per_commit"] > 0
    assert row["stages"]["decode"]["samples"] >= row["commits_in_window"]  # one per upload
    assert row["stages"]["merge"]["bandwidth_fraction"] > 0  # against the copy reference
    assert row["copy_GBps"] > 0
    assert 1 <= row["commits_made"] <= row["commits_due"]
    assert 1 <= row["clock_ticks_committed"] <= row["clock_ticks"]
    assert row["clock_lost"] >= 0  # (what it lost depends on the machine's load)
    assert row["commits_in_window"] >= 1 and row["uploads_accepted"] >= 1
    assert 0 < row["latency_p50_steps"] <= row["latency_p95_steps"]
    assert row["compressed_bytes_per_commit"] > 0 and row["snapshot_bytes"] > 0
    assert row["durable_bytes_per_commit"] > 0 and row["durable_over_compressed"] > 0
    if filesystem_type(tmp_path) != "tmpfs":  # (a tmpfs writes nothing to a disk)
        assert row["write_bytes_per_commit"] > 0
    assert row["wchar_per_commit"] > 0
    assert 0 < row["rss_steady_bytes_per_param"] <= row["rss_peak_bytes_per_param"]
    assert row["restart_s"] > 0 and row["restart_replayed"] >= 0
    phases = row["restart_phases"]  # (the syncer's own account of its restart)
    assert phases["fragments"] == 24 and phases["replayed"] == row["restart_replayed"]
    assert 0 < phases["restore_s"] <= phases["total_s"] <= row["restart_s"]
    assert phases["read_s"] > 0 and phases["checksum_s"] > 0
    assert "| restore: checksum (thread s) |" in done.stdout

"""``diloco run --mode sync``: lockstep rounds, a slow learner sets the pace, and a learner that
restarts at another phase of the fragment schedule does not deadlock the group."""

from __future__ import annotations

import pytest
from kit import run_diloco_json

from diloco.syncer.store import read_tape

pytestmark = pytest.mark.slow


def run(tmp_path, name, *flags):
    summary = run_diloco_json(
        "run",
        "--mode=sync",
        "--recipe=tiny",
        "--learners=2",
        "--eval-every=0",
        f"--runs-dir={tmp_path}",
        f"--name={name}",
        "--json",
        "--no-view",
        *flags,
        timeout=150,
    )
    return summary, read_tape(tmp_path / name / "syncer" / "events.jsonl")


@pytest.mark.timeout(160)
def test_a_restarted_learner_rejoins_the_lockstep_without_deadlock(tmp_path):
    # killed before its first checkpoint: it restarts at step 0, out of phase with its peer.
    # 72 full rounds take about a second once it is back (~6 s in, ~10 s on a loaded machine):
    # 24 s leave room for a slow restart and the 2 s before the end.
    summary, tape = run(tmp_path, "kill", "--minutes=0.4", "--chaos=kill:at=4s,down=2s,learners=1")
    restart = next(r["t"] for r in tape if r.get("event") == "restart")
    after = [r for r in tape if r.get("event") == "round" and r["t"] > restart]
    both = [r for r in after if sorted(r["participants"]) == ["learner-0", "learner-1"]]
    # many full cycles of H = 24 after the restart, and not all at the final flush
    assert len(both) >= 3 * 24, len(both)
    assert both[3 * 24 - 1]["t"] < tape[-1]["t"] - 2.0
    # the restarted learner trained on (it restarted at step 0: no checkpoint yet)
    assert summary["per_learner"]["learner-1"]["steps"] >= 3 * 24


@pytest.mark.timeout(160)
def test_the_slowest_learner_sets_the_pace(tmp_path):
    summary, _ = run(tmp_path, "slow", "--steps=480", "--minutes=2", "--slow=1=3")
    fast, slow = (summary["per_learner"][f"learner-{i}"] for i in (0, 1))
    assert fast["steps"] == slow["steps"] == 480
    # the fast learner's own rate is throttled to within about one cycle of the slow one's
    assert fast["steps_per_s"] < 1.5 * slow["steps_per_s"]

"""``diloco run --mode sync``: lockstep rounds, a slow learner sets the pace, and a learner that
restarts at another phase of the fragment schedule does not deadlock the group."""

from __future__ import annotations

import pytest
from kit import run_diloco_json, run_diloco_until

from diloco.syncer.store import read_tape

pytestmark = pytest.mark.slow


FULL_CYCLES = 3 * 24
"""Rounds that merge both learners after the restart: three full cycles of H = 24."""


def run(tmp_path, name, *flags, done=None):
    """A ``diloco run --mode sync`` to its end, or (``done``: a condition on its tape) until
    ``done`` holds; its summary and tape."""
    args = (
        "--mode=sync",
        "--recipe=tiny",
        "--learners=2",
        "--eval-every=0",
        f"--runs-dir={tmp_path}",
        f"--name={name}",
        "--json",
        "--no-view",
        *flags,
    )
    if done is None:
        summary = run_diloco_json("run", *args, timeout=150)
    else:
        summary = run_diloco_until(
            tmp_path / name, *args, done=done, timeout=120, what=f"run {name}'s checks"
        )
    return summary, read_tape(tmp_path / name / "syncer" / "events.jsonl")


def full_rounds_after_restart(tape: list[dict]) -> list[dict]:
    """The rounds after the first restart that merged both learners."""
    restart = next((r["t"] for r in tape if r.get("event") == "restart"), None)
    if restart is None:
        return []
    after = [r for r in tape if r.get("event") == "round" and r["t"] > restart]
    return [r for r in after if sorted(r["participants"]) == ["learner-0", "learner-1"]]


def cycles_done_well_before(tape: list[dict]) -> bool:
    """``FULL_CYCLES`` full rounds after the restart, the last of them 2 s before the
    newest record: the run can stop with the checks met, not at its final flush."""
    both = full_rounds_after_restart(tape)
    return len(both) >= FULL_CYCLES and both[FULL_CYCLES - 1]["t"] < tape[-1]["t"] - 2.0


@pytest.mark.timeout(160)
def test_a_restarted_learner_rejoins_the_lockstep_without_deadlock(tmp_path):
    # killed before its first checkpoint: it restarts at step 0, out of phase with its peer.
    # 72 full rounds take about a second once it is back (~6 s in, ~10 s on a loaded machine,
    # more beside the rest of the suite: 24 s were once too few). The run is stopped (SIGTERM,
    # as Ctrl+C) as soon as those rounds are 2 s old: the minute is a bound, not a wait.
    summary, tape = run(
        tmp_path,
        "kill",
        "--minutes=1.0",
        "--chaos=kill:at=4s,down=2s,learners=1",
        done=cycles_done_well_before,
    )
    both = full_rounds_after_restart(tape)
    # many full cycles of H = 24 after the restart, and not all at the final flush
    assert len(both) >= FULL_CYCLES, len(both)
    assert both[FULL_CYCLES - 1]["t"] < tape[-1]["t"] - 2.0
    # the restarted learner trained on (it restarted at step 0: no checkpoint yet)
    assert summary["per_learner"]["learner-1"]["steps"] >= FULL_CYCLES


@pytest.mark.timeout(160)
def test_the_slowest_learner_sets_the_pace(tmp_path):
    summary, _ = run(tmp_path, "slow", "--steps=480", "--minutes=2", "--slow=1=3")
    fast, slow = (summary["per_learner"][f"learner-{i}"] for i in (0, 1))
    assert fast["steps"] == slow["steps"] == 480
    # the fast learner's own rate is throttled to within about one cycle of the slow one's
    assert fast["steps_per_s"] < 1.5 * slow["steps_per_s"]

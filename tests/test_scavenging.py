"""Learners added mid-run (``diloco run --add-learners AT:N``): the plans, the refusals, and a
real run in which a learner joins late, is merged, and is counted."""

from __future__ import annotations

import pytest
from kit import run_diloco_until

from diloco.config.run import RunConfig
from diloco.launch.children import parse_additions, plan_learners
from diloco.runtime.jsonl import read_jsonl


def test_additions_are_parsed_sorted_and_checked():
    assert parse_additions(["3m:1", "90s:2"]) == [(90.0, 2), (180.0, 1)]
    for bad in ("90s", "90s:0", "soon:2", "0s:1"):
        with pytest.raises(ValueError, match="--add-learners"):
            parse_additions([bad])


def test_added_learners_get_the_next_indices_and_their_own_settings():
    config = RunConfig(learners=2, add_learners=["1m:2"], slow=["3=2"], batch=["2=4"])
    plans = plan_learners(config, default_batch=8)
    assert [(p.id, p.index, p.batch_size, p.slow, p.start_at) for p in plans] == [
        ("learner-0", 0, 8, 1.0, 0.0),
        ("learner-1", 1, 8, 1.0, 0.0),
        ("learner-2", 2, 4, 1.0, 60.0),
        ("learner-3", 3, 8, 2.0, 60.0),
    ]


def merged_both(tape: list[dict]) -> list[dict]:
    """The rounds that merged both the first learner and the added one."""
    return [
        r
        for r in tape
        if r.get("event") == "round" and set(r["participants"]) == {"learner-0", "learner-1"}
    ]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_learner_added_mid_run_joins_is_merged_and_counted(tmp_path):
    """The run is stopped (SIGTERM, as Ctrl+C) once rounds merged both learners ten times:
    ``--minutes`` only bounds it."""
    summary = run_diloco_until(
        tmp_path / "it", "--recipe=tiny", "--learners=1", "--add-learners=8s:1",
        "--minutes=0.45", "--eval-every=2", "--dashboard=off", f"--runs-dir={tmp_path}",
        "--name=it", "--json", done=lambda tape: len(merged_both(tape)) >= 10, timeout=150,
        what="ten rounds that merge both learners",
    )  # fmt: skip
    assert summary["learners"] == 2
    late = summary["per_learner"]["learner-1"]
    assert late["steps"] > 0 and late["contributions"] > 0 and late["exit_code"] == 0
    tape = read_jsonl(tmp_path / "it" / "syncer" / "events.jsonl")
    added = [r for r in tape if r.get("event") == "added"]
    assert [r["target"] for r in added] == ["learner-1"]
    start = summary["started_at"]
    assert added[0]["t"] - start >= 8.0
    joins = [r for r in tape if r.get("event") == "join" and r.get("learner") == "learner-1"]
    assert joins and joins[0]["t"] >= added[0]["t"]
    rounds = [r for r in tape if r.get("event") == "round"]
    assert all("learner-1" not in r["participants"] for r in rounds if r["t"] < added[0]["t"])
    assert len(merged_both(tape)) >= 10  # after it joined, rounds merge both learners
    assert summary["useful_tokens"]["learner-1"] > 0

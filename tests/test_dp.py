"""The data-parallel baseline: group checkpoints, the group restart policy, an end-to-end run."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from kit import progress_of, run_diloco, run_diloco_until

from diloco.baselines.dp import checkpoint as ckpt
from diloco.launch.supervisor import Supervisor
from diloco.report.dp_metrics import dp_metrics, new_ground
from diloco.syncer.store import read_tape


# ---------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_counts_only_once_every_rank_wrote_it(tmp_path):
    assert ckpt.latest_step(tmp_path, 2) is None
    ckpt.write_rank_state(tmp_path, 10, 0, {"stream": {}, "tokens": 5, "model": {}})
    with pytest.raises(RuntimeError, match="lacks ranks"):
        ckpt.commit(tmp_path, 10, 2)
    assert ckpt.latest_step(tmp_path, 2) is None  # a torn save is not resumed
    ckpt.write_rank_state(tmp_path, 10, 1, {"stream": {}, "tokens": 5})
    ckpt.commit(tmp_path, 10, 2)
    assert ckpt.latest_step(tmp_path, 2) == (10, 2)
    for r in (0, 1):
        ckpt.write_rank_state(tmp_path, 20, r, {"stream": {}, "tokens": 9})
    ckpt.commit(tmp_path, 20, 2)
    assert ckpt.latest_step(tmp_path, 2) == (20, 2)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [
        "step-20.rank-0.pt",
        "step-20.rank-1.pt",
    ]
    assert ckpt.read_rank_state(tmp_path, 20, 1)["tokens"] == 9
    # a commit never removes a newer step's parts: ranks write their final part while rank 0
    # may still be committing the previous checkpoint (seen as "lacks ranks" at the end)
    ckpt.write_rank_state(tmp_path, 30, 1, {"stream": {}, "tokens": 11})
    for r in (0, 1):
        ckpt.write_rank_state(tmp_path, 25, r, {"stream": {}, "tokens": 10})
    ckpt.commit(tmp_path, 25, 2)
    assert ckpt.rank_file(tmp_path, 30, 1).exists()
    assert not ckpt.rank_file(tmp_path, 20, 1).exists()
    # a group that grew resumes it (its new ranks start from rank 0's part); a smaller one
    # would lose the data positions of the ranks that left
    assert ckpt.latest_step(tmp_path, 3) == (25, 2)
    with pytest.raises(ValueError, match="2-rank group"):
        ckpt.latest_step(tmp_path, 1)


def test_a_foreign_file_is_refused_not_unpickled(tmp_path):
    path = ckpt.rank_file(tmp_path, 3, 0)
    torch.save({"format": 99, "step": 3}, path)
    with pytest.raises(ValueError, match="not a data-parallel checkpoint"):
        ckpt.read_rank_state(tmp_path, 3, 0)


# ---------------------------------------------------------------------------- metrics
def test_rolled_back_steps_and_restart_time_are_lost():
    def records(start_t, steps, t0=0.0):
        out = [{"t": start_t, "event": "start", "step": steps[0], "tokens": steps[0] * 10}]
        out += [{"t": t0 + i, "step": s, "tokens": s * 10} for i, s in enumerate(steps)]
        return out

    # 10 steps/s for 10 s, killed at t=10 (checkpoint at step 50), back at t=15, runs to t=22
    first = records(0.0, [10 * i for i in range(1, 11)], t0=1.0)
    second = records(15.0, [50 + 10 * i for i in range(1, 8)], t0=16.0)
    rank = first + second
    m = dp_metrics({"r0": rank, "r1": rank}, [{"t": 15.0, "target": "r0"}], end=22.0)
    assert m["useful_tokens"] == {"r0": 1200, "r1": 1200}
    assert m["goodput"] == pytest.approx(1200 / (100 * 22))
    # step 100 was first reached at t=10, and passed again only at t=21 (step 110)
    assert m["max_commit_gap_s"] == pytest.approx(11.0)
    assert new_ground(rank)[-2:] == [21.0, 22.0]
    assert m["reintegrations"][0]["reintegration_s"] == pytest.approx(1.0)
    # the schedule's down time is the killed rank's only: r1 waiting is data-parallel's cost
    kill = {"t": 10.0, "kind": "kill", "target": "r0", "down_s": 4.0}
    m = dp_metrics({"r0": rank, "r1": rank}, [], end=22.0, chaos=[kill])
    assert m["down_share"] == pytest.approx(400 / 4400)
    assert m["goodput_up"] == pytest.approx(2400 / 4000)


# ---------------------------------------------------------------------------- group policy
def sleeper(tag: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(60)", tag, "--generation=0"]


def test_the_all_reduce_share_of_busy_time_spans_incarnations():
    """``reduce_s`` and ``busy_s`` restart at 0 with each incarnation: only intervals inside
    one count (``diloco plan``'s overlap is measured from this share, docs/plan.md)."""
    rank = [
        {"event": "start", "t": 0.0, "step": 0, "tokens": 0},
        {"t": 1.0, "step": 1, "tokens": 100, "busy_s": 0.5, "reduce_s": 0.1},
        {"t": 2.0, "step": 2, "tokens": 200, "busy_s": 1.5, "reduce_s": 0.35},  # 0.25 of 1.0
        {"event": "start", "t": 3.0, "step": 1, "tokens": 100},
        {"t": 4.0, "step": 2, "tokens": 200, "busy_s": 0.5, "reduce_s": 0.05},
        {"t": 5.0, "step": 3, "tokens": 300, "busy_s": 1.5, "reduce_s": 0.3},  # 0.25 of 1.0
    ]
    older = [{k: v for k, v in r.items() if k != "reduce_s"} for r in rank]  # no reduce_s
    assert dp_metrics({"a": rank}, [], end=5.0)["allreduce_share"] == 0.25
    assert dp_metrics({"a": older}, [], end=5.0)["allreduce_share"] is None


def test_one_member_down_stops_the_group_and_all_restart_together(tmp_path):
    tape, clock = [], [0.0]
    sup = Supervisor(tape=tape.append, clock=lambda: clock[0], group=["a", "b", "c"])
    try:
        for name in "abc":
            sup.add(name, sleeper(name), tmp_path / f"{name}.log")
        old = {n: s.child.pid for n, s in sup.slots.items()}
        sup.slots["b"].child.kill()
        sup.slots["b"].child.proc.wait(10)
        sup.poll()  # b is down: a and c are stopped, everyone waits for b's restart
        assert [r["event"] for r in tape] == ["crash", "group-stop"]
        assert tape[1]["stopped"] == ["a", "c"] and tape[1]["generation"] == 1
        assert not any(s.child.running for s in sup.slots.values())
        clock[0] = 5.0
        sup.poll()
        assert [r["target"] for r in tape if r["event"] == "restart"] == ["a", "b", "c"]
        for name, slot in sup.slots.items():
            assert slot.child.running and slot.child.pid != old[name]
            assert "--generation=1" in slot.argv
        planned = sum(s.planned_deaths for s in sup.slots.values())
        assert planned == 2  # the two collateral stops; b's crash is not planned
    finally:
        sup.kill_everything()


# ---------------------------------------------------------------------------- end to end
def dp_run(tmp_path, *flags: str, trained_after: dict[str, int]) -> tuple[dict, object, list]:
    """A ``diloco run --mode dp`` of the tiny recipe, bounded by 2 minutes and stopped (as
    Ctrl+C: a final group checkpoint) once each rank of ``trained_after`` has started that
    many times and reported ``PROGRESS_AFTER`` progress records in its last start: its
    summary, run directory and tape."""
    run = tmp_path / "dp"

    def trained(_tape: list[dict]) -> bool:
        for rank, starts in trained_after.items():
            records = progress_of(run, rank)
            begun = [i for i, r in enumerate(records) if r.get("event") == "start"]
            if len(begun) < starts or sum("tokens" in r for r in records[begun[-1] :]) < (
                PROGRESS_AFTER
            ):
                return False
        return True

    summary = run_diloco_until(
        run, "--mode=dp", "--recipe=tiny", "--eval-every=2", "--minutes=2", *flags,
        f"--runs-dir={tmp_path}", "--name=dp", "--json", "--no-view", "--dashboard=off",
        done=trained, timeout=110, what="the ranks' training after their last start",
    )  # fmt: skip
    return summary, run, read_tape(run / "syncer" / "events.jsonl")


PROGRESS_AFTER = 3
"""Progress records (one a second) a rank reports after its last start before a run stops."""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_killed_rank_restarts_the_group_from_its_checkpoint(tmp_path):
    s, run, events = dp_run(
        tmp_path,
        "--learners=2",
        "--checkpoint-every=2",
        "--chaos=kill:at=6s,down=2s,learners=1",
        trained_after={"learner-0": 2, "learner-1": 2},  # (both restarted with the group)
    )
    kinds = [e["event"] for e in events]
    assert kinds.count("group-stop") == 1 and kinds.count("restart") == 2, events
    assert s["mode"] == "dp" and s["group_restarts"] == 1
    assert s["val_loss"]["final"] < s["val_loss"]["initial"] - 1.0
    # the restarted group resumed from a checkpoint, not from scratch
    for rank in ("learner-0", "learner-1"):
        lines = (run / "learners" / rank / "progress.jsonl").read_text().splitlines()
        starts = [json.loads(x) for x in lines if '"event": "start"' in x]
        assert len(starts) == 2 and starts[1]["step"] > 0
    # useful tokens are those of the surviving steps only: never more than the ranks trained
    # over all incarnations (a rolled-back incarnation reached at least the checkpoint the
    # next one starts from). A bound on goodput itself (< 0.98) stopped being safe once warm
    # spares made restarts cheap: the median speed it divides by varies by more than a
    # cheap restart loses.
    for rank in ("learner-0", "learner-1"):
        records = [json.loads(x) for x in (run / "learners" / rank / "progress.jsonl").open()]
        reached: list[list[int]] = []  # per incarnation: [start tokens, highest tokens]
        for r in records:
            if r.get("event") == "start":
                if reached:
                    reached[-1][1] = max(reached[-1][1], r["tokens"])
                reached.append([r["tokens"], r["tokens"]])
            elif "tokens" in r:
                reached[-1][1] = max(reached[-1][1], r["tokens"])
        trained = sum(top - first for first, top in reached)
        assert 0 < s["useful_tokens"][rank] <= trained
        # the all-reduce's own seconds (diloco plan's --dp-reduce-time) are part of the step's
        timed = [r for r in records if "reduce_s" in r]
        assert timed and all(0 < r["reduce_s"] <= r["busy_s"] for r in timed)
    assert 0 < s["allreduce_share"] < 1
    assert s["goodput"] > 0
    # both ranks agree on the surviving steps
    steps = {ln["steps"] for ln in s["per_learner"].values()}
    assert len(steps) == 1
    # the bytes of lost steps were sent all the same (progress is reported once a second)
    assert s["bytes"]["per_token"] >= 0.95 * s["bytes"]["data_parallel_per_token"]


@pytest.mark.slow
def test_dp_refuses_chaos_it_cannot_carry_out(tmp_path):
    t0 = time.monotonic()
    proc = run_diloco(
        "run",
        "--mode=dp",
        "--recipe=tiny",
        "--chaos=syncer-kill:at=5s",
        f"--runs-dir={tmp_path}",
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--mode dp supports chaos kinds kill, hang only" in proc.stderr
    assert not any(tmp_path.iterdir()) and time.monotonic() - t0 < 30


def test_peers_that_fail_on_their_own_count_as_one_crash(tmp_path):
    tape = []
    sup = Supervisor(tape=tape.append, clock=lambda: 0.0, group=["a", "b"])
    try:
        for name in "ab":
            sup.add(name, sleeper(name), tmp_path / f"{name}.log")
        for slot in sup.slots.values():  # both die before the supervisor looks
            slot.child.kill()
            slot.child.proc.wait(10)
        sup.poll()
        crashes = sum(1 for s in sup.slots.values() for c in s.exit_codes if c != 0)
        assert crashes - sum(s.planned_deaths for s in sup.slots.values()) == 1
        assert [r["event"] for r in tape].count("group-stop") == 1
    finally:
        sup.kill_everything()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_group_grows_by_stopping_and_starting_again_at_the_new_size(tmp_path):
    """``--add-learners`` for data-parallel: at the addition's time the group stops at one
    step with a final checkpoint and starts again with the added rank, which takes rank 0's
    model and optimizer; nothing trained is lost and the grown group keeps training."""
    # grown at 12 s and back ~4 s later on a quiet machine; then a few seconds of training
    s, run, events = dp_run(
        tmp_path, "--learners=1", "--add-learners=12s:1",
        trained_after={"learner-0": 2, "learner-1": 1},
    )  # fmt: skip
    resizes = [e for e in events if e["event"] == "resize"]
    assert [(e["world"], e["added"]) for e in resizes] == [(2, ["learner-1"])]
    assert not [e for e in events if e["event"] in ("group-stop", "crash")]
    progress = {
        rank: [json.loads(x) for x in (run / "learners" / rank / "progress.jsonl").open()]
        for rank in ("learner-0", "learner-1")
    }
    first_run = [r for r in progress["learner-0"] if r.get("event") == "exit"][0]
    starts = {
        rank: [r for r in recs if r.get("event") == "start"] for rank, recs in progress.items()
    }
    # rank 0 resumed exactly where it stopped; the new rank joined at the same step
    assert starts["learner-0"][1]["step"] == first_run["step"] > 0
    assert starts["learner-1"][0]["step"] == first_run["step"]
    assert starts["learner-1"][0]["tokens"] == 0  # its own tokens: it trained none before
    assert s["per_learner"]["learner-1"]["steps"] > 0
    steps = {ln["steps"] for ln in s["per_learner"].values()}
    assert len(steps) == 1 and steps.pop() > first_run["step"]  # the grown group trained on
    assert s["val_loss"]["final"] < s["val_loss"]["initial"] - 1.0

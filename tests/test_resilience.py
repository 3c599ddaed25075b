"""Failures with real processes and real signals: SIGKILL a learner, SIGSTOP a learner,
SIGKILL the syncer, cut a learner's network, all in one seeded ``diloco run --chaos`` run,
against a fault-free run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kit import run_diloco_json

from diloco.syncer.store import read_tape

pytestmark = pytest.mark.slow

MINUTES = 0.9  # both runs stop by time: the chaos run must outlast its last failure
# Chaos 4-6 s apart: a syncer or learner restarted on a machine running both runs takes ~4 s.
# Chaos times count from the moment both learners are training (a few seconds after launch).
KILL_AT, KILL_DOWN = 6.0, 2.0  # learner-1
DROP_AT = 10.0  # learner-0
SYNCER_AT, SYNCER_DOWN = 14.0, 1.0
HANG_AT, HANG_DOWN = 24.0, 4.0  # learner-0
PART_AT, PART_DOWN = 32.0, 5.0  # learner-1
DELAY_AT, DELAY_DOWN, LATENCY = 32.0, 5.0, 0.3  # learner-0, while learner-1 is cut off
CHAOS = (
    f"kill:at={KILL_AT}s,down={KILL_DOWN}s,learners=1;"
    f"drop:at={DROP_AT}s,learners=0;"
    f"syncer-kill:at={SYNCER_AT}s,down={SYNCER_DOWN}s;"
    f"hang:at={HANG_AT}s,down={HANG_DOWN}s,learners=0;"
    f"partition:at={PART_AT}s,down={PART_DOWN}s,learners=1;"
    f"delay:at={DELAY_AT}s,down={DELAY_DOWN}s,latency={LATENCY}s,learners=0"
)
#: A faulty run may end at most this much above the fault-free run's held-out loss.
LOSS_BOUND = 1.10


def run(tmp_path, name: str, *extra: str) -> tuple[dict, list[dict]]:
    proc = run_diloco_json(
        "run",
        "--recipe=tiny",
        "--learners=2",
        f"--minutes={MINUTES}",
        "--checkpoint-every=1",
        "--eval-every=0",
        f"--runs-dir={tmp_path}",
        f"--name={name}",
        "--json",
        *extra,
        timeout=200,
    )
    return proc, read_tape(tmp_path / name / "syncer" / "events.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fault-free run and the chaos run side by side: both bounded by the same minute on
    the same busy machine (half the wall time of one after the other)."""
    tmp = tmp_path_factory.mktemp("resilience")
    with ThreadPoolExecutor(2) as pool:
        clean = pool.submit(run, tmp, "clean")
        faulty = pool.submit(run, tmp, "chaos", f"--chaos={CHAOS}")
        return clean.result(), faulty.result()


def rounds_between(tape, t0, t1, learner=None):
    return [
        r
        for r in tape
        if r["event"] == "round"
        and t0 <= r["t"] <= t1
        and (learner is None or learner in r["participants"])
    ]


def assert_nothing_new_from(rounds, learner):
    """``learner`` is cut off during ``rounds``: what it sent before may still be merged (an
    answer that missed its round waits for its fragment's next tick), but only by the first
    round of each fragment in the window; nothing new comes from it."""
    seen: set[int] = set()
    for r in rounds:
        assert learner not in r["participants"] or r["fragment"] not in seen, r
        seen.add(r["fragment"])


def one(tape, event, **match):
    found = [
        r for r in tape if r["event"] == event and all(r.get(k) == v for k, v in match.items())
    ]
    assert len(found) == 1, (event, match, found)
    return found[0]


@pytest.mark.timeout(420)
def test_every_injected_failure_is_on_the_tape(runs):
    _, (summary, tape) = runs
    kinds = sorted((f["kind"], f["target"]) for f in summary["failures_injected"])
    assert kinds == [
        ("delay", "learner-0"),
        ("drop", "learner-0"),
        ("hang", "learner-0"),
        ("kill", "learner-1"),
        ("partition", "learner-1"),
        ("syncer-kill", "syncer"),
    ]
    assert summary["syncer_restarts"] == 1
    assert summary["per_learner"]["learner-1"]["restarts"] == 1
    assert {"goodput", "uptime", "max_commit_gap_s", "reintegrations"} <= summary.keys()
    assert 0 < summary["goodput"] <= 1.05 and 0 < summary["uptime"] <= 1


def test_killed_learner_is_replaced_others_keep_committing_and_it_contributes_again(runs):
    _, (summary, tape) = runs
    kill = one(tape, "chaos", kind="kill")
    back = one(tape, "restart", target="learner-1")
    assert back["t"] - kill["t"] >= KILL_DOWN
    assert back["warm"] is True  # it ran in the warm spare kept for kill chaos
    # The others keep committing while it is down. Answers it sent before the kill may still
    # be merged after it (one that missed its round waits for its fragment's next tick), but
    # only by the first round of each fragment after the kill: nothing new comes from it.
    during = rounds_between(tape, kill["t"] + 0.1, back["t"])
    assert during
    assert_nothing_new_from(during, "learner-1")
    assert rounds_between(tape, back["t"], float("inf"), "learner-1")
    reint = [r for r in summary["reintegrations"] if r["learner"] == "learner-1"]
    assert reint and reint[0]["reintegration_s"] is not None
    # It resumed from its own checkpoint, not from step 0.
    log = Path(summary["run_dir"]) / "logs" / "learner-1.log"
    assert "resumed from" in log.read_text()
    # and it kept its delivery log beside the checkpoint (what it must not send twice)
    delivered = Path(summary["run_dir"]) / "learners" / "learner-1" / "delivered.json"
    assert json.loads(delivered.read_text())


def test_hung_learner_drops_out_while_others_commit_and_comes_back(runs):
    _, (_, tape) = runs
    hang = one(tape, "chaos", kind="hang")
    resume = one(tape, "resume", target="learner-0")
    assert resume["t"] - hang["t"] >= HANG_DOWN - 0.5
    assert rounds_between(tape, hang["t"] + 1, resume["t"], "learner-1")
    # What it answered before it hung may still be merged (an answer that missed its round
    # waits for its fragment's next tick), by the first round of each fragment: nothing new.
    assert_nothing_new_from(rounds_between(tape, hang["t"] + 0.1, resume["t"]), "learner-0")
    assert rounds_between(tape, resume["t"], float("inf"), "learner-0")


def test_syncer_restarts_with_every_committed_round(runs):
    _, (summary, tape) = runs
    kill = one(tape, "chaos", kind="syncer-kill")
    starts = [r for r in tape if r["event"] == "start"]
    assert len(starts) == 2
    restart = starts[1]
    # The restarted syncer holds exactly the last committed version and values of each fragment
    # (a commit persisted just before the kill, whose round record the kill kept off the tape,
    # is accounted for by a ``recovered`` record the restarted syncer writes before ``start``).
    last: dict[int, dict] = {}
    for r in tape:
        if r["event"] in ("round", "recovered") and r["t"] <= restart["t"]:
            last[r["fragment"]] = r
    assert restart["restored_fragments"] == len(last) > 0
    for p, version in enumerate(restart["versions"]):
        if p in last:
            assert version == last[p]["version"], p
            assert restart["digests"][p] == last[p]["digest"], p
        else:  # never committed: the initial parameters, version 0
            assert version == 0, p
    # Commits resume after the restart, from both learners.
    after = rounds_between(tape, restart["t"], float("inf"))
    assert {"learner-0", "learner-1"} <= {m for r in after for m in r["participants"]}
    # The longest gap between commits is the syncer's own outage, bounded.
    assert summary["max_commit_gap_s"] < SYNCER_DOWN + 15
    assert restart["t"] > kill["t"]


def test_quality_within_bound_of_a_fault_free_run(runs):
    (clean, _), (faulty, _) = runs
    assert clean["val_loss"]["final"] < 0.8 * clean["val_loss"]["initial"]
    assert faulty["val_loss"]["final"] <= LOSS_BOUND * clean["val_loss"]["final"], (
        faulty["val_loss"],
        clean["val_loss"],
    )


def test_partitioned_learner_keeps_training_and_contributes_after_the_link_heals(runs):
    _, (summary, tape) = runs
    cut = one(tape, "chaos", kind="partition")
    heal = one(tape, "heal", target="learner-1")
    assert heal["t"] - cut["t"] >= PART_DOWN - 0.5
    # the link works again only after the heal record: the learner cannot rejoin before it
    assert not [
        r
        for r in tape
        if r["event"] == "join" and r["learner"] == "learner-1" and cut["t"] < r["t"] < heal["t"]
    ]
    assert rounds_between(tape, cut["t"] + 1, heal["t"], "learner-0")
    assert_nothing_new_from(rounds_between(tape, cut["t"] + 0.1, heal["t"]), "learner-1")
    assert rounds_between(tape, heal["t"], float("inf"), "learner-1")
    progress = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "learners" / "learner-1" / "progress.jsonl")
        .read_text()
        .splitlines()
    ]
    steps = [r["step"] for r in progress if "step" in r and cut["t"] + 1 <= r["t"] <= heal["t"]]
    assert len(steps) >= 2 and steps[-1] > steps[0]  # it trained while cut off


def test_dropped_connections_lose_only_messages_in_flight(runs):
    _, (_, tape) = runs
    drop = one(tape, "chaos", kind="drop")
    hang = one(tape, "chaos", kind="hang")
    # learner-0 reconnects at once and contributes again well before its next fault.
    assert rounds_between(tape, drop["t"] + 0.5, hang["t"], "learner-0")


def test_delayed_learner_keeps_contributing_through_the_latency(runs):
    _, (_, tape) = runs
    delay = one(tape, "chaos", kind="delay")
    assert delay["latency_s"] == LATENCY
    healed = one(tape, "heal", target="learner-0")
    assert healed["t"] - delay["t"] >= DELAY_DOWN - 0.5
    # learner-1 is cut off meanwhile: every round of the window is learner-0's, sent through
    # a link with 0.3 s of one-way latency.
    assert rounds_between(tape, delay["t"] + 1, healed["t"], "learner-0")

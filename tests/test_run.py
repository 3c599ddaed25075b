"""``diloco run`` end to end: real processes, real gRPC, real signals."""

from __future__ import annotations

import json
import signal

import pytest
from kit import (
    current_fragments,
    pids_mentioning,
    run_diloco,
    run_diloco_json,
    start_diloco,
    wait_until,
)

from diloco.algorithm import balanced_fragments
from diloco.recipes import get_recipe
from diloco.syncer.store import FragmentStore, read_tape
from diloco.wire import auth

pytestmark = pytest.mark.slow

P = 24


@pytest.mark.timeout(150)
def test_three_learners_train_and_end_with_the_syncers_parameters(tmp_path):
    proc = run_diloco_json(
        "run",
        "--recipe=tiny",
        "--learners=3",
        "--steps=150",
        "--slow=2=2",
        "--minutes=1.2",
        "--down-codec=fp32",
        "--eval-every=2",
        f"--runs-dir={tmp_path}",
        "--name=it",
        "--json",
        timeout=140,
    )
    summary = proc
    run_dir = tmp_path / "it"
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "learners finished"
    for key in ("mode", "learners", "wall_s", "tokens", "rounds"):
        assert key in summary
    assert summary["learners"] == 3
    assert {ln["steps"] for ln in summary["per_learner"].values()} == {150}
    assert all(ln["steps_per_s"] > 0 for ln in summary["per_learner"].values())
    assert summary["bytes"]["up"] > 0 and summary["bytes"]["down"] > 0
    assert summary["bytes"]["per_token"] > 0

    # The global model learned: held-out loss fell clearly.
    loss = summary["val_loss"]
    assert loss["final"] < 0.8 * loss["initial"], loss

    # Every fragment was committed at least once, and the tape agrees with the summary.
    rounds = [r for r in read_tape(run_dir / "syncer" / "events.jsonl") if r["event"] == "round"]
    assert {r["fragment"] for r in rounds} == set(range(P))
    assert len(rounds) == summary["rounds"]
    joins = {
        r["learner"] for r in read_tape(run_dir / "syncer" / "events.jsonl") if r["event"] == "join"
    }
    assert {"learner-0", "learner-1", "learner-2"} <= joins

    # The run made its own secret and gave each learner (and the evaluator) only its own
    # token; the syncer wanted learner tokens.
    secret = (run_dir / "token").read_text().strip()
    assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
    for lid in ("learner-0", "learner-1", "learner-2"):
        token_file = run_dir / "secrets" / f"{lid}.token"
        assert token_file.read_text().strip() == auth.learner_token(secret, lid)
        assert token_file.stat().st_mode & 0o777 == 0o600
        config = json.loads((run_dir / "config" / f"{lid}.json").read_text())
        assert config["security"]["token_file"] == str(token_file)
    syncer_config = json.loads((run_dir / "config" / "syncer.json").read_text())
    assert syncer_config["security"]["learner_tokens"] is True

    # Every learner ends holding the syncer's final value of each fragment it received last.
    model = get_recipe("tiny").build_model(0)
    layout = balanced_fragments(model.named_parameters(), P)
    store = FragmentStore(run_dir / "syncer")
    final = {p: store.load(p, layout.fragments[p].numel) for p in range(P)}
    matched = 0
    for i in range(3):
        _, current = current_fragments(run_dir / "learners" / f"learner-{i}", final)
        matched += current
    assert matched >= P  # at least one learner's worth of fragments is current


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process_and_still_writes_the_summary(tmp_path):
    proc = start_diloco(
        "run",
        "--recipe=tiny",
        "--learners=2",
        "--minutes=5",
        f"--runs-dir={tmp_path}",
        "--name=int",
        "--no-view",
    )
    run_dir = tmp_path / "int"
    progress = run_dir / "learners" / "learner-1" / "progress.jsonl"
    wait_until(
        lambda: progress.exists() and progress.stat().st_size,
        60,
        "the learners to start training",
        interval=0.2,
        alive=proc,
    )
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupt"
    assert summary["tokens"] > 0
    assert "held-out loss" in out
    assert pids_mentioning(str(run_dir)) == []


def test_bad_arguments_are_refused_before_anything_starts(tmp_path):
    for args, message in [
        (["--slow=5=3"], "learner index"),
        (["--batch=x"], "INDEX=VALUE"),
        (["--slow=0=0.5"], "must be >= 1"),
        (["--data", str(tmp_path / "missing.txt")], "cannot read"),
        (["--learners=0"], "--learners must be >= 1 (got 0)"),
        (["--minutes=-1"], "--minutes must be >= 0"),
        (["--shards=0"], "--shards must be >= 1"),
    ]:
        proc = run_diloco("run", "--recipe=tiny", f"--runs-dir={tmp_path}", *args, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not any(tmp_path.iterdir()) or all(p.suffix == ".txt" for p in tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_a_learner_without_a_syncer_trains_alone(tmp_path):
    """``diloco learner --no-sync`` (the baseline of benchmarks/bench_run.py): trains, saves
    its checkpoint and exits 0 (it once failed at once: its stand-in Learner lacked
    ``wait_for_global``'s ``required``)."""
    done = run_diloco(
        "learner",
        "--no-sync",
        "--id=alone",
        "--recipe=tiny",
        "--total-steps=20",
        f"--workdir={tmp_path}",
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "learner alone: stopped; step 20" in done.stdout

"""Learners that are torchrun jobs: 2 islands x 2 ranks (DDP over gloo) against one syncer,
and a sharded island (FSDP2 over gloo).

Each island is one learner to the syncer; its ranks apply the same fragments at the same steps
and end with identical parameters. A rank killed with SIGKILL takes its island down; torchrun
restarts it, and it rejoins as the same learner from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kit import wait_until
from safetensors.torch import load_file

from diloco.recipes import get_recipe
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape

pytestmark = pytest.mark.slow


def torchrun(address: str, island: int, workdir: Path, steps: int, *extra: str, kind: str = "ddp"):
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *extra,
        "-m",
        "diloco.cli",
        "learner",
        f"--syncer={address}",
        f"--id=island-{island}",
        f"--index={island}",
        "--recipe=tiny",
        f"--total-steps={steps}",
        "--checkpoint-every=0.5",
        f"--workdir={workdir}",
        "--join-timeout=30",
        f"--island={kind}",
    ]
    # torchrun's agent keeps its per-rank logs in a fresh temporary directory: the test's own
    scratch = workdir.parent / f"{workdir.name}-tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
    log = (workdir.parent / f"{workdir.name}.log").open("w")
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    proc.log_path = Path(log.name)
    log.close()
    _LAUNCHED.append(proc)
    return proc


_LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """Whatever happens to a test (even a pytest timeout), no torchrun group outlives it."""
    yield
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        out = proc.log_path.read_text()
        pytest.fail(f"torchrun did not finish in {timeout}s:\n{out[-6000:]}")
    out = proc.log_path.read_text()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture
def syncer(tmp_path):
    model = get_recipe("tiny").build_model(0)
    server = SyncerServer.for_model(
        model, state_dir=tmp_path / "syncer", tape_path=tmp_path / "syncer" / "events.jsonl"
    ).start()
    yield server
    server.stop()


def learner_ids(tape) -> set[str]:
    return {r["learner"] for r in tape if r["event"] == "join" and not r.get("observer")}


def assert_replicas_agree(workdir: Path) -> None:
    rank0 = load_file(str(workdir / "replica.rank0.safetensors"))
    rank1 = load_file(str(workdir / "replica.rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name


@pytest.mark.timeout(180)
def test_two_islands_of_two_ranks_are_two_learners_with_identical_replicas(tmp_path, syncer):
    steps = 120
    procs = [torchrun(syncer.address, i, tmp_path / f"island-{i}", steps) for i in range(2)]
    for proc in procs:
        finish(proc, 150)
    tape = read_tape(tmp_path / "syncer" / "events.jsonl")
    assert learner_ids(tape) == {"island-0", "island-1"}  # one learner per island, not per rank
    rounds = [r for r in tape if r["event"] == "round"]
    for island in ("island-0", "island-1"):
        assert any(island in r["participants"] for r in rounds), island
    for i in range(2):
        workdir = tmp_path / f"island-{i}"
        assert_replicas_agree(workdir)
        final = (workdir / "final.json").read_text()
        assert f'"step": {steps}' in final
        # The island reports the tokens of both ranks: 2 x steps x the recipe's batch tokens.
        tiny = get_recipe("tiny")
        assert f'"tokens": {2 * steps * tiny.batch_size * tiny.model.seq_len}' in final


def rank_pid(workdir: Path, rank: int) -> int | None:
    """The pid of the learner process of ``rank`` working in ``workdir`` (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"--workdir={workdir}".encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_island_whose_rank_is_killed_is_restarted_and_rejoins(tmp_path, syncer, kind):
    """With FSDP each rank restores its own shards (and optimizer state) from its checkpoint."""
    workdir = tmp_path / "island-0"
    # 200 steps: rank 1 is killed at its first checkpoint (about step 20), and the restarted
    # island trains the rest, long enough to rejoin and contribute (a round every few steps)
    proc = torchrun(syncer.address, 0, workdir, 200, "--max-restarts=1", kind=kind)
    checkpointed = (workdir / "checkpoint.rank1.pt").exists  # rank 1 has trained a while
    wait_until(checkpointed, 60, "the island to checkpoint", interval=0.1, alive=proc)
    pid = rank_pid(workdir, 1)
    assert pid is not None
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    out = finish(proc, 150)
    tape = read_tape(tmp_path / "syncer" / "events.jsonl")
    assert learner_ids(tape) == {"island-0"}
    rejoined = [
        r
        for r in tape
        if r["event"] == "join" and r["learner"] == "island-0" and r["t"] > killed_at
    ]
    assert rejoined, "the restarted island never rejoined"
    assert "resumed from" in out  # rank 0 resumed from the island's checkpoint
    after = [
        r
        for r in tape
        if r["event"] == "round" and r["t"] > rejoined[0]["t"] and "island-0" in r["participants"]
    ]
    assert after, "the restarted island never contributed again"
    assert_replicas_agree(workdir)
    # the ranks saved (and so restored) their checkpoints at the same steps: their data
    # positions still agree at the end
    positions = [
        torch.load(workdir / name, weights_only=True)["stream"]["index"]
        for name in ("checkpoint.pt", "checkpoint.rank1.pt")
    ]
    assert positions[0] == positions[1] > 0, positions


@pytest.mark.timeout(150)
def test_a_sharded_island_merges_every_step_once(tmp_path, syncer):
    """FSDP2 (``--island fsdp``): no rank holds the whole model; rank 0's Learner works on a
    mirror that the ranks keep in step with their shards. The island contributes, every
    trained step is merged, unsent or dropped exactly once, its ranks end with the same model
    (gathered), and the global model learns from what it merged."""
    workdir = tmp_path / "island-0"
    steps = 150
    finish(torchrun(syncer.address, 0, workdir, steps, kind="fsdp"), 120)
    tape = read_tape(tmp_path / "syncer" / "events.jsonl")
    assert learner_ids(tape) == {"island-0"}
    rounds = [r for r in tape if r["event"] == "round"]
    assert any("island-0" in r["participants"] for r in rounds)
    assert_replicas_agree(workdir)
    # what rank 0's Learner holds is what the shards hold, bit for bit
    mirror = load_file(str(workdir / "mirror.safetensors"))
    gathered = load_file(str(workdir / "replica.rank0.safetensors"))
    assert mirror.keys() == gathered.keys()
    for name in mirror:
        assert torch.equal(mirror[name], gathered[name].float()), name
    final = json.loads((workdir / "final.json").read_text())
    assert final["step"] == steps
    for p in range(len(final["versions"])):
        merged = sum(
            n
            for r in rounds
            if r["fragment"] == p
            for who, n in zip(r["participants"], r["steps"], strict=True)
            if who == "island-0"
        )
        assert merged + final["unsent"][p] + final["dropped"][p] == steps, p
    model = get_recipe("tiny").build_model(0)
    start = get_recipe("tiny").evaluate(model)
    model.load_state_dict(syncer.state_dict(model))
    assert get_recipe("tiny").evaluate(model) < start - 0.3

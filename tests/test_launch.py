"""``diloco launch``: a syncer for the user's own model and N copies of the user's own script
(``Learner.from_env``), supervised like ``diloco run``'s learners: real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kit import diloco_command, pids_mentioning, run_diloco, wait_until

from diloco.learner.from_env import NotLaunched, read_launch_env
from diloco.report.audit_files import audit_directories
from diloco.runtime.jsonl import read_jsonl

pytestmark = pytest.mark.slow

MODEL = '''
import torch
from torch import nn


class Regressor(nn.Module):
    """The user's model: not one of the project's (a norm with a buffer, two layers)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.hidden = nn.Linear(16, 48)
        self.out = nn.Linear(48, 1)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.norm(x)))).squeeze(-1) * self.scale * 2


def build():
    torch.manual_seed(0)
    return Regressor()


def held_out(model):
    g = torch.Generator().manual_seed(12345)
    x = torch.randn(256, 16, generator=g)
    return ((model(x) - x @ torch.linspace(-1, 1, 16)) ** 2).mean()
'''

TRAIN = '''
"""A user's training loop: no flags, the launcher's environment says how to join."""
import os
import sys
import time

import torch
from net import build

import diloco

steps, pause_s = int(sys.argv[1]), float(sys.argv[2])
torch.set_num_threads(1)
index = int(os.environ["DILOCO_LEARNER_INDEX"])
model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
learner = diloco.Learner.from_env(model, optimizer)
learner.wait_for_global(timeout=60)
target = torch.linspace(-1, 1, 16)


def batch(step):  # the data of step `step`: a restarted copy draws the same
    g = torch.Generator().manual_seed(index * 1_000_003 + step)
    return torch.randn(32, 16, generator=g)


if learner.ahead_on_restore:  # its previous life delivered these: do not train them again
    learner.skip(learner.ahead_on_restore, 32 * learner.ahead_on_restore)
while learner.local_step < steps:
    x = batch(learner.local_step)
    loss = ((model(x) - x @ target) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    learner.step(tokens=len(x), loss=loss)
    time.sleep(pause_s)  # pacing: rounds happen while the copies train
learner.close()
print(f"done at step {learner.local_step}")
'''

STEPS = 400
PAUSE_S = 0.01
LAUNCH_FLAGS = ["--fragments", "4", "--sync-every", "8", "--no-view", "--dashboard", "off"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: ``net.py`` (the model, a held-out score) and ``train.py``."""
    (tmp_path / "net.py").write_text(textwrap.dedent(MODEL))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    yield tmp_path
    for pid in pids_mentioning(str(tmp_path)):  # nothing of a test outlives it
        os.kill(pid, signal.SIGKILL)


def launch_command(project: Path, *flags: str, steps: int = STEPS) -> list[str]:
    return diloco_command(
        "launch",
        "--runs-dir",
        str(project / "runs"),
        "--name",
        "demo",
        *LAUNCH_FLAGS,
        *flags,
        str(project / "train.py"),
        str(steps),
        str(PAUSE_S),
    )


def start(project: Path, *flags: str, steps: int = STEPS) -> subprocess.Popen:
    return subprocess.Popen(
        launch_command(project, *flags, steps=steps),
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def copy_pid(learner_id: str) -> int | None:
    """The process of the copy ``learner_id`` (its environment says which it is)."""
    for pid in pids_mentioning("train.py"):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DILOCO_LEARNER_ID={learner_id}".encode() in env:
            return pid
    return None


def last_step(progress: Path) -> int:
    return max((r.get("step", 0) for r in read_jsonl(progress)), default=0)


@pytest.mark.timeout(400)
def test_launch_runs_the_users_script_restarts_a_killed_copy_and_leaves_a_run(project):
    proc = start(project, "--model", "net:build", "--eval", "net:held_out", "--eval-every", "2")
    run = project / "runs" / "demo"
    victim = run / "learners" / "learner-1"
    wait_until(
        lambda: (victim / "checkpoint.pt").exists() and last_step(victim / "progress.jsonl") >= 60,
        timeout=180,
        what="learner-1 trained 60 steps and wrote a checkpoint",
        interval=0.05,
        alive=proc,
    )
    pid = copy_pid("learner-1")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out + err)[-4000:]
    assert pids_mentioning(str(project)) == []  # the syncer stopped by itself, so did the copies

    summary = json.loads((run / "summary.json").read_text())
    assert summary["syncer_exit_code"] == 0 and summary["stopped_by"] == "learners finished"
    assert summary["per_learner"]["learner-1"]["restarts"] == 1
    assert {row["exit_code"] for row in summary["per_learner"].values()} == {0}
    log = (run / "logs" / "learner-1.log").read_text()
    assert "resumed at step" in log  # from its checkpoint
    for learner in ("learner-0", "learner-1"):
        final = json.loads((run / "learners" / learner / "final.json").read_text())
        assert final["step"] == STEPS
        assert len(summary["training_loss"][learner]) >= 2  # its loss curve
    assert summary["val_loss"]["final"] < summary["val_loss"]["initial"]
    rounds = [r for r in read_jsonl(run / "syncer" / "events.jsonl") if r["event"] == "round"]
    contributors = {ln for r in rounds for ln in r["participants"]}
    assert contributors == {"learner-0", "learner-1"}  # the syncer merged both copies' work

    verdict = audit_directories(
        run / "syncer",
        {ln: run / "learners" / ln for ln in ("learner-0", "learner-1")},
        stopped_cleanly=True,
    )
    assert verdict.ok, verdict.problems  # every step accounted for exactly once

    report = run_diloco("report", str(run), cwd=project)
    assert report.returncode == 0, report.stderr
    assert "training-loss" in (run / "report.html").read_text()  # both copies' curves
    exported = project / "model.safetensors"
    done = run_diloco("export", str(run), "-o", str(exported), cwd=project)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    sys.path.insert(0, str(project))
    try:
        import net

        net.build().load_state_dict(load_file(str(exported)), strict=True)
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("net", None)


@pytest.mark.timeout(420)
def test_launch_on_ray_runs_the_copies_as_actors_and_ray_restarts_a_killed_one(project):
    """``--backend ray``: the copies are Ray actors on a local Ray instance (loopback); one
    killed with SIGKILL is started again by Ray with its id and environment, resumes from its
    checkpoint, and every step is accounted for exactly once."""
    pytest.importorskip("ray")
    proc = start(project, "--model", "net:build", "--backend", "ray", "--ray-learner-cpus", "1")
    run = project / "runs" / "demo"
    victim = run / "learners" / "learner-1"
    wait_until(
        lambda: (victim / "checkpoint.pt").exists() and last_step(victim / "progress.jsonl") >= 60,
        timeout=240,
        what="learner-1 trained 60 steps and wrote a checkpoint",
        interval=0.05,
        alive=proc,
    )
    pid = copy_pid("learner-1")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out + err)[-4000:]
    assert pids_mentioning(str(project)) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["backend"] == "ray" and summary["syncer_exit_code"] == 0
    assert summary["stopped_by"] == "learners finished"
    assert summary["per_learner"]["learner-1"]["restarts"] == 1
    assert summary["per_learner"]["learner-0"]["restarts"] == 0
    assert {row["exit_code"] for row in summary["per_learner"].values()} == {0}
    tape = read_jsonl(run / "syncer" / "events.jsonl")
    # (a syncer that stopped by itself while learner-1 was down is restarted too: not counted)
    [restart] = [r for r in tape if r["event"] == "restart" and r["target"] != "syncer"]
    assert restart["target"] == "learner-1" and restart["by"] == "ray"
    log = (run / "logs" / "learner-1.log").read_text()
    assert "resumed at step" in log and "Ray restarts it" in log
    for learner in ("learner-0", "learner-1"):
        final = json.loads((run / "learners" / learner / "final.json").read_text())
        assert final["step"] == STEPS
    verdict = audit_directories(
        run / "syncer",
        {ln: run / "learners" / ln for ln in ("learner-0", "learner-1")},
        stopped_cleanly=True,
    )
    assert verdict.ok, verdict.problems  # every step accounted for exactly once


@pytest.mark.timeout(240)
def test_launch_on_ray_fails_once_a_copy_fails_past_max_restarts(project):
    pytest.importorskip("ray")
    (project / "bad.py").write_text("import sys\nsys.exit(3)\n")
    done = subprocess.run(
        diloco_command(
            "launch",
            "--runs-dir",
            str(project / "runs"),
            *LAUNCH_FLAGS,
            "--model=net:build",
            "--backend=ray",
            "--ray-learner-cpus=1",
            "--learners=1",
            "--max-restarts=1",
            "bad.py",
        ),
        cwd=project,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    assert "learner-0 keeps failing" in done.stderr
    assert pids_mentioning(str(project)) == []


@pytest.mark.parametrize(
    "flags, script, says",
    [
        (["--model", "net:build"], "missing.py", "missing.py: no such file"),
        (["--model", "net:nope"], "train.py", "net has no 'nope'"),
        (["--model", "nowhere:build"], "train.py", "cannot import 'nowhere'"),
        ([], "train.py", "--model MODULE:CALLABLE is required"),
        (["--model", "net:build", "--address", "auto"], "train.py", "only with --backend ray"),
        (
            ["--model", "net:build", "--backend", "ray", "--ray-max-restarts", "2"],
            "train.py",
            "at most --max-restarts times",
        ),
    ],
)
def test_launch_refuses_bad_input_in_one_line_and_leaves_nothing(project, flags, script, says):
    done = run_diloco(
        "launch", "--runs-dir", str(project / "runs"), *flags, script, "1", "0", cwd=project
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (project / "runs").exists()


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_copies_and_the_syncer_cleanly(project):
    proc = start(project, "--model", "net:build", steps=10**6)
    run = project / "runs" / "demo"
    wait_until(
        lambda: all(
            last_step(run / "learners" / ln / "progress.jsonl") > 0
            for ln in ("learner-0", "learner-1")
        ),
        timeout=180,
        what="both copies train",
        interval=0.05,
        alive=proc,
    )
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, (out + err)[-4000:]
    assert pids_mentioning(str(project)) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupt"
    for learner in ("learner-0", "learner-1"):  # each flushed and stopped cleanly
        assert (run / "learners" / learner / "final.json").is_file()
        assert summary["per_learner"][learner]["exit_code"] == 0


def test_from_env_names_the_missing_variable():
    with pytest.raises(NotLaunched, match=r"\$DILOCO_SYNCER is not set"):
        read_launch_env({})
    with pytest.raises(NotLaunched, match=r"\$DILOCO_LEARNER_ID is not set"):
        read_launch_env({"DILOCO_SYNCER": "127.0.0.1:7000"})
    with pytest.raises(NotLaunched, match=r"\$DILOCO_LEARNERS is not a number"):
        read_launch_env(
            {"DILOCO_SYNCER": "a:1", "DILOCO_LEARNER_ID": "x", "DILOCO_LEARNERS": "two"}
        )
    launched = read_launch_env({"DILOCO_SYNCER": "a:1", "DILOCO_LEARNER_ID": "x"})
    assert read_launch_env(launched.variables()) == launched


def test_a_script_not_launched_fails_in_one_line(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(
        "import torch, diloco\n"
        "try:\n"
        "    diloco.Learner.from_env(torch.nn.Linear(2, 1))\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("Learner.from_env: $DILOCO_SYNCER is not set")
    assert torch  # (imported for the model checks above)

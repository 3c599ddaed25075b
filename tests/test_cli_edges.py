"""The CLI's smaller rough edges (issue 49), each tried as a user meets it: real ``diloco``
processes where practical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from kit import local_syncer, run_diloco, start_diloco, tiny_model

from diloco.cli import command_parsers

SECRET = "s3cret-token-of-the-tests"


def missing_package(tmp_path, name: str) -> dict:
    """An environment in which ``import NAME`` fails as it does where NAME is not installed."""
    stub = tmp_path / "missing" / name
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
    )
    return {"PYTHONPATH": f"{stub.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.parametrize("command", sorted(command_parsers()))
def test_every_commands_help_reads_like_the_rest(command):
    text = command_parsers()[command].format_help()
    assert "<factory>" not in text and "Config(" not in text, text


def test_status_without_its_token_says_the_syncer_refused(tmp_path):
    server = local_syncer(tiny_model(), num_fragments=2, token=SECRET)
    try:
        done = run_diloco("status", server.address, timeout=60, env={"DILOCO_TOKEN": ""})
    finally:
        server.stop()
    assert done.returncode == 1
    assert "does not answer" not in done.stderr
    assert "refused" in done.stderr and "--token-file" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.timeout(60)
def test_status_watch_refreshes_until_ctrl_c():
    server = local_syncer(tiny_model(), num_fragments=2)
    proc = start_diloco("status", server.address, "--watch", "0.1")
    try:
        seen = [proc.stdout.readline() for _ in range(6)]  # two reports at least
        assert sum(line.startswith("syncer ") for line in seen) >= 2, seen
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.stop()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.timeout(120)
def test_run_with_wandb_but_no_wandb_exits_2_in_one_line_leaving_nothing(tmp_path):
    runs = tmp_path / "runs"
    done = run_diloco(
        "run", "--wandb", "offline", "--runs-dir", str(runs), "--minutes", "0.05",
        "--recipe", "tiny", timeout=90, env=missing_package(tmp_path, "wandb"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "pip install 'diloco[wandb]'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not runs.exists() or not any(runs.iterdir())


def test_the_lightning_callback_without_lightning_says_what_to_install(tmp_path):
    env = {**os.environ, **missing_package(tmp_path, "lightning")}
    done = subprocess.run(
        [sys.executable, "-c", "import diloco.integrations.lightning"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "pip install 'diloco[lightning]'" in done.stderr.strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_wrong_model_at_join_is_said_once():
    server = local_syncer(tiny_model(), num_fragments=24)  # not the tiny recipe's model
    try:
        done = run_diloco(
            "learner", "--recipe", "tiny", "--syncer", server.address, "--id", "wrong",
            "--total-steps", "3", "--join-timeout", "30", timeout=90,
        )  # fmt: skip
    finally:
        server.stop()
    assert done.returncode == 1
    assert done.stderr.count("model does not match") == 1, done.stderr


def restored_checkpoint(workdir, dead_address: str) -> None:
    """A learner's checkpoint in ``workdir``, as a previous life of ``diloco learner
    --recipe tiny`` would leave it."""
    from diloco.config.common import RecipeConfig
    from diloco.launch.learner_worker import CHECKPOINT, checkpoint_state
    from diloco.learner.learner import Learner
    from diloco.recipes import recipe_of

    recipe = recipe_of(RecipeConfig(recipe="tiny"))
    model = recipe.build_model(0)
    optimizer = recipe.build_optimizer(model)
    stream = recipe.stream(learner_id=0, seed=0, batch_size=None)
    learner = Learner(model, optimizer, syncer=dead_address, learner_id="back")
    try:
        state = checkpoint_state(model, optimizer, learner, stream)
    finally:
        learner.close(flush=False)
    workdir.mkdir(parents=True)
    torch.save(state, workdir / CHECKPOINT)


@pytest.mark.timeout(120)
def test_a_resumed_learner_without_its_syncer_warns_on_stderr_and_trains_on(tmp_path):
    import socket

    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{dead.getsockname()[1]}"
        restored_checkpoint(tmp_path / "back", address)
        done = run_diloco(
            "learner", "--recipe", "tiny", "--syncer", address, "--id", "back",
            "--workdir", str(tmp_path / "back"), "--join-timeout", "1", "--total-steps", "3",
            "--flush-timeout", "0", "--drain-timeout", "0", timeout=90,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no global model" in done.stderr and "no global model" not in done.stdout


@pytest.mark.timeout(120)
def test_log_level_shows_what_the_library_logs_on_stderr(tmp_path):
    server = local_syncer(tiny_model(), num_fragments=24)
    try:
        done = run_diloco(
            "learner", "--recipe", "tiny", "--syncer", server.address, "--id", "chatty",
            "--total-steps", "3", "--log-level", "info", timeout=90,
        )  # fmt: skip
    finally:
        server.stop()
    assert done.returncode == 1
    assert "diloco.learner" in done.stderr  # the link's refusal, logged at INFO
    assert "diloco.learner" not in done.stdout


def test_log_level_is_a_common_option_of_every_configured_command():
    parsers = command_parsers()
    for command in ("syncer", "learner", "run"):
        assert "--log-level" in parsers[command].format_help()
    done = run_diloco("learner", "--log-level", "loud", "--no-sync", "--id", "x", timeout=60)
    assert done.returncode == 2 and "--log-level" in done.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--chaos", "kill:mtbf=soon"],
        ["--slow", "7=2"],
        ["--add-learners", "10s:1", "--mode", "sync"],
    ],
)
def test_run_refuses_a_bad_flag_before_importing_torch(flags):
    """A mistake in a flag is said in a fifth of a second, not after torch's import."""
    check = (
        "import sys\n"
        "from diloco.cli import main\n"
        "status = main(['run', *sys.argv[1:]])\n"
        "sys.exit(10 if 'torch' in sys.modules else status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check, *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr

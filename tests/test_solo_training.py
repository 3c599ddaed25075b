"""A learner that never reached its syncer fails instead of training alone (issue 49):
``diloco learner`` exits non-zero with one line, the library raises ``SyncerUnreachable``;
training alone is what ``--no-sync`` asks for."""

from __future__ import annotations

import socket

import pytest
from kit import run_diloco, tiny_model

import diloco


@pytest.fixture
def dead_address():
    """A loopback address nobody listens on for the test's length (bound, never listening:
    no other process can take the port meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.timeout(120)
def test_a_learner_process_pointed_at_a_dead_syncer_exits_non_zero_with_one_line(
    dead_address, tmp_path
):
    done = run_diloco(
        "learner",
        "--recipe", "tiny",
        "--syncer", dead_address,
        "--id", "lost",
        "--join-timeout", "1",
        "--total-steps", "5",
        "--workdir", str(tmp_path / "lost"),
        timeout=90,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "never reached the syncer" in lines[0] and dead_address in lines[0]
    assert "--no-sync" in lines[0]  # what to give to train alone on purpose
    assert "training from" not in done.stdout


@pytest.mark.timeout(120)
def test_training_alone_is_asked_for_with_no_sync(tmp_path):
    done = run_diloco(
        "learner",
        "--recipe",
        "tiny",
        "--no-sync",
        "--id",
        "alone",
        "--total-steps",
        "3",
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_library_raises_syncer_unreachable_naming_the_address(dead_address):
    from diloco.learner.waiting import SyncerUnreachable

    learner = diloco.Learner(tiny_model(), syncer=dead_address, learner_id="lost")
    try:
        with pytest.raises(SyncerUnreachable, match="never reached the syncer") as caught:
            learner.wait_for_global(timeout=0.5)
        assert dead_address in str(caught.value)
        assert isinstance(caught.value, TimeoutError)  # what scripts catch today still works
        assert learner.wait_for_global(timeout=0.1, required=False) is False  # asked for
    finally:
        learner.close(flush=False)
    assert diloco.SyncerUnreachable is SyncerUnreachable

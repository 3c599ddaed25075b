"""Checkpoints written off the training thread: what is written is the state at submit time,
one write at a time, atomically, and a failed write neither raises nor damages the last one."""

from __future__ import annotations

import threading

import torch

from diloco.runtime.checkpoint_writer import CheckpointWriter, copy_state, write_atomic


def read(path):
    return torch.load(path, weights_only=True)


def test_copy_state_is_independent_of_later_training():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "pair": (1, [2.5])}
    copied = copy_state(state)
    before = model.weight.detach().clone()
    moment = opt.state_dict()["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # changes the weights and the moments in place
    assert not torch.equal(model.weight, before)
    assert torch.equal(copied["model"]["weight"], before)
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], moment)
    assert copied["pair"] == (1, [2.5])


def test_the_written_file_holds_the_state_at_submit_time(tmp_path):
    weights = torch.arange(6.0)
    writer = CheckpointWriter()
    assert writer.submit(tmp_path / "checkpoint.pt", {"format": 1, "w": weights, "step": 7})
    weights.add_(100.0)  # training goes on while the write runs
    assert writer.wait(timeout=30)
    saved = read(tmp_path / "checkpoint.pt")
    assert saved["step"] == 7 and torch.equal(saved["w"], torch.arange(6.0))
    assert writer.written == 1 and writer.failures == 0 and writer.last_ok
    assert not (tmp_path / "checkpoint.tmp").exists()


def test_one_write_at_a_time_and_submit_declines_while_busy(tmp_path, monkeypatch):
    from diloco.runtime import checkpoint_writer

    release = threading.Event()
    real = checkpoint_writer.write_atomic

    def held(path, state):
        assert release.wait(30)
        real(path, state)

    monkeypatch.setattr(checkpoint_writer, "write_atomic", held)
    writer, path = CheckpointWriter(), tmp_path / "c.pt"
    assert writer.submit(path, {"step": 1})
    assert writer.busy and writer.last_ok is None
    assert not writer.submit(path, {"step": 2})  # declined: nothing copied, nothing queued
    release.set()
    assert writer.wait(timeout=30)
    assert read(tmp_path / "c.pt")["step"] == 1
    assert writer.submit(path, {"step": 3}) and writer.wait(timeout=30)
    assert read(tmp_path / "c.pt")["step"] == 3


def test_save_now_waits_for_the_write_in_progress_and_wins(tmp_path):
    writer, path = CheckpointWriter(), tmp_path / "c.pt"
    big = torch.zeros(2_000_000)  # 8 MB: the background write is still running, most likely
    assert writer.submit(path, {"step": 1, "x": big})
    writer.save_now(path, {"step": 2})
    assert not writer.busy
    assert read(tmp_path / "c.pt")["step"] == 2


def test_a_failed_write_is_counted_and_keeps_the_last_checkpoint(tmp_path, capsys):
    path = tmp_path / "c.pt"
    write_atomic(path, {"step": 1})
    (tmp_path / "c.tmp").mkdir()  # the temporary name cannot be opened as a file
    writer = CheckpointWriter()
    assert writer.submit(path, {"step": 2})
    assert writer.wait(timeout=30)
    assert writer.failures == 1 and writer.written == 0 and writer.last_ok is False
    assert read(path)["step"] == 1
    assert "write failed" in capsys.readouterr().err

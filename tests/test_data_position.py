"""Data exactly once across restarts: the learner's checkpoint carries the script's data
position (``Learner.track``), so a learner killed with ``kill -9`` and restarted from its
checkpoint neither repeats nor skips a sample, relative to what its checkpoint and its
delivery accounting say.

What "exactly once" means with a checkpoint at step S: the restarted life resumes the data
at S's position; the A steps past S whose uploads the previous life delivered
(``ahead_on_restore``) are in the global model already, so it draws their batches and drops
them (``Learner.skip``); what the previous life trained past S + A died with it and is
trained again. So the samples that count are the killed life's steps 1..S+A and the new
life's steps from S+A+1 on: together, the sampler's order, each sample once per epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from kit import local_syncer, tiny_model, wait_until

from diloco.data import StatefulSampler
from diloco.syncer.config import SyncerConfig
from diloco.wire.protocol import ProtocolConfig

SAMPLES, BATCH, STEPS, CHECKPOINT_AT, SEED = 100, 4, 60, 16, 3

SCRIPT = f"""
import json, os, sys, time
from pathlib import Path
import torch
import diloco
address, work = sys.argv[1], Path(sys.argv[2])
checkpoint_at = {{int(s) for s in sys.argv[3].split(",") if s}}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(
    torch.randn({SAMPLES}, 8), torch.randn({SAMPLES}, 1), torch.arange({SAMPLES})
)
sampler = diloco.StatefulSampler(len(data), seed={SEED})
loader = torch.utils.data.DataLoader(data, batch_size={BATCH}, sampler=sampler)
checkpoint = work / "checkpoint.pt"
saved = torch.load(checkpoint, weights_only=True) if checkpoint.exists() else None
if saved is not None:
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
learner = diloco.Learner(
    model, optimizer, syncer=address, learner_id="me", num_fragments=2,
    delivery_file=str(work / "delivered.json"), journal_file=str(work / "uploads.jsonl"),
    state=saved["learner"] if saved is not None else None,
)
learner.track(sampler)
learner.wait_for_global(timeout=60)
log = open(work / "samples.jsonl", "a")
life = os.getpid()

def say(**line):
    log.write(json.dumps(dict(life=life, **line)) + "\\n")
    log.flush()

def batches():
    while True:
        yield from loader

batch = batches()
ahead = learner.ahead_on_restore  # (after the first join: its commits count too)
say(resumed=learner.local_step, ahead=ahead)
for _ in range(ahead):
    say(skipped=next(batch)[2].tolist())
learner.skip(ahead, tokens=ahead * {BATCH})
while learner.local_step < {STEPS}:
    x, y, ids = next(batch)
    say(step=learner.local_step + 1, ids=ids.tolist())  # before it is trained or sent
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    learner.step(tokens={BATCH})
    time.sleep(0.02)  # (the pace of a real model: rounds happen while it trains)
    if learner.local_step in checkpoint_at:
        state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                     learner=learner.state_dict())
        torch.save(state, work / "checkpoint.tmp")
        os.replace(work / "checkpoint.tmp", checkpoint)
        say(checkpoint=learner.local_step)
learner.close(flush=True)
say(accounting=learner.accounting().to_dict())
"""


def lines(work) -> list[dict]:
    path = work / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def delivered_past(work, step: int) -> bool:
    """Whether the delivery log shows an upload queued after ``step`` accepted."""
    try:
        accepted = json.loads((work / "delivered.json").read_text())
    except (OSError, ValueError):
        return False
    return any(at > step for at in accepted.values())


def test_the_sampler_resumes_mid_epoch_and_refuses_another_dataset():
    sampler = StatefulSampler(10, seed=1)
    drawn = iter(sampler)
    first = [next(drawn) for _ in range(4)]
    resumed = StatefulSampler(10, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    rest = list(resumed) + list(resumed)  # the epoch's rest, then the next epoch
    assert sorted(first + rest[:6]) == list(range(10)) and sorted(rest[6:]) == list(range(10))
    assert first + rest[:6] == sampler.order(0) and rest[6:] == sampler.order(1)
    with pytest.raises(ValueError, match="this sampler has 11"):
        StatefulSampler(11, seed=1).load_state_dict(sampler.state_dict())


def test_a_tracked_position_is_in_the_learner_state_and_given_back_on_restore():
    import diloco

    model = tiny_model()
    sampler = StatefulSampler(10)
    learner = diloco.Learner(model, syncer="127.0.0.1:1", num_fragments=2, learner_id="me")
    try:
        learner.track(sampler)
        with pytest.raises(ValueError, match="tracked already"):
            learner.track(StatefulSampler(10))
        with pytest.raises(TypeError, match="state_dict"):
            learner.track(object(), name="other")
        next(iter(sampler))
        state = learner.state_dict()
    finally:
        learner.close(flush=False)
    later = StatefulSampler(10)
    restored = diloco.Learner(
        model, syncer="127.0.0.1:1", num_fragments=2, learner_id="me", state=state
    )
    try:
        restored.track(later)  # tracked after the restore: given back at once
        assert later.state_dict() == sampler.state_dict() and later.position == 1
    finally:
        restored.close(flush=False)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_learner_killed_and_restarted_trains_every_sample_exactly_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = SyncerConfig(protocol=ProtocolConfig(num_fragments=2, sync_every=4))
    with local_syncer(model, config) as server:

        def start(checkpoints: str) -> subprocess.Popen:
            command = [sys.executable, str(script), server.address, str(work), checkpoints]
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        first = start(str(CHECKPOINT_AT))
        try:
            # killed once its checkpoint is taken and an upload queued after it was accepted
            wait_until(
                lambda: (
                    any("checkpoint" in x for x in lines(work))
                    and delivered_past(work, CHECKPOINT_AT)
                ),
                timeout=120,
                what="a delivery past the checkpoint",
                alive=first,
            )
            os.kill(first.pid, signal.SIGKILL)
        finally:
            first.kill()
            output = first.communicate(timeout=30)[0].decode()
        assert first.returncode == -signal.SIGKILL, output[-2000:]
        second = start("")
        output = second.communicate(timeout=180)[0].decode()
        assert second.returncode == 0, output[-3000:]

    log = lines(work)
    killed, restarted = sorted({x["life"] for x in log}, key=[x["life"] for x in log].index)
    resumed = next(x for x in log if x["life"] == restarted and "resumed" in x)
    step, ahead = resumed["resumed"], resumed["ahead"]
    assert step == CHECKPOINT_AT and ahead > 0  # the hard case: delivered past the checkpoint
    trained = {x["step"]: x["ids"] for x in log if x["life"] == killed and "step" in x}
    skipped = [x["skipped"] for x in log if x["life"] == restarted and "skipped" in x]
    retrained = [x for x in log if x["life"] == restarted and "step" in x]
    # the skipped batches are the ones the killed life trained and delivered past S
    assert skipped == [trained[s] for s in range(step + 1, step + ahead + 1)]
    assert retrained[0]["step"] == step + ahead + 1 and retrained[-1]["step"] == STEPS
    counted = [trained[s] for s in range(1, step + ahead + 1)] + [x["ids"] for x in retrained]
    ids = [i for batch in counted for i in batch]
    sampler = StatefulSampler(SAMPLES, seed=SEED)
    assert ids == (sampler.order(0) + sampler.order(1) + sampler.order(2))[: STEPS * BATCH]
    for start in range(0, len(ids), SAMPLES):  # none twice within an epoch
        epoch = ids[start : start + SAMPLES]
        assert len(set(epoch)) == len(epoch)
    books = next(x["accounting"] for x in log if "accounting" in x)
    assert books["trained"] == STEPS and books["unsent"] == [0, 0]
    assert all(d >= ahead for d in books["dropped"])  # the skipped steps count dropped

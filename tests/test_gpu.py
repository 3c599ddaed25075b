"""A learner on a CUDA device (runs where a GPU is; skipped elsewhere).

The model, its optimizer and the batches live on the GPU; the syncer runs on the host. The
learner's copies of fragments to the host go through pinned memory on a side stream
(``diloco.learner.snapshot``), merged values come back through pinned memory without a host
sync. Checked: every trained step merged exactly once, the parameters stay on the device,
the global model learns. Numbers (steps/s with syncing on and off, memory) come from
``benchmarks/bench_learner_overhead.py --device cuda``.
"""

from __future__ import annotations

import pytest
import torch

from diloco.learner.learner import Learner
from diloco.recipes import get_recipe
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import read_tape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 300


@pytest.mark.timeout(180)
def test_a_learner_on_a_gpu_merges_every_step_once_without_leaving_the_device(tmp_path):
    recipe = get_recipe("tiny")
    server = SyncerServer.for_model(
        recipe.build_model(0), tape_path=tmp_path / "events.jsonl"
    ).start()
    try:
        model = recipe.build_model(0).cuda()
        optimizer = recipe.build_optimizer(model)
        learner = Learner(model, optimizer, syncer=server.address, learner_id="gpu")
        assert learner._host_copies.asynchronous
        assert learner.wait_for_global(timeout=30)
        stream = recipe.stream(learner_id=0, seed=0)
        for _ in range(STEPS):
            x, y = (t.cuda(non_blocking=True) for t in stream.next_batch())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = recipe.loss(model, (x, y))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            learner.step(tokens=x.numel())
        learner.close(flush=True)
        assert all(p.is_cuda for p in model.parameters())
        global_model = recipe.build_model(0)
        start = recipe.evaluate(global_model)
        global_model.load_state_dict(server.state_dict(global_model))
    finally:
        server.stop()
    assert recipe.evaluate(global_model) < start - 0.5
    rounds = [r for r in read_tape(tmp_path / "events.jsonl") if r["event"] == "round"]
    for p in range(learner.layout.num_fragments):
        merged = sum(
            n
            for r in rounds
            if r["fragment"] == p
            for who, n in zip(r["participants"], r["steps"], strict=True)
            if who == "gpu"
        )
        assert merged + learner.unsent()[p] == STEPS, p

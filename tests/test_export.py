"""The model out: ``diloco export`` and ``SyncerServer.state_dict`` give an ordinary state_dict
that a fresh model loads with ``strict=True``, and it is the syncer's global model."""

from __future__ import annotations

import json

import pytest
import torch
from kit import run_diloco
from safetensors.torch import load_file
from torch import nn

from diloco.algorithm import balanced_fragments
from diloco.recipes import get_recipe
from diloco.syncer.config import SyncerConfig
from diloco.syncer.export import ExportError, parameters_by_name, read_state_dirs
from diloco.syncer.server import SyncerServer
from diloco.wire.protocol import ProtocolConfig

P = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    proc = run_diloco(
        "run",
        "--recipe=tiny",
        "--learners=2",
        "--steps=120",
        "--minutes=3",
        "--eval-every=0",
        f"--fragments={P}",
        "--down-codec=fp32",  # the evaluator then holds Θ itself (up to float rounding)
        f"--runs-dir={tmp}",
        "--name=it",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "it"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_exported_run_loads_strictly_and_is_the_syncers_global_model(run_dir, tmp_path):
    out = tmp_path / "model.safetensors"
    proc = run_diloco("export", str(run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    recipe = get_recipe("tiny")
    fresh = recipe.build_model(1)  # another initialization: everything must come from the file
    state = load_file(str(out))
    fresh.load_state_dict(state, strict=True)  # tied head and embedding: both keys are there
    # It is Θ of the syncer's state directory, fragment by fragment ...
    model = recipe.build_model(0)
    layout = balanced_fragments(model.named_parameters(), P)
    named = dict(model.named_parameters())
    params, versions = read_state_dirs(
        [run_dir / "syncer"], layout, [layout.gather(p, named) for p in range(P)]
    )
    assert min(versions) >= 1
    loaded = dict(fresh.named_parameters())
    for p in range(P):
        assert torch.equal(layout.gather(p, loaded), params[p])
    # ... and its held-out loss is the syncer's own evaluation at the end of the run (the
    # evaluator holds what learners hold: with fp32 downloads, Θ up to float rounding).
    summary = json.loads((run_dir / "summary.json").read_text())
    loss = recipe.evaluate(fresh)
    assert loss == pytest.approx(summary["val_loss"]["final"], rel=1e-4)
    assert loss < summary["val_loss"]["initial"] - 0.5


def test_export_refuses_what_is_not_a_run(tmp_path):
    proc = run_diloco("export", str(tmp_path), "-o", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m.safetensors").exists()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # one parameter, two state_dict keys
        self.register_buffer("scale", torch.tensor(2.0))


@pytest.mark.timeout(60)
def test_a_live_syncer_gives_its_global_model_as_a_state_dict(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    server = SyncerServer.for_model(
        model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=2))
    ).start()
    try:
        with server.service.lock:  # stands for committed rounds: the state moved
            for t in server.state.params:
                t.add_(1.0)
        by_name = server.state_dict()
        assert set(by_name) == {n for n, _ in model.named_parameters()}
        other = Tied()
        state = server.state_dict(other)
        assert set(state) == set(model.state_dict())  # head.weight and the buffer included
        fresh = Tied()
        fresh.load_state_dict(state, strict=True)
        for name, p in model.named_parameters():
            assert torch.equal(dict(fresh.named_parameters())[name], p.detach() + 1.0)
            assert torch.equal(by_name[name], p.detach() + 1.0)
        assert fresh.head.weight is fresh.emb.weight
    finally:
        server.stop()
    with pytest.raises(ExportError, match="does not match"):
        server.state_dict(nn.Linear(3, 3))
    assert parameters_by_name(server.layout, server.state.params).keys() == by_name.keys()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_data_parallel_run_exports_rank_0s_parameters(tmp_path):
    proc = run_diloco(
        "run",
        "--mode=dp",
        "--recipe=tiny",
        "--learners=2",
        "--steps=40",
        "--minutes=3",
        "--eval-every=0",
        f"--runs-dir={tmp_path}",
        "--name=dp",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "dp.safetensors"
    proc = run_diloco("export", str(tmp_path / "dp"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    fresh = get_recipe("tiny").build_model(1)
    fresh.load_state_dict(load_file(str(out)), strict=True)
    snapshot = load_file(str(tmp_path / "dp" / "dp" / "global.safetensors"))
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), snapshot[name])

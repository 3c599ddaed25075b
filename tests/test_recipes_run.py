"""The recipes beyond our GPT train under ``diloco run`` (real processes), embeddings are
found from the model's modules, and a Hugging Face ``Trainer`` becomes a learner with one
callback (a real Trainer against a real syncer)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from kit import run_diloco, run_diloco_json
from safetensors.torch import load_file
from torch import nn

from diloco.algorithm.embeddings import embedding_parameter_names
from diloco.recipes import get_recipe
from diloco.syncer.config import SyncerConfig
from diloco.wire.protocol import ProtocolConfig

NEEDS = {"hf-gpt2": "transformers", "digits": "sklearn", "moe": "torch"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["digits", "hf-gpt2", "moe"])
def test_a_recipe_trains_under_diloco_run_and_exports(tmp_path, name):
    pytest.importorskip(NEEDS[name])
    steps = 150 if name == "digits" else 60
    done = run_diloco_json(
        "run",
        f"--recipe={name}",
        "--learners=1",  # the recipe's training is what is tested: one learner, one core
        f"--steps={steps}",
        "--minutes=2",
        "--eval-every=0",
        "--dashboard=off",
        "--no-tensorboard",
        f"--runs-dir={tmp_path}",
        "--name=it",
        "--json",
    )
    summary = done
    assert summary["stopped_by"] == "learners finished"
    loss = summary["val_loss"]
    assert loss["final"] < loss["initial"] - (1.0 if name == "digits" else 1.5), loss
    if name == "digits":
        assert loss["unit"] == "nats/image"
        accuracy = summary["val_scores"]["accuracy"]
        assert accuracy["initial"] < 0.3 and accuracy["final"] > 0.8, accuracy
        assert summary["tokens"] == steps * 32  # an image counts as one token
    else:
        assert loss["unit"] == "nats/byte"
        assert summary["tokens"] == steps * 8 * 128
    # the global model comes out as the model's own state_dict and loads strictly
    out = tmp_path / "model.safetensors"
    exported = run_diloco("export", str(tmp_path / "it"), "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    recipe = get_recipe(name)
    model = recipe.build_model(0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_state_dict(load_file(str(out)), strict=True)
    assert recipe.evaluate(model) == pytest.approx(loss["final"], rel=0.05)
    if name == "moe":  # every router and every expert of every block was merged
        routed = [n for n in initial if ".moe." in n]
        assert len(routed) == 4 * (1 + 4 * 4)  # 4 blocks x (router + 4 experts x 4 tensors)
        unchanged = [
            n for n in routed if torch.equal(initial[n], dict(model.named_parameters())[n])
        ]
        assert unchanged == []


def test_embeddings_are_found_from_modules_not_names():
    assert embedding_parameter_names(get_recipe("tiny").build_model(0)) == {
        "tok_emb.weight",
        "pos_emb.weight",
    }

    class Untied(nn.Module):  # a square block layer of a position table's shape is no head
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(50, 16)
            self.position = nn.Embedding(16, 16)
            self.block = nn.Linear(16, 16)
            self.readout = nn.Linear(16, 50)

    assert embedding_parameter_names(Untied()) == {
        "shared.weight",
        "position.weight",
        "readout.weight",
    }
    assert embedding_parameter_names(get_recipe("moe").build_model(0)) == {
        "tok_emb.weight",
        "pos_emb.weight",
    }


@pytest.mark.slow
def test_t5s_shared_table_is_an_embedding_and_the_syncer_merges_it_so():
    transformers = pytest.importorskip("transformers")
    from diloco.syncer.server import SyncerServer

    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8
    )
    model = transformers.T5ForConditionalGeneration(config)
    names = embedding_parameter_names(model)
    assert "shared.weight" in names  # the name rule of diloco.algorithm.merge misses it
    with SyncerServer.for_model(
        model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=2))
    ) as server:
        assert server.state.closing.embeddings == names
        assert server.state.closing.is_embedding("shared.weight")
        assert not server.state.closing.is_embedding(
            "encoder.block.0.layer.1.DenseReluDense.wi.weight"
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hugging_face_trainer_becomes_a_learner_with_one_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from diloco.integrations.hf_trainer import DilocoCallback
    from diloco.syncer.server import SyncerServer

    corpus = get_recipe("tiny").load_data()

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8 * 600

        def __getitem__(self, i: int) -> dict:
            start = (i * 9973) % (corpus.train.numel() - 33)
            ids = corpus.train[start : start + 32]
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    heldout = corpus.val[: 33 * 16].view(16, 33)[:, :32]
    with torch.no_grad():
        initial = float(model(input_ids=heldout, labels=heldout).loss)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=600,  # a few seconds: the syncer's clock paces rounds by measured steps
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    with SyncerServer.for_model(
        model, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=4))
    ) as server:
        callback = DilocoCallback(server.address, learner_id="hf", num_fragments=4, tokens_per_sample=32)  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows())
        trainer.add_callback(callback)
        trainer.train()
        assert callback.joined and callback.learner is None  # closed at the end of training
        assert server.state.rounds_committed >= 20
        learner = server.state.learners["hf"]
        assert learner.contributions >= 20
        assert learner.step > 0 and learner.tokens == learner.step * 8 * 32  # per heartbeat
        global_model = transformers.GPT2LMHeadModel(config)
        global_model.load_state_dict(server.state_dict(global_model), strict=True)
    with torch.no_grad():
        final = float(global_model(input_ids=heldout, labels=heldout).loss)
    assert final < initial - 1.0, (initial, final)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_learners_train_under_bf16_autocast_on_the_device_asked_for(tmp_path):
    """``--device auto --bf16`` reaches every learner (CPU here, the GPU where there is one)
    and the model still learns; the learner's log says where it trains."""
    done = run_diloco_json(
        "run",
        "--recipe=tiny",
        "--learners=1",
        "--steps=150",
        "--minutes=2",
        "--eval-every=0",
        "--dashboard=off",
        "--no-tensorboard",
        "--device=auto",
        "--bf16",
        f"--runs-dir={tmp_path}",
        "--name=it",
        "--json",
    )
    loss = done["val_loss"]
    assert loss["final"] < loss["initial"] - 1.0, loss
    config = json.loads((tmp_path / "it" / "config" / "learner-0.json").read_text())
    assert config["device"] == {"device": "auto", "bf16": True}
    log = (tmp_path / "it" / "logs" / "learner-0.log").read_text()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"on {expected}, bf16 autocast" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lightning_trainer_becomes_a_learner_with_one_callback(tmp_path):
    """A real ``lightning.Trainer`` with gradient accumulation against a real syncer: the
    callback steps the learner once per optimizer step with the tokens of both batches.
    Each batch takes at least 10 ms (a 300-step fit of the tiny model took 1.9 s on an idle
    machine: over before the syncer's clock had a step estimate from the learner's
    heartbeats, and merged 5 to 18 rounds), so the rounds do not depend on the machine's
    speed."""
    lightning = pytest.importorskip("lightning")
    from diloco.integrations.lightning import DilocoCallback
    from diloco.syncer.server import SyncerServer

    recipe = get_recipe("tiny")
    corpus = recipe.load_data()

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = recipe.build_model(0)

        def training_step(self, batch, batch_idx):
            time.sleep(0.01)  # (the pace of a real model, see the docstring)
            return recipe.loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    seq = recipe.model.seq_len
    starts = torch.randint(0, corpus.train.numel() - seq - 1, (8 * 2 * 300,))
    x = torch.stack([corpus.train[s : s + seq] for s in starts.tolist()])
    y = torch.stack([corpus.train[s + 1 : s + seq + 1] for s in starts.tolist()])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Module()
    initial = recipe.evaluate(module.model)
    trainer = lightning.Trainer(
        max_steps=300, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    with SyncerServer.for_model(
        module, config=SyncerConfig(protocol=ProtocolConfig(num_fragments=4))
    ) as server:
        callback = DilocoCallback(server.address, learner_id="pl", num_fragments=4)
        trainer.callbacks.append(callback)
        trainer.fit(module, loader)
        assert callback.joined and callback.learner is None  # closed at the end of fitting
        assert server.state.rounds_committed >= 20
        learner = server.state.learners["pl"]
        assert learner.contributions >= 20
        # (as of its last heartbeat) both batches of every optimizer step counted
        assert learner.step > 0 and learner.tokens == learner.step * 2 * 8 * seq
        global_module = Module()
        global_module.load_state_dict(server.state_dict(global_module), strict=True)
    assert recipe.evaluate(global_module.model) < initial - 1.0

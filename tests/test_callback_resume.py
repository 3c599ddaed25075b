"""The framework callbacks save the Learner's state with the Trainer's own checkpoint and
restore it when the Trainer resumes: the progress the checkpoint held unsent is kept, the
step count goes on, and every trained step is accounted for exactly once."""

from __future__ import annotations

import pytest
import torch
from kit import local_syncer

from diloco.syncer.config import SyncerConfig
from diloco.wire.protocol import ProtocolConfig

pytestmark = pytest.mark.slow  # real processes / a Trainer: left out of `make test-fast`

FRAGMENTS = 2
CHECKPOINT_STEP = 12
TOTAL_STEPS = 20
SYNCER = SyncerConfig(protocol=ProtocolConfig(num_fragments=FRAGMENTS, sync_every=4))


class Crash(Exception):
    """The process dies right after the checkpoint."""


def saved_progress(state: dict) -> dict:
    """What the checkpoint holds unsent and where the learner stood."""
    unanswered = [0] * FRAGMENTS
    for entry in state["ledger"]:
        if entry["admitted"] == -2:  # (no answer yet: Ledger.state)
            unanswered[entry["fragment"]] += entry["steps"]
    return {
        "step": state["local_step"],
        "steps_since": list(state["steps_since"]),
        "unanswered": unanswered,
        "versions": list(state["versions"]),
    }


def check_resumed(restored: dict, saved: dict, learner) -> None:
    """The restored learner holds what the checkpoint held; its final books are exact."""
    assert saved["step"] == CHECKPOINT_STEP
    assert sum(saved["steps_since"]) + sum(saved["unanswered"]) > 0  # progress to keep
    assert restored["step"] == saved["step"]
    assert restored["steps_since"] == saved["steps_since"]
    # (the syncer may have merged, since, what the checkpoint held accepted)
    assert all(v >= s >= 0 for v, s in zip(restored["versions"], saved["versions"], strict=True))
    books = learner.accounting()
    assert books.trained == TOTAL_STEPS and books.balanced(), books
    assert books.unsent == (0,) * FRAGMENTS and books.dropped == (0,) * FRAGMENTS, books


def learner_view(learner) -> dict:
    return {
        "step": learner.local_step,
        "steps_since": list(learner.steps_since),
        "versions": list(learner.versions),
    }


# ------------------------------------------------------------------- Hugging Face
@pytest.mark.timeout(180)
def test_a_hugging_face_trainer_resumed_from_its_checkpoint_keeps_the_unsent_progress(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from diloco.integrations.hf_trainer import LEARNER_STATE_FILE, DilocoCallback

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip

    def model():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * TOTAL_STEPS

        def __getitem__(self, i: int) -> dict:
            ids = torch.arange(8).add(i) % 32
            return {"input_ids": ids, "labels": ids}

    def arguments():
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=TOTAL_STEPS,
            per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
            save_strategy="steps", save_steps=CHECKPOINT_STEP, logging_strategy="no",
            use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip

    saved, restored = {}, {}

    class CrashAfterSaving(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = tmp_path / "out" / f"checkpoint-{state.global_step}"
            saved.update(saved_progress(torch.load(folder / LEARNER_STATE_FILE)))
            raise Crash

    class Probe(transformers.TrainerCallback):
        def __init__(self, callback) -> None:
            self.callback = callback

        def on_train_begin(self, args, state, control, **kwargs):
            restored.update(learner_view(self.callback.learner), learner=self.callback.learner)

    options = dict(learner_id="hf", num_fragments=FRAGMENTS, tokens_per_sample=8)
    with local_syncer(model(), SYNCER) as server:
        first = DilocoCallback(server.address, **options)
        trainer = transformers.Trainer(model=model(), args=arguments(), train_dataset=Windows())
        trainer.add_callback(first)
        trainer.add_callback(CrashAfterSaving())
        with pytest.raises(Crash):
            trainer.train()
        first.leave(flush=False)  # the process died: nothing flushed

        second = DilocoCallback(server.address, **options)
        trainer = transformers.Trainer(model=model(), args=arguments(), train_dataset=Windows())
        trainer.add_callback(second)
        trainer.add_callback(Probe(second))
        trainer.train(resume_from_checkpoint=True)
        assert second.learner is None  # closed at the end of training
    check_resumed(restored, saved, restored["learner"])


# ---------------------------------------------------------------------- Lightning
@pytest.mark.timeout(180)
def test_a_lightning_trainer_resumed_from_its_checkpoint_keeps_the_unsent_progress(tmp_path):
    lightning = pytest.importorskip("lightning")
    from kit import tiny_model

    from diloco.integrations.lightning import DilocoCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model(0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * TOTAL_STEPS, 8), torch.randn(4 * TOTAL_STEPS, 1)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    saved, restored = {}, {}
    folder = tmp_path / "ckpt"

    class CrashAfterSaving(lightning.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == CHECKPOINT_STEP:
                (path,) = folder.glob("*.ckpt")
                checkpoint = torch.load(path, weights_only=True)
                (state,) = (s for k, s in checkpoint["callbacks"].items() if "Diloco" in k)
                saved.update(saved_progress(state))
                raise Crash

    class Probe(lightning.Callback):
        def __init__(self, callback) -> None:
            self.callback = callback

        def on_train_start(self, trainer, pl_module):
            restored.update(learner_view(self.callback.learner), learner=self.callback.learner)

    def trainer(*callbacks):
        every = lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=folder, every_n_train_steps=CHECKPOINT_STEP, save_top_k=-1
        )
        return lightning.Trainer(
            max_steps=TOTAL_STEPS, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(tmp_path), callbacks=[*callbacks, every],
        )  # fmt: skip

    with local_syncer(Module(), SYNCER) as server:
        first = DilocoCallback(server.address, learner_id="pl", num_fragments=FRAGMENTS)
        with pytest.raises(Crash):
            trainer(first, CrashAfterSaving()).fit(Module(), loader)
        assert first.learner is None  # left without flushing (on_exception)

        second = DilocoCallback(server.address, learner_id="pl", num_fragments=FRAGMENTS)
        (path,) = folder.glob("*.ckpt")
        trainer(second, Probe(second)).fit(Module(), loader, ckpt_path=path)
        assert second.learner is None
    check_resumed(restored, saved, restored["learner"])

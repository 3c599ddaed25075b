"""Recipes: data split, per-learner streams, schedule, model, clear data errors."""

import pytest
import torch

from diloco.recipes import DataError, get_recipe
from diloco.recipes.text import TextCorpus


def test_shakespeare_split_holds_out_five_percent_of_every_play():
    corpus = get_recipe("tiny").load_data()
    total = corpus.train.numel() + corpus.val.numel()
    assert total > 5_000_000  # the plays are ~5.3 MB
    assert 0.045 < corpus.val.numel() / total < 0.055


def test_held_out_bytes_never_appear_in_training_windows():
    corpus = TextCorpus([b"a" * 100 + b"B" * 5, b"c" * 100 + b"D" * 5])
    assert set(corpus.val.tolist()) == {ord("B"), ord("D")}
    assert ord("B") not in corpus.train.tolist()


def test_streams_are_deterministic_per_learner_and_resume_exactly():
    recipe = get_recipe("tiny")
    a = recipe.stream(learner_id=0, seed=1)
    b = recipe.stream(learner_id=0, seed=1)
    other = recipe.stream(learner_id=1, seed=1)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, other.next_batch()[0])
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the next bytes
    state = a.state_dict()
    expected = a.next_batch()[0]
    resumed = recipe.stream(learner_id=0, seed=1)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], expected)
    with pytest.raises(ValueError):
        other.load_state_dict(state)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    r = get_recipe("shakespeare")
    assert r.lr_at(0, 1000) == pytest.approx(r.lr / r.warmup_steps)
    assert r.lr_at(r.warmup_steps, 1000) == pytest.approx(r.lr)
    assert r.lr_at(1000, 1000) == pytest.approx(r.lr * r.min_lr_ratio)
    assert r.lr_at(5000, 0) == r.lr  # unknown length: constant after warm-up
    lrs = [r.lr_at(s, 1000) for s in range(r.warmup_steps, 1001)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:], strict=False))


def test_model_is_a_function_of_the_seed_and_learns():
    r = get_recipe("tiny")
    m1, m2, m3 = r.build_model(0), r.build_model(0), r.build_model(1)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert not torch.equal(next(m1.parameters()), next(m3.parameters()))
    names = [n for n, _ in m1.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    before = r.evaluate(m1)
    opt = r.build_optimizer(m1)
    stream = r.stream(learner_id=0)
    for _ in range(60):
        x, y = stream.next_batch()
        m1(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    assert r.evaluate(m1) < before - 1.0


def test_data_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8")
    with pytest.raises(DataError, match="not UTF-8"):
        get_recipe("tiny", data_path=str(bad)).load_data()
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="split has"):
        get_recipe("tiny", data_path=str(short)).load_data()
    with pytest.raises(DataError, match="cannot read"):
        get_recipe("tiny", data_path=str(tmp_path / "none.txt")).load_data()
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("gpt5")


def test_any_utf8_file_trains(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Über alles, naïve café. " * 400)
    r = get_recipe("tiny", data_path=str(text))
    x, y = r.stream(learner_id=0).next_batch()
    assert x.shape == (r.batch_size, r.model.seq_len) and int(x.max()) < 256


def test_the_inner_learning_rate_can_be_set_for_every_process():
    from diloco.config.common import RecipeConfig
    from diloco.recipes import recipe_of

    assert recipe_of(RecipeConfig(recipe="tiny")).lr == 3e-3
    recipe = recipe_of(RecipeConfig(recipe="tiny", inner_lr=1e-3))
    assert recipe.lr == 1e-3 and recipe.lr_at(recipe.warmup_steps) == 1e-3
    with pytest.raises(ValueError, match="--inner-lr must be > 0"):
        RecipeConfig(inner_lr=0.0)


def test_clipped_steps_are_counted_per_incarnation_and_summed():
    from diloco.report.tally import ProgressTally
    from diloco.runtime.training import ClipCounter, inner_step

    recipe = get_recipe("tiny")
    model = recipe.build_model(0)
    opt = recipe.build_optimizer(model)
    stream = recipe.stream(learner_id=0)
    counter = ClipCounter()
    for _ in range(5):
        inner_step(model, opt, stream.next_batch(), loss_fn=recipe.loss, clipped=counter)
    assert 0 <= counter.count <= 5
    counter = ClipCounter()
    counter.add(torch.tensor(3.0))
    counter.add(torch.tensor(0.5))
    assert counter.count == 1
    tally = ProgressTally()
    for rec in ({"t": 0, "clipped": 4}, {"t": 1, "clipped": 9}, {"t": 2, "clipped": 2}):
        tally.add(rec)  # a restart: the counter began again at 0
    assert tally.transport_total("clipped") == 11


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    from diloco.recipes.optimizers import MuonWithAdamW, muon_parameters

    recipe = get_recipe("tiny", optimizer="muon")
    model = recipe.build_model(0)
    chosen = muon_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    assert names and all(model.get_parameter(n).dim() == 2 for n in names)
    assert not any("emb" in n for n in names)  # embeddings (and a tied head) stay with AdamW
    assert "blocks.0.attn.qkv.weight" in names
    opt = recipe.build_optimizer(model)
    assert isinstance(opt, MuonWithAdamW)
    assert {id(p) for g in opt.muon.param_groups for p in g["params"]} == chosen
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}  # every parameter, once
    with pytest.raises(ValueError, match="inner optimizer 'sgd'"):
        get_recipe("tiny", optimizer="sgd")


def test_muon_learns_follows_the_schedule_and_resumes_exactly_from_its_state():
    from diloco.runtime.training import inner_step, set_lr

    recipe = get_recipe("tiny", optimizer="muon")
    model = recipe.build_model(0)
    opt = recipe.build_optimizer(model)
    stream = recipe.stream(learner_id=0)
    batches = [stream.next_batch() for _ in range(40)]
    first = recipe.loss(model, batches[0]).item()
    for step, batch in enumerate(batches[:30]):
        set_lr(opt, recipe.lr_at(step, 40))
        inner_step(model, opt, batch, loss_fn=recipe.loss)
    assert all(g["lr"] == recipe.lr_at(29, 40) for g in opt.param_groups)
    assert recipe.loss(model, batches[0]).item() < first - 0.3
    saved = torch.load(_saved(model, opt), weights_only=True)
    twin = recipe.build_model(0)
    twin.load_state_dict(saved["model"])
    twin_opt = recipe.build_optimizer(twin)
    twin_opt.load_state_dict(saved["opt"])
    for step, batch in enumerate(batches[30:], start=30):
        for m, o in ((model, opt), (twin, twin_opt)):
            set_lr(o, recipe.lr_at(step, 40))
            inner_step(m, o, batch, loss_fn=recipe.loss)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not Muon with AdamW"):
        twin_opt.load_state_dict(get_recipe("tiny").build_optimizer(twin).state_dict())


def _saved(model, opt):
    import io

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def test_muon_leaves_routers_and_output_layers_to_adamw_and_refuses_a_model_without_matrices(
    monkeypatch,
):
    from diloco.recipes.optimizers import check_inner_optimizer, muon_parameters

    moe = get_recipe("moe").build_model(0)
    chosen = {n for n, p in moe.named_parameters() if id(p) in muon_parameters(moe)}
    assert chosen and not any("router" in n for n in chosen)
    assert any("experts" in n for n in chosen)
    digits = get_recipe("digits", optimizer="muon")
    with pytest.raises(ValueError, match="no hidden weight matrices"):
        digits.build_optimizer(digits.build_model(0))  # its 2-D weight is the classifier
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ValueError, match=r"torch >= 2\.9"):
        check_inner_optimizer("muon")

"""``diloco export`` for big models: a transformers ``save_pretrained`` directory
(``--format hf``), safetensors shards with an index (``--max-shard-size``), a ``torch.save``
file for a ``.pt`` name; the global model streamed into the model fragment by fragment."""

from __future__ import annotations

import json

import pytest
import torch
from kit import local_syncer, run_diloco
from safetensors.torch import load_file

from diloco.algorithm.fragments import balanced_fragments
from diloco.runtime.tensor_files import INDEX_FILE, load_sharded
from diloco.runtime.units import parse_size
from diloco.syncer.store import FragmentStore

pytestmark = pytest.mark.slow  # real processes: left out of `make test-fast`

P = 3


def gpt2_config():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def state_dir_of(tmp_path, model) -> tuple:
    """A syncer's state directory for ``model`` whose fragments were committed at versions
    1..P with values other than the model's (as a run leaves it); returns the directory and
    the global model's parameters by name."""
    state = tmp_path / "state"
    local_syncer(model, num_fragments=P, state_dir=state).stop()
    layout = balanced_fragments(model.named_parameters(), P)
    named = {n: t.detach().clone() for n, t in model.named_parameters()}
    store = FragmentStore(state)
    for p in range(P):
        value = layout.gather(p, named) + (p + 1) * 0.25
        store.save(p, p + 1, value, {})
        layout.scatter(p, value, named)
    return state, named


MLP_SOURCE = """
import torch

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
"""


def build_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def model_file(tmp_path, source: str) -> str:
    (tmp_path / "the_model.py").write_text(source)
    return "the_model:build"


GPT2_SOURCE = """
import torch, transformers
def build():
    torch.manual_seed(7)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None))
"""


def export(tmp_path, *args: str):
    """``diloco export ARGS`` run from ``tmp_path`` (where the model's module is)."""
    return run_diloco("export", *args, cwd=tmp_path, timeout=120)


def export_here(tmp_path, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """``diloco export ARGS`` in this process, from ``tmp_path``: (exit status, stderr)."""
    from diloco.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(["export", *args])
    except SystemExit as exc:  # (argparse's refusals)
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(180)
def test_format_hf_round_trips_through_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = gpt2_config()
    torch.manual_seed(7)
    model = transformers.GPT2LMHeadModel(config)
    state, named = state_dir_of(tmp_path, model)
    ref = model_file(tmp_path, GPT2_SOURCE)
    done = export(tmp_path, str(state), "--model", ref, "--format", "hf", "-o", "hf-out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "as hf" in done.stdout
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf-out")
    assert (tmp_path / "hf-out" / "config.json").is_file()
    for name, value in loaded.named_parameters():
        assert torch.equal(value.detach(), named[name]), name
    # a model without save_pretrained is refused with one line, nothing written
    plain = model_file(tmp_path, "import torch\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    done = export(tmp_path, str(state), "--model", plain, "--format", "hf", "-o", "x")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(180)
def test_a_sharded_export_loads_back_strictly_and_equal_to_the_single_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    state, _ = state_dir_of(tmp_path, model)
    ref = model_file(tmp_path, GPT2_SOURCE)
    one = export(tmp_path, str(state), "--model", ref, "-o", "one.safetensors")
    assert one.returncode == 0, one.stderr[-2000:]
    sharded = export(tmp_path, str(state), "--model", ref, "--max-shard-size", "20KB", "-o", "sh")
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    index = json.loads((tmp_path / "sh" / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "sh" / f).is_file() for f in files)
    single = load_file(str(tmp_path / "one.safetensors"))
    shards = load_sharded(tmp_path / "sh")
    assert shards.keys() == single.keys() == model.state_dict().keys()
    assert all(torch.equal(shards[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in single.values()
    )
    fresh = transformers.GPT2LMHeadModel(gpt2_config())
    fresh.load_state_dict(shards, strict=True)
    for f in files:  # each shard within the size, unless one tensor alone is larger
        tensors = load_file(str(tmp_path / "sh" / f))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= parse_size("20KB") or len(tensors) == 1


@pytest.mark.timeout(120)
def test_the_output_name_says_the_format_or_the_export_refuses(tmp_path, monkeypatch, capsys):
    model = build_mlp()
    state, named = state_dir_of(tmp_path, model)
    ref = model_file(tmp_path, MLP_SOURCE)
    code, err = export_here(
        tmp_path, monkeypatch, capsys, str(state), "--model", ref, "-o", "out.pt"
    )
    assert code == 0, err
    saved = torch.load(tmp_path / "out.pt", weights_only=True)  # what the suffix says
    assert all(torch.equal(saved[n], named[n]) for n in named)
    for args in (
        ["--format", "safetensors", "-o", "out2.pt"],  # a name that contradicts the format
        ["-o", "out.weights"],  # a name that says no format
        ["--format", "pt", "--max-shard-size", "1MB", "-o", "d.pt"],
    ):
        code, err = export_here(tmp_path, monkeypatch, capsys, str(state), "--model", ref, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / args[-1]).exists()
    args = (str(state), "--model", ref, "--max-shard-size", "lots", "-o", "d")
    code, err = export_here(tmp_path, monkeypatch, capsys, *args)
    assert code == 2 and "not a size" in err


def test_sizes_parse_as_hugging_face_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000 and parse_size("1.5kb") == 1500
    for bad in ("", "5 GiBs", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)

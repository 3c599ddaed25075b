"""Your own model, end to end (issue 36): the two-file example of ``examples/own_model``
run as a user runs it, and each rough edge a new user met, as a test.

The end-to-end test starts ``diloco syncer --model model:build`` and two ``python
train.py`` learners (real processes, loopback), waits for the syncer to end by itself when
the learners have left, exports the model from its state directory after it exited, and
loads it strictly.
"""

from __future__ import annotations

import importlib.util
import logging
import tokenize
from pathlib import Path

import pytest
import torch
from kit import local_syncer, run_diloco, run_own_model_example, tiny_model
from safetensors.torch import load_file

from diloco.launch.export import export_state_dir
from diloco.launch.syncer_stopping import StopRule
from diloco.learner.learner import Learner
from diloco.runtime.model_ref import ModelRefError, load_model
from diloco.syncer.export import ExportError
from diloco.syncer.store import read_tape
from diloco.wire import diloco_pb2 as pb


def build_example_model(directory: Path):
    """``model.build()`` of the example in ``directory``, imported from that file."""
    spec = importlib.util.spec_from_file_location("example_model", directory / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def marked_lines(path: Path) -> list[int]:
    """Lines of ``path`` with a ``# diloco`` comment (real comments, not text in strings)."""
    with open(path, "rb") as f:
        tokens = tokenize.tokenize(f.readline)
        return [
            t.start[0]
            for t in tokens
            if t.type == tokenize.COMMENT and t.string.startswith("# diloco")
        ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_trains_ends_by_itself_and_exports_from_the_dead_syncers_state(tmp_path):
    work = tmp_path / "own_model"
    out, learned = run_own_model_example(work, "--snapshot-every=1", steps=400)
    assert len(marked_lines(work / "train.py")) <= 6  # the promise: at most 6 added lines
    assert all("400 steps" in text for text in learned), learned
    assert "the run is over: every learner left (2 joined)" in out
    done = run_diloco(
        "export", "syncer-state", "--model=model:build", "-o", "model.safetensors", cwd=work
    )
    assert done.returncode == 0, done.stderr
    exported = load_file(str(work / "model.safetensors"))
    model = build_example_model(work)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(exported, strict=True)
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # it trained
    # The protocol worked while they trained: rounds merged both learners, and the exported
    # model learned (the example's README shows the same on a longer run).
    rounds = [r for r in read_tape(work / "syncer-state" / "events.jsonl") if r["event"] == "round"]
    assert any(len(r["participants"]) >= 2 for r in rounds), len(rounds)
    module = importlib.util.spec_from_file_location("example_model", work / "model.py")
    example = importlib.util.module_from_spec(module)
    module.loader.exec_module(example)
    assert float(example.held_out(model)) < 0.5 * float(example.held_out(example.build()))
    snapshot = load_file(str(work / "syncer-state" / "global.safetensors"))  # the last one
    assert snapshot.keys() == exported.keys()
    assert all(torch.equal(snapshot[k], exported[k]) for k in exported)


def test_a_model_reference_fails_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_model.py").write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(2, 2)\n"
        "def broken():\n    raise RuntimeError('no data')\n"
        "def not_a_model():\n    return 3\n"
        "value = 3\n"
    )
    assert isinstance(load_model("user_model:build"), torch.nn.Linear)  # from the cwd
    for ref, says in [
        ("user_model", "MODULE:CALLABLE"),
        ("user_model:missing", "has no 'missing'"),
        ("user_model:broken", "broken() raised RuntimeError('no data')"),
        ("user_model:not_a_model", "returned int, not a torch.nn.Module"),
        ("user_model:value", "is not callable"),
        ("absent_module:build", "cannot import 'absent_module'"),
    ]:
        with pytest.raises(ModelRefError, match=says.replace("(", r"\(").replace(")", r"\)")):
            load_model(ref)


def _status(*connected: bool, merged_tokens: int = 0) -> pb.StatusReply:
    """A status whose learners are connected or gone (left), nothing waiting."""
    rows = [pb.LearnerStatus(learner_id=f"l{i}", connected=c) for i, c in enumerate(connected)]
    return pb.StatusReply(learners=rows, merged_tokens=merged_tokens)


def test_the_run_is_over_when_every_learner_left_for_a_lease_or_the_budget_is_spent():
    rule = StopRule(when_learners_leave=True, linger_s=5.0)
    assert rule.check(_status(), now=0.0) is None  # nobody joined yet: wait
    assert rule.check(_status(True, False), now=1.0) is None
    assert rule.check(_status(False, False), now=2.0) is None  # gone, within the lease
    assert rule.check(_status(True, False), now=4.0) is None  # one came back
    assert rule.check(_status(False, False), now=5.0) is None
    assert rule.check(_status(False, False), now=10.0) == "every learner left (2 joined)"
    budget = StopRule(max_tokens=1000)
    assert budget.check(_status(True, True, merged_tokens=900), now=0.0) is None
    assert "budget 1,000" in budget.check(_status(True, True, merged_tokens=1100), now=1.0)
    assert StopRule().check(_status(False), now=100.0) is None  # no rule: never over
    assert not StopRule().active and rule.active and budget.active


@pytest.mark.slow
def test_a_state_directory_exports_only_with_its_own_model(tmp_path):
    model = tiny_model(0, (8, 16, 2))
    server = local_syncer(model, num_fragments=2, state_dir=tmp_path / "state")
    server.stop()
    out = tmp_path / "m.safetensors"
    done = export_state_dir(tmp_path / "state", tiny_model(1, (8, 16, 2)), out)
    assert done["versions"] == [0, 0] and load_file(str(out)).keys() == model.state_dict().keys()
    with pytest.raises(ExportError, match="is not the model"):
        export_state_dir(tmp_path / "state", tiny_model(0, (8, 32, 2)), out)
    with pytest.raises(ExportError, match="nor a syncer's state directory"):
        export_state_dir(tmp_path, model, out)
    done = run_diloco("export", str(tmp_path / "state"), "-o", str(out))
    assert done.returncode == 2 and "give --model" in done.stderr


def test_a_learners_sync_every_is_refused_with_where_h_lives():
    """Friction 5: a learner's ``sync_every`` was silently overridden by the syncer's."""
    with pytest.raises(TypeError, match="H is the syncer's"):
        Learner(tiny_model(), syncer="127.0.0.1:1", sync_every=4)


def test_wait_for_global_raises_instead_of_training_apart():
    """Friction 2: on a timeout ``wait_for_global`` returned False, and a script that did not
    check it trained from its own initialization."""
    learner = Learner(tiny_model(), syncer="127.0.0.1:1", learner_id="alone")  # nobody there
    try:
        with pytest.raises(TimeoutError, match="no global model from 127.0.0.1:1"):
            learner.wait_for_global(timeout=0.3)
        assert learner.wait_for_global(timeout=0.1, required=False) is False
    finally:
        learner.close(flush=False)


@pytest.mark.timeout(60)
def test_a_compiled_model_joins_says_so_and_exports(tmp_path, caplog):
    """Friction 6 and 7: ``torch.compile`` renamed every parameter ``_orig_mod.*`` and the
    learner was refused; a learner said nothing of joining unless asked through
    ``learner.stats``. It now joins as the module compile wrapped, and says so on the
    ``diloco.learner`` logger (silent unless logging is configured)."""
    server = local_syncer(tiny_model(0), num_fragments=2)
    compiled = torch.compile(tiny_model(0))
    caplog.set_level(logging.INFO, logger="diloco.learner")
    learner = Learner(compiled, syncer=server.address, num_fragments=2, learner_id="fast")
    try:
        assert learner.wait_for_global(timeout=20)
        assert learner.link.error is None
        joined = [r for r in caplog.records if "learner fast joined" in r.getMessage()]
        assert joined and joined[0].levelno == logging.INFO  # (below the last-resort handler)
        state = server.state_dict(torch.compile(tiny_model(5)))  # the plain module's names
        tiny_model(0).load_state_dict(state, strict=True)
    finally:
        learner.close(flush=False)
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_diloco_status_prints_the_documented_fields(tmp_path):
    server = local_syncer(tiny_model(0), num_fragments=2)
    learner = Learner(tiny_model(0), syncer=server.address, num_fragments=2, learner_id="a")
    try:
        learner.wait_for_global(timeout=20)
        done = run_diloco("status", server.address, "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        doc = __import__("json").loads(done.stdout)
        assert set(doc) == {f.name for f in pb.StatusReply.DESCRIPTOR.fields}
        assert doc["versions"] == [0, 0] and doc["failure"] == "" and doc["waiting"] == 0
        assert [row["learner_id"] for row in doc["learners"]] == ["a"]
        text = run_diloco("status", server.address, timeout=60)
        assert text.returncode == 0 and "serving" in text.stdout and "a: live" in text.stdout
    finally:
        learner.close(flush=False)
        server.stop()
    gone = run_diloco("status", server.address, timeout=60)
    assert gone.returncode == 1 and "does not answer" in gone.stderr

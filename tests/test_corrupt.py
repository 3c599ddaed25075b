"""Silent data corruption: one learner of three damages every delta it sends, the global model
still learns. Real processes (``diloco run --chaos corrupt:...``) against a clean run, plus the
corruption modes one by one against an in-process syncer."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from kit import local_syncer, run_diloco_json, tiny_model
from torch import nn

from diloco.algorithm import codecs
from diloco.algorithm.guard import DEFAULT_K, DEFAULT_MAX_RATIO
from diloco.chaos import ChaosSpecError, corruptions, parse_spec, schedule
from diloco.learner.corrupt import (
    HOSTILE_CLAIM,
    HUGE_FACTOR,
    CorruptingEncoder,
    Corruptor,
    corrupt_delta,
    corrupt_payload,
)
from diloco.learner.learner import Learner
from diloco.syncer.config import SyncerConfig
from diloco.syncer.store import read_tape
from diloco.wire.protocol import ProtocolConfig

STEPS = 300  # per learner: both runs train the same steps whatever the machine's speed
MINUTES = 2.0  # a safety cap only (both runs normally finish their steps in 7-30 s)
#: Each learner's step takes this many times its cost. On an idle machine the tiny recipe's
#: steps take ~8 ms: 300 of them in 2.5 s, many before the syncer's clock has measured the
#: fleet's pace, and the corrupt run merged 99-106 rounds against 165 on a loaded machine
#: (CI saw it end at 3.34, above this test's 0.6 x 5.52; here 2.76, its last rounds raising
#: it by 0.044 where 0.05 is allowed). At 3x: 280-300 rounds, 2.54 and 2.76, the last rounds
#: within 0.001 of the lowest.
SLOW = 3
CORRUPT = "corrupt:learners=1,how=huge,start=0s"
#: The corrupt run may end at most this much above the clean run's held-out loss. It trains
#: with two useful learners instead of three. Measured (3 pairs of runs): clean 2.45-2.90
#: (asynchrony makes runs differ), corrupt 2.54-2.73; without the norm guard 763.
LOSS_BOUND = 1.2
TOKEN = "corrupt-test-token-0123456789"


# ------------------------------------------------------------------------- spec and modes
def test_corrupt_spec_parses_into_windows_and_is_not_a_scheduled_event():
    clauses = parse_spec("corrupt:learners=1,how=flip,start=3s,down=10s;corrupt:how=nan")
    first, *rest = corruptions(clauses, 2)
    assert (first.index, first.how, first.start_s, first.end_s) == (1, "flip", 3.0, 13.0)
    assert [(w.index, w.how, w.end_s) for w in rest] == [
        (0, "nan", float("inf")),
        (1, "nan", float("inf")),
    ]
    assert schedule(clauses, 2, 60, seed=0) == []
    for bad, message in [("corrupt:learners=0", "how="), ("corrupt:how=zero", "how=")]:
        with pytest.raises(ChaosSpecError, match=message):
            parse_spec(bad)
    with pytest.raises(ChaosSpecError, match="does not exist"):
        corruptions(parse_spec("corrupt:how=nan,learners=5"), 2)


def test_corruption_modes():
    delta = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(corrupt_delta(delta, "huge"), delta * HUGE_FACTOR)
    assert torch.equal(corrupt_delta(delta, "flip"), -delta)
    assert torch.equal(delta, torch.tensor([1.0, -2.0, 0.5]))  # input untouched
    for codec in codecs.CODECS:
        damaged = corrupt_payload(codecs.encode(delta, codec), "nan")
        with pytest.raises(codecs.NonFiniteError):
            codecs.decode(damaged, 3, codec)
    window = Corruptor("flip", start=10.0, end=20.0)
    assert not window.active(9.9) and window.active(10.0) and not window.active(20.0)
    assert (window.tokens(240), window.declared(10)) == (240, 10)
    hostile = Corruptor("hostile")
    assert torch.equal(hostile.delta(delta), -delta)
    assert (hostile.tokens(240), hostile.declared(10)) == (240 * HOSTILE_CLAIM, 10 * HOSTILE_CLAIM)


def _model() -> nn.Module:
    return tiny_model(0, (8, 16, 1))


def _syncer_for(model: nn.Module, tmp_path: Path, *, up_codec: str):
    """An in-process syncer (2 fragments, tape in ``tmp_path``), started."""
    # On the learners' schedule each step's due fragment is sent at once: these tests count
    # uploads per step. The syncer's clock is exercised by the multi-process tests below.
    config = SyncerConfig(
        up_codec=up_codec,
        lease_s=5,
        heartbeat_s=0.5,
        schedule="learner",
        protocol=ProtocolConfig(sync_every=2, num_fragments=2),
    )
    server = local_syncer(model, config, tape_path=tmp_path / "events.jsonl")
    return server.layout, dict(model.named_parameters()), server


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how, refused", [("huge", "OUT_OF_RANGE"), ("nan", "INVALID_ARGUMENT"), ("flip", None)]
)
def test_each_mode_reaches_the_syncer_and_is_handled(tmp_path, how, refused):
    """A real Learner whose uploads are corrupted: huge and nan are refused (tape says why),
    flip has an ordinary norm and is accepted (only averaging limits it)."""
    model = _model()
    layout, named, server = _syncer_for(model, tmp_path, up_codec="int8")
    try:
        encoder = CorruptingEncoder(Corruptor(how))
        learner = Learner(
            model,
            syncer=server.address,
            num_fragments=2,
            learner_id="sdc",
            link_options={"encoder": encoder},
        )
        assert learner.wait_for_global(timeout=10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(8):
            x = torch.randn(16, 8, generator=gen)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=16)
            # Each due upload goes out before the next step (a queued delta of a fragment is
            # otherwise replaced by a newer one, and fewer uploads would reach the syncer).
            assert learner.link.wait_idle(10)
        assert learner.flush(timeout=10)
        learner.close(flush=False)
        assert encoder.corrupted >= 4
    finally:
        server.stop()
    tape = read_tape(tmp_path / "events.jsonl")
    codes = [r["code"] for r in tape if r["event"] == "refused"]
    rounds = [r for r in tape if r["event"] == "round"]
    if refused:
        assert codes and set(codes) == {refused} and not rounds
    else:
        assert not codes and rounds


@pytest.mark.timeout(60)
def test_a_learner_refused_by_the_guard_resyncs_the_fragment_and_is_accepted_again(tmp_path):
    """An honest learner whose local fragment jumped (here: by hand, like a diverged step)
    sends a delta the norm guard refuses. The delta would only grow while refused, so the
    learner resets that fragment to the global value and its next uploads are accepted."""
    model = _model()
    layout, named, server = _syncer_for(model, tmp_path, up_codec="fp32")
    try:
        learner = Learner(model, syncer=server.address, num_fragments=2)
        assert learner.wait_for_global(timeout=10)
        global_value = learner.anchors[0].clone()
        jump = torch.full_like(global_value, 100.0)  # far beyond 10x the fragment's norm
        layout.scatter(0, global_value + jump, named)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        accepted_after_reset = False
        for _ in range(12):
            model(torch.randn(16, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            learner.step(tokens=16)
            assert learner.link.wait_idle(10)  # each due upload is answered before the next step
            if learner.guard_resets:
                accepted_after_reset = accepted_after_reset or learner.versions[0] >= 1
        deadline = time.monotonic() + 10  # (a loaded machine: the merge may come after)
        while learner.guard_resets and not accepted_after_reset:
            learner.apply_arrived()
            accepted_after_reset = learner.versions[0] >= 1
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        learner.close(flush=False)
    finally:
        server.stop()
    tape = read_tape(tmp_path / "events.jsonl")
    refused = [r for r in tape if r["event"] == "refused"]
    assert refused and {r["code"] for r in refused} == {"OUT_OF_RANGE"}
    assert learner.guard_resets == 1
    # back at the global value (plus a few small AdamW steps), not 100 away from it
    assert (layout.gather(0, named) - global_value).abs().max() < 1.0
    merged = [r for r in tape if r["event"] == "round" and r["fragment"] == 0]
    assert merged and merged[-1]["t"] > refused[0]["t"] and accepted_after_reset


# -------------------------------------------------------------------- real processes
def run(tmp_path: Path, name: str, *extra: str) -> tuple[dict, list[dict]]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc = run_diloco_json(
        "run",
        "--recipe=tiny",
        "--learners=3",
        f"--steps={STEPS}",
        f"--minutes={MINUTES}",
        "--eval-every=1.5",
        f"--runs-dir={tmp_path}",
        f"--name={name}",
        f"--token-file={token_file}",
        *(f"--slow={i}={SLOW}" for i in range(3)),
        "--json",
        *extra,
        timeout=240,
    )
    return proc, read_tape(tmp_path / name / "syncer" / "events.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corrupt")
    return run(tmp, "clean"), run(tmp, "corrupt", f"--chaos={CORRUPT}")


def _slip(round_: dict, rounds: list[dict]) -> dict:
    """What a failure needs to say about a round that merged the corrupt learner: its norms,
    steps and fragment norm, and the fragment's earlier rounds (the guard's history)."""
    keys = ("version", "participants", "norms", "steps", "param_norm")
    earlier = [r for r in rounds if r["fragment"] == round_["fragment"] and r["t"] < round_["t"]]
    return {
        "fragment": round_["fragment"],
        **{k: round_.get(k) for k in keys},
        "earlier": [{k: r.get(k) for k in keys} for r in earlier],
    }


def _ordinary(round_: dict, rounds: list[dict], corrupt: str = "learner-1") -> bool:
    """Whether the corrupt learner's delta in ``round_`` was within the guard's size rule
    (``DEFAULT_K`` x the largest of the honest learners' median accepted norms of its
    fragment so far) or, with no honest history yet, within the fragment's ceiling."""
    mine = round_["norms"][round_["participants"].index(corrupt)]
    by_learner: dict[str, list[float]] = {}
    for r in rounds:
        if r["fragment"] == round_["fragment"] and r["t"] < round_["t"]:
            for lid, norm in zip(r["participants"], r["norms"], strict=True):
                if lid != corrupt and norm > 0:
                    by_learner.setdefault(lid, []).append(norm)
    if not by_learner:
        return mine <= DEFAULT_MAX_RATIO * round_["param_norm"]
    return mine <= DEFAULT_K * max(statistics.median(v[-32:]) for v in by_learner.values())


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_one_corrupt_learner_of_three_cannot_wreck_the_global_model(runs):
    (clean, clean_tape), (faulty, tape) = runs
    assert clean["stopped_by"] == faulty["stopped_by"] == "learners finished"  # equal steps
    # The corrupt learner really ran corrupted, and the syncer refused it, saying why.
    assert [(f["kind"], f["target"]) for f in faulty["failures_injected"]] == [
        ("corrupt", "learner-1")
    ]
    log = Path(faulty["run_dir"]) / "logs" / "learner-1.log"
    assert "corrupting uploads (huge)" in log.read_text()
    refused = [r for r in tape if r["event"] == "refused"]
    assert len(refused) >= 10
    assert {r["learner"] for r in refused} == {"learner-1"}
    assert {r["code"] for r in refused} == {"OUT_OF_RANGE"}
    rounds = [r for r in tape if r["event"] == "round"]
    slipped = [r for r in rounds if "learner-1" in r["participants"]]
    # A x1000 delta slips in only where it is of ordinary size: before a fragment has history
    # (a 1-2 step delta early in the lr warm-up) or at the end of the run, when the lr decays
    # to ~0 (CI measured 4 such rounds of ~180, all at a fragment's last versions). Judged
    # from the tape by the guard's own size rule with the corrupt learner's history left out:
    # a slipped delta that needed its own earlier slips to pass (guard poisoning) fails here.
    assert len(slipped) <= 0.05 * len(rounds), [_slip(r, rounds) for r in slipped]
    for r in slipped:
        assert _ordinary(r, rounds), _slip(r, rounds)
    assert not [r for r in clean_tape if r["event"] == "refused"]  # no false alarms
    # The global model's held-out loss decreases throughout and ends near the clean run's.
    metrics = [
        json.loads(line)
        for line in (Path(faulty["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [faulty["val_loss"]["initial"]] + [m["val_loss"] for m in metrics]
    assert len(losses) >= 4 and losses[-1] < 0.6 * losses[0], losses
    assert losses[-1] <= min(losses) + 0.05 and max(losses) < losses[0] + 0.5, losses
    assert faulty["val_loss"]["final"] <= LOSS_BOUND * clean["val_loss"]["final"], (
        faulty["val_loss"],
        clean["val_loss"],
    )

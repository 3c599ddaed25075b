"""Pure parts of the launcher: argument plans, summary, bandwidth formula, view."""

import io

import pytest

from diloco.config.run import RunConfig
from diloco.launch.children import parse_assignments, plan_learners
from diloco.launch.view import LiveView, render
from diloco.report.summary import build_summary, data_parallel_bytes_per_token, format_summary


def test_assignments_parse_and_validate():
    assert parse_assignments(["1=3", "0=2.5"], "--slow", 2, float) == {1: 3.0, 0: 2.5}
    with pytest.raises(ValueError, match="INDEX=VALUE"):
        parse_assignments(["1:3"], "--slow", 2, float)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        parse_assignments(["2=3"], "--slow", 2, float)


def test_plan_learners_defaults_and_overrides():
    config = RunConfig(learners=3, batch=["2=16"], slow=["1=3"])
    plans = plan_learners(config, default_batch=8)
    assert [(p.id, p.batch_size, p.slow) for p in plans] == [
        ("learner-0", 8, 1.0),
        ("learner-1", 8, 3.0),
        ("learner-2", 16, 1.0),
    ]


def test_data_parallel_formula():
    # 4 workers, 1M params, global batch 4096 tokens: 2·3·4·1e6 / 4096 bytes per token.
    assert data_parallel_bytes_per_token(1_000_000, 4, 4096) == pytest.approx(24e6 / 4096)
    assert data_parallel_bytes_per_token(10, 1, 5) == 0.0
    with pytest.raises(ValueError):
        data_parallel_bytes_per_token(10, 0, 5)


def learner(i, tokens, up, down):
    return {
        "id": f"learner-{i}",
        "steps": 10,
        "tokens": tokens,
        "steps_per_s": 2.0,
        "batch_size": 8,
        "slow": 1.0,
        "exit_code": 0,
        "bytes_up": up,
        "bytes_down": down,
    }


def test_summary_fields_and_ratio():
    s = build_summary(
        mode="decoupled",
        run_dir="runs/x",
        wall_s=12.345,
        val_initial=5.5,
        val_final=2.5,
        rounds=40,
        learners=[learner(0, 1000, 300, 700), learner(1, 1000, 300, 700)],
        num_params=1000,
        tokens_per_sample=32,
        stopped_by="time",
    )
    assert s["tokens"] == 2000 and s["learners"] == 2 and s["rounds"] == 40
    assert s["bytes"]["per_token"] == pytest.approx(2000 / 2000)
    dp = 2 * 1 * 4 * 1000 / (2 * 8 * 32)
    assert s["bytes"]["data_parallel_per_token"] == pytest.approx(dp)
    assert s["bytes"]["reduction_vs_data_parallel"] == pytest.approx(dp)
    assert s["per_learner"]["learner-1"]["steps_per_s"] == 2.0
    text = format_summary(s)
    assert "5.500 -> 2.500" in text and "learner-1" in text


def test_view_renders_and_redraws_in_place_only_on_a_terminal():
    snap = {
        "elapsed": 3.0,
        "val_loss": None,
        "rounds": 2,
        "bytes_up": 0,
        "bytes_down": 0,
        "learners": [{"id": "a", "step": 1, "tokens": 5, "tokens_per_s": 1.0, "state": "x"}],
    }
    lines = render(snap)
    assert "rounds 2" in lines[0] and lines[-1].strip().startswith("a")
    out = io.StringIO()
    view = LiveView(out, plain_every=10)
    view.update(snap)
    view.update({**snap, "elapsed": 4.0})  # within 10 s: not printed again
    assert out.getvalue().count("rounds 2") == 1
    assert "\x1b[" not in out.getvalue()

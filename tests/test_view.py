"""The live terminal view (progress towards the budget, the rich frame, plain frames) and the
doctests of the small pure helpers the CLI and the views use."""

from __future__ import annotations

import doctest
import importlib
import io

import pytest

from diloco.launch.view import LiveView, clock, progress, render, rich_frame

DOCTESTED = [
    "diloco.launch.view",
    "diloco.runtime.training",
    "diloco.runtime.schema",
    "diloco.wire.auth",
    "diloco.syncer.records",
    "diloco.syncer.pace",
    "diloco.algorithm.guard",
]


@pytest.mark.parametrize("module", DOCTESTED)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_progress_follows_whichever_budget_ends_the_run_first():
    assert progress(30.0, budget_s=120.0, token_budget=1000, tokens=500) == (0.5, 30.0)
    assert progress(30.0, budget_s=120.0, step_budget=100, steps=10) == (0.25, 90.0)
    assert progress(500.0, budget_s=120.0) == (1.0, 0.0)
    assert progress(0.0, token_budget=1000) == (0.0, None)
    assert clock(3725) == "1:02:05" and clock(65.9) == "1:05" and clock(None) == "-"


def frame(**extra):
    return {
        "elapsed": 61.0,
        "val_loss": 2.345,
        "rounds": 1234,
        "bytes_up": 3_000_000,
        "bytes_down": 6_000_000,
        "learners": [
            {
                "id": "site-a",
                "step": 10,
                "tokens": 10240,
                "tokens_per_s": 512.0,
                "state": "training",
            },
            {
                "id": "site-b",
                "step": 7,
                "tokens": 7168,
                "tokens_per_s": 0.0,
                "state": "down, restart in 3s",
            },
        ],
        **extra,
    }


def test_the_rich_frame_shows_the_progress_the_model_and_every_learner():
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(rich_frame(frame(done=0.5, left=61.0)))
    text = console.export_text()
    assert "1:01 elapsed, 1:01 left (50%)" in text
    assert "held-out loss 2.345" in text and "1,234 rounds" in text
    assert "site-a" in text and "down, restart in 3s" in text
    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(rich_frame(frame(done=None, left=None)))
    assert "no budget" in console.export_text()


def test_a_plain_stream_gets_a_plain_frame_every_so_often():
    out = io.StringIO()
    view = LiveView(out, plain_every=10.0)
    view.update(frame(done=0.25, left=183.0))
    view.update(frame(done=0.26, left=180.0))  # within 10 s: not printed again
    view.close()
    text = out.getvalue()
    assert text.count("diloco") == 1 and "25% (3:03 left)" in text
    assert render(frame())[2].split() == ["site-a", "10", "10,240", "512", "training"]

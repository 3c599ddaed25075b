"""``diloco report``: one self-contained HTML file for a data-parallel run, a synchronous
DiLoCo run (real ``diloco run`` processes), a standalone syncer's state directory and a
bench folder; plus the pieces it is made of."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
from kit import progress_of, run_diloco, run_diloco_until, run_own_model_example

from diloco.config.run import RunConfig
from diloco.report.html import markdown, write_report
from diloco.report.run_files import NotARun, load_run, time_split
from diloco.runtime.schema import command_flags
from diloco.syncer.config import SyncerConfig
from diloco.syncer.store import read_tape
from diloco.wire.protocol import ProtocolConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def figures_of(page: str) -> dict[str, bytes]:
    """Figure id -> the PNG embedded in it."""
    found = re.findall(r"<figure id='(\w+)'><img [^>]*src='data:image/png;base64,([^']+)'", page)
    return {name: base64.b64decode(data) for name, data in found}


TRAINED_RECORDS = 6
"""Progress records (one a second) each learner reports before the short run is stopped."""


def short_run(tmp_path: Path, mode: str) -> Path:
    """A run of two learners of the tiny recipe, bounded by a minute and stopped (as Ctrl+C)
    once each has reported ``TRAINED_RECORDS`` progress records of training: on a loaded
    machine their start can take most of a fixed 12 s (a learner then trained nothing)."""
    run = tmp_path / mode

    def trained(_tape: list[dict]) -> bool:
        return all(
            sum("tokens" in r for r in progress_of(run, f"learner-{i}")) >= TRAINED_RECORDS
            for i in range(2)
        )

    run_diloco_until(
        run, "--recipe=tiny", f"--mode={mode}", "--learners=2", "--minutes=1",
        "--eval-every=1", "--dashboard=off", f"--runs-dir={tmp_path}", f"--name={mode}",
        "--json", done=trained, timeout=110, what="both learners' training",
    )  # fmt: skip
    return run


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["dp", "sync"])
def test_a_run_report_holds_its_figures_summary_and_commands(tmp_path, mode):
    run_dir = short_run(tmp_path, mode)
    assert not (run_dir / "dashboard.url").exists()  # --dashboard off
    done = run_diloco("report", str(run_dir), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {run_dir / 'report.html'}"
    page = (run_dir / "report.html").read_text()
    figures = figures_of(page)
    expected = ["glance", "tokens", "time", "bytes"]
    if mode == "sync":
        expected.insert(3, "contributors")
    assert list(figures) == expected
    assert all(png.startswith(PNG_MAGIC) and len(png) > 5000 for png in figures.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"{100 * summary['goodput']:.1f}%" in page
    assert ("all-reduce steps" in page) == (mode == "dp")
    assert f"--mode {mode}" in page and "--minutes 1" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere
    run = load_run(run_dir)
    split = time_split(run)
    assert set(split) == {"learner-0", "learner-1"}
    for parts in split.values():  # nothing injected: no down time, most of it useful
        assert parts["down"] == 0 and parts["useful"] > parts["other"] / 4


def test_a_bench_folder_report_holds_its_table_figures_and_runs(tmp_path):
    from diloco.report.headless import headless_pyplot

    results = [
        {
            "name": "decoupled-clean-s0",
            "mode": "decoupled",
            "condition": "clean",
            "seed": 0,
            "val_loss": 1.8,
            "goodput": 0.97,
            "bytes_per_token": 54.0,
            "tokens": 3_280_000,
        },
        {
            "name": "dp-clean-s0",
            "mode": "dp",
            "condition": "clean",
            "seed": 0,
            "val_loss": 1.7,
            "goodput": 0.95,
            "bytes_per_token": 4900.0,
            "tokens": 3_280_000,
        },
    ]
    command = "diloco bench --out bench --seeds 0 --conditions clean"
    (tmp_path / "results.json").write_text(json.dumps({"results": results, "command": command}))
    (tmp_path / "table.md").write_text(
        "# diloco bench (2026-11-25 12:00)\n\n| mode | condition | held-out loss |\n"
        "|---|---|---|\n| decoupled | clean | 1.800 |\n| dp | clean | 1.700 |\n\n"
        "Targets:\n\n- met: something (1.0x)\n"
    )
    plt = headless_pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "loss_vs_tokens.png")
    plt.close(fig)
    target = write_report(tmp_path)
    page = target.read_text()
    assert target == tmp_path / "report.html"
    assert list(figures_of(page)) == ["loss_vs_tokens"]
    assert "<td>decoupled</td><td>clean</td><td class=n>1.800</td>" not in page  # text cells
    assert "<td>decoupled</td><td>clean</td><td>1.800</td>" in page
    assert "decoupled-clean-s0" in page and "dp-clean-s0" in page
    assert command in page and "<li>met: something (1.0x)</li>" in page


def test_a_directory_that_is_no_run_is_refused(tmp_path):
    with pytest.raises(NotARun, match="is not a finished run"):
        write_report(tmp_path)


def test_markdown_tables_become_html_tables():
    text = markdown("| a | b |\n|---|:-:|\n| 1 | <x> |\n\nplain & simple")
    assert text == (
        "<table><tr><th>a</th><th>b</th></tr><tr><td>1</td><td>&lt;x&gt;</td></tr></table>\n"
        "<p>plain &amp; simple</p>"
    )


def test_command_flags_rebuild_a_configuration():
    config = RunConfig(
        learners=4,
        chaos="kill:mtbf=60s",
        slow=["1=2", "2=3"],
        tensorboard=False,
        syncer=SyncerConfig(protocol=ProtocolConfig(sync_every=64)),
    )
    flags = command_flags(config)
    assert flags == [
        "--learners",
        "4",
        "--slow",
        "1=2",
        "--slow",
        "2=3",
        "--chaos",
        "kill:mtbf=60s",
        "--no-tensorboard",
        "--sync-every",
        "64",
    ]
    from diloco.cli import build_parser
    from diloco.runtime.schema import from_namespace

    parsed = build_parser().parse_args(["run", *flags])
    assert from_namespace(RunConfig, parsed) == config


def standalone_syncer_run(work: Path) -> Path:
    """``examples/own_model`` run by hand as its README says (``kit.run_own_model_example``);
    the syncer's state directory."""
    run_own_model_example(work, steps=300)
    return work / "syncer-state"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_standalone_syncers_state_directory_gets_a_report_even_after_a_kill(tmp_path):
    state = standalone_syncer_run(tmp_path / "own_model")
    assert not (state / "summary.json").exists()
    done = run_diloco("report", str(state), timeout=60)
    assert done.returncode == 0, done.stderr
    page = (state / "report.html").read_text()
    figures = figures_of(page)
    assert "glance" in figures and "contributors" in figures  # the rounds, drawn
    rounds = [r for r in read_tape(state / "events.jsonl") if r["event"] == "round"]
    run = load_run(state)
    assert run.summary["rounds"] == len(rounds) > 0
    assert set(run.summary["per_learner"]) == {"site-a", "site-b"}
    both = sum(1 for r in rounds if len(r["participants"]) == 2)
    assert run.summary["contributors_per_round"]["histogram"].get("2", 0) == both
    for learner, row in run.summary["per_learner"].items():
        assert row["contributions"] == sum(1 for r in rounds if learner in r["participants"])
    assert "syncer&#x27;s state directory" in page and "no held-out loss" in page
    # What a kill -9 leaves: no stop record, a line cut short; the report still reads it.
    killed = tmp_path / "killed"
    shutil.copytree(state, killed)
    lines = (killed / "events.jsonl").read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["event"] == "stop"
    (killed / "events.jsonl").write_text("".join(lines[:-2]) + lines[-2][:17])
    (killed / "report.html").unlink()
    done = run_diloco("report", str(killed), timeout=60)
    assert done.returncode == 0, done.stderr
    assert load_run(killed).summary["rounds"] == len(rounds) - ('"round"' in lines[-2])
    assert "no stop record" in (killed / "report.html").read_text()
    nothing = run_diloco("report", str(tmp_path / "own_model"), timeout=60)
    assert nothing.returncode == 2 and len(nothing.stderr.strip().splitlines()) == 1
    assert "is not a finished run" in nothing.stderr and "state directory" in nothing.stderr

"""Every bad input a user can give the CLI ends in one line on stderr and exit code 2, with
nothing started and nothing left behind (real commands, real sockets)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from kit import pids_mentioning, run_diloco

pytestmark = pytest.mark.slow


def busy_port():
    """A socket listening on a free port (the caller closes it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


# (arguments, a phrase the one line must hold); {busy} is a port something listens on,
# {file} a regular file that exists
CASES = [
    (["run", "--learners", "0"], "--learners must be >= 1"),
    (["run", "--minutes", "-1"], "--minutes must be >= 0"),
    (["run", "--fragments", "0"], "--fragments and --sync-every must be >= 1"),
    (["run", "--sync-every", "0"], "--fragments and --sync-every must be >= 1"),
    (["run", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["run", "--outer-lr", "-1"], "--outer-lr must be > 0"),
    (["run", "--inner-lr", "0"], "--inner-lr must be > 0"),
    (["run", "--quorum", "0"], "quorum must be >= 1"),
    (["run", "--mode", "nope"], "invalid choice: 'nope'"),
    (["run", "--learners", "two"], "invalid int value: 'two'"),
    (["run", "--recipe", "nope"], "unknown recipe 'nope'"),
    (["run", "--chaos", "kill:mtbf=soon"], "is not a duration"),
    (["run", "--slow", "7=2"], "learner index must be in [0, 2)"),
    (["run", "--dashboard", "nonsense"], "--dashboard must be HOST:PORT"),
    (["run", "--add-learners", "soon:2"], "--add-learners 'soon:2': expected AT:N"),
    (["run", "--add-learners", "10s:1", "--mode", "sync"], "--add-learners needs --mode decoupled"),
    (["run", "--add-learners", "5m:1", "--minutes", "1"], "every AT must come before the end"),
    (["run", "--dashboard", "127.0.0.1:{busy}"], "cannot serve the dashboard"),
    (["syncer", "--bind", "nonsense"], "--bind must be HOST:PORT"),
    (["syncer", "--bind", "127.0.0.1:{busy}", "--state-dir", "state"], "Address already in use"),
    (["syncer", "--state-dir", "{file}"], "is a file, not a directory"),
    (["syncer", "--fragments", "0"], "--fragments and --sync-every must be >= 1"),
    (["syncer", "--dashboard", "127.0.0.1:0"], "give --state-dir or --tape"),
    (["syncer", "--dashboard", "0.0.0.0:0", "--state-dir", "state"], "without a shared token"),
    (["syncer", "--model", "my model"], "--model wants MODULE:CALLABLE"),
    (["syncer", "--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["syncer", "--model", "json:dumps"], "dumps() raised"),
    (["syncer", "--snapshot-every", "5"], "--snapshot-every needs --snapshot FILE or --state-dir"),
    (["syncer", "--max-learners", "2000"], "--max-learners must be in [1, --max-learner-ids"),
    (["export", "nowhere", "--model", "x:y", "-o", "m.safetensors"], "nor a syncer's state"),
    (["learner", "--syncer", "localhost", "--id", "a"], "is not HOST:PORT"),
    (
        ["learner", "--no-sync", "--id", "a", "--recipe", "digits", "--inner-optimizer", "muon"],
        "no hidden weight matrices",
    ),
    (["run", "--mode", "dp", "--bf16"], "--device/--bf16 are for learners"),
    (["report", "nowhere"], "is not a finished run"),
    (["export", "nowhere", "-o", "model.safetensors"], "is not a run directory"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]
if not torch.cuda.is_available():
    CASES.append(
        (["learner", "--syncer", "127.0.0.1:1", "--id", "a", "--device", "cuda"], "no CUDA")
    )


def check_case(i: int, args: list[str], phrase: str, tmp_path: Path) -> tuple | None:
    """Run one case in its own directory; what went wrong, or None."""
    work = tmp_path / f"case{i}-{args[0]}"
    work.mkdir()
    (work / "a-file").write_text("not a directory\n")
    with busy_port() as listening:
        port = str(listening.getsockname()[1])
        argv = [a.replace("{busy}", port).replace("{file}", str(work / "a-file")) for a in args]
        done = run_diloco(*argv, cwd=work, timeout=90, env={"DILOCO_TOKEN": ""})
    lines = done.stderr.strip().splitlines()
    left = sorted(p.name for p in work.iterdir() if p.name != "a-file")
    if (
        done.returncode != 2
        or len(lines) != 1
        or phrase not in lines[0]
        or "Traceback" in done.stderr
        or done.stdout.strip()
        or left
    ):
        return argv, done.returncode, done.stderr, done.stdout, left
    return None


@pytest.mark.timeout(600)
def test_every_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # two at a time: each case is a fresh interpreter importing torch, in its own directory
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda c: check_case(c[0], *c[1], tmp_path), enumerate(CASES))
        failures = [r for r in results if r is not None]
    assert not failures, "\n\n".join(
        f"{' '.join(a)}: exit {rc}, left {left}\nstderr: {err}\nstdout: {out}"
        for a, rc, err, out, left in failures
    )
    assert pids_mentioning(str(tmp_path)) == []


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    import argparse

    from diloco.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, command in commands.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            flag = f"diloco {name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                missing.append(f"{flag}: no help text")
                continue
            if action.default is argparse.SUPPRESS:
                continue  # a dataclass-configured flag: tests/test_config.py checks its help
            shown = command.formatter_class(name)._get_help_string(action)
            has_default = action.default is not None and action.default is not False
            if has_default and action.default not in ("", []) and "default" not in shown:
                missing.append(f"{flag}: default {action.default!r} not shown")
    assert not missing, "\n".join(missing)

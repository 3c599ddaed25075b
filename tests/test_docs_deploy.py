"""docs/deploy.md stays true: its manifests parse, and every diloco command in it (by hand,
under torchrun, in the Slurm scripts and the Kubernetes manifest) parses with the real CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from diloco.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
#: Values for the shell variables the examples use.
ENV = {
    "HEAD": "node-1",
    "HOME": "/home/u",
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "42",
    "SLURM_ARRAY_TASK_ID": "3",
    "JOB_COMPLETION_INDEX": "3",
    "SYNCER": "syncer-host:7000",
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def substitute(text: str) -> str:
    text = re.sub(r"\$\((.*?)\)", "value", text)  # command substitutions
    return re.sub(r"\$(\w+)", lambda m: ENV.get(m.group(1), "value"), text)


def diloco_argv(command: str) -> list[str] | None:
    """The arguments after ``diloco`` (or ``-m diloco.cli``) in one shell command, if any."""
    words = shlex.split(substitute(command), comments=True)
    for i, word in enumerate(words):
        if word == "diloco" or (word == "-m" and words[i + 1 : i + 2] == ["diloco.cli"]):
            return words[i + 1 :] if word == "diloco" else words[i + 2 :]
    return None


def shell_commands() -> list[str]:
    commands = []
    for block in blocks("bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line for line in joined.splitlines() if line and not line.startswith("#")]
    return commands


def parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI refuses a documented command: diloco {shlex.join(argv)}")


def test_every_documented_shell_command_parses():
    argvs = [a for a in map(diloco_argv, shell_commands()) if a is not None]
    assert {"syncer", "learner"} <= {a[0] for a in argvs}
    assert len(argvs) >= 5  # by hand (2), torchrun, Slurm (2)
    for argv in argvs:
        parse(argv)


def test_kubernetes_manifest_parses_and_its_commands_are_real():
    (manifest,) = blocks("yaml")
    docs = list(yaml.safe_load_all(manifest))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Secret", "PersistentVolumeClaim", "Deployment", "Service", "Job"}
    syncer = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert syncer["args"][0] == "syncer"
    args = parse(syncer["args"])
    assert args.state_dir == "/state"
    learner = kinds["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["command"] == ["sh", "-c"]
    argv = diloco_argv(learner["args"][0])
    assert argv is not None and argv[0] == "learner"
    args = parse(argv)
    assert args.id == "learner-3" and args.index == 3
    assert kinds["Deployment"]["spec"]["strategy"]["type"] == "Recreate"

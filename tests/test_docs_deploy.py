"""docs/deploy.md and deploy/ stay true: the Kubernetes manifests parse and probe what the
syncer serves, and every diloco command (by hand and under torchrun in the doc, in the Slurm
scripts, the Kubernetes manifests and the Containerfile) parses with the real CLI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from diloco.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"
DEPLOY = ROOT / "deploy"
#: Values for the shell variables the examples use.
ENV = {
    "HEAD": "node-1",
    "HOME": "/home/u",
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "42",
    "SLURM_ARRAY_TASK_ID": "3",
    "JOB_COMPLETION_INDEX": "3",
    "SYNCER": "syncer-host:7000",
    "syncer": "@/shared/diloco/syncer.at",
    "DILOCO_RECIPE": "shakespeare",
    "DILOCO_LEARNER_ARGS": "",
    "DILOCO_SYNCER_ARGS": "",
    "index": "3",
    "home": "/shared/diloco",
    "port": "7000",
    "head_node": "node-1",
    "DILOCO_GPUS_PER_NODE": "8",
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


def shell_commands(texts: list[str]) -> list[str]:
    commands = []
    for block in texts:
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line for line in joined.splitlines() if line and not line.startswith("#")]
    return commands


def slurm_scripts() -> list[Path]:
    return sorted((DEPLOY / "slurm").glob("*.sbatch"))


def parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI refuses a documented command: diloco {shlex.join(argv)}")


def test_every_documented_shell_command_parses():
    argvs = [a for a in map(diloco_argv, shell_commands(blocks("bash"))) if a is not None]
    assert {"syncer", "learner", "run"} <= {a[0] for a in argvs}
    assert len(argvs) >= 4  # by hand (2), torchrun, Ray
    for argv in argvs:
        parse(argv)


def test_every_command_of_the_slurm_scripts_parses_and_each_is_documented():
    names = {p.name for p in slurm_scripts()}
    assert names == {"syncer.sbatch", "learner.sbatch", "learner-island.sbatch"}
    doc = DOC.read_text()
    for script in slurm_scripts():
        assert f"`{script.name}`" in doc, script.name
        text = re.sub(r"\$\{(\w+):-[^}]*\}", r"$\1", script.read_text())  # ${X:-d} -> $X
        text = re.sub(r"\$\{(\w+):\?[^}]*\}", r"$\1", text)
        argvs = [a for a in map(diloco_argv, shell_commands([text])) if a is not None]
        assert len(argvs) == 1, (script.name, argvs)
        args = parse(argvs[0])
        assert args.command in ("syncer", "learner")
        if args.command == "learner":  # follows a syncer that moves (a requeue elsewhere)
            assert args.syncer.startswith("syncer-host") or args.syncer.startswith("@")


def manifests() -> dict[str, dict]:
    docs = [
        d
        for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_kubernetes_manifests_parse_and_their_commands_are_real():
    kinds = manifests()
    assert set(kinds) == {
        "Secret/diloco-token",
        "PersistentVolumeClaim/diloco-syncer-state",
        "PersistentVolumeClaim/diloco-learner-work",
        "Deployment/diloco-syncer",
        "Service/diloco-syncer",
        "Job/diloco-learners",
    }
    deployment = kinds["Deployment/diloco-syncer"]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["spec"]["replicas"] == 1
    syncer = deployment["spec"]["template"]["spec"]["containers"][0]
    assert syncer["args"][0] == "syncer"
    args = parse(syncer["args"])
    assert args.state_dir == "/state"
    learner = kinds["Job/diloco-learners"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["command"] == ["sh", "-c"]
    argv = diloco_argv(learner["args"][0])
    assert argv is not None and argv[0] == "learner"
    args = parse(argv)
    assert args.id == "learner-3" and args.index == 3
    assert args.syncer == "diloco-syncer:7000"  # the Service's name and port
    service_ports = {p["port"] for p in kinds["Service/diloco-syncer"]["spec"]["ports"]}
    assert 7000 in service_ports


def test_the_syncers_probes_ask_what_it_serves():
    syncer = manifests()["Deployment/diloco-syncer"]["spec"]["template"]["spec"]["containers"][0]
    args = parse(syncer["args"])
    ports = {p["name"]: p["containerPort"] for p in syncer["ports"]}
    assert args.bind.endswith(f":{ports['grpc']}")
    assert args.dashboard.endswith(f":{ports['http']}")  # /healthz is served there
    assert syncer["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert syncer["readinessProbe"]["tcpSocket"] == {"port": "grpc"}


def test_the_container_image_pins_the_torch_the_project_tests():
    containerfile = (DEPLOY / "container" / "Containerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    (pinned,) = set(re.findall(r"torch==([\d.]+)", makefile))
    assert f'TORCH_SPEC="torch=={pinned}+cpu"' in containerfile
    assert 'ENTRYPOINT ["diloco"]' in containerfile

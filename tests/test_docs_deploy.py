"""docs/deploy.md and deploy/ stay true: the Kubernetes manifests parse and probe what the
syncer serves, and every diloco command (by hand and under torchrun in the doc, in the Slurm
scripts, the Kubernetes manifests and the Containerfile) parses with the real CLI."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
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
    "id": "learner-3",
    "home": "/shared/diloco",
    "port": "7000",
    "head_node": "node-1",
    "DILOCO_GPUS_PER_NODE": "8",
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def substitute(text: str) -> str:
    text = re.sub(r"\$\(\((.*?)\)\)", "3", text)  # arithmetic
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
    pod = kinds["Job/diloco-learners"]["spec"]["template"]["spec"]
    # SIGTERM gives a learner its whole clean stop (flush, drain, leave) before the kill
    from diloco.learner.config import CLOSE_BOUND_S

    assert pod["terminationGracePeriodSeconds"] > CLOSE_BOUND_S
    learner = pod["containers"][0]
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


def test_the_learner_array_runs_each_learner_under_its_sites_wrap_id_and_data_index(tmp_path):
    """learner.sbatch's settings for a site of a run across clusters, run with a stand-in
    ``srun`` that records the command it was given (no Slurm needed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.args"
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "srun").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_ARRAY_TASK_ID": "1",
        "DILOCO_HOME": str(tmp_path),
        "DILOCO_SYNCER": "198.18.0.1:7000",
        "DILOCO_ID_PREFIX": "site-a-",
        "DILOCO_INDEX_OFFSET": "4",
        "DILOCO_WRAP": "ip netns exec site-a",
        "DILOCO_LEARNER_ARGS": "--threads 1 --total-steps 10",
    }
    done = subprocess.run(
        ["bash", str(DEPLOY / "slurm" / "learner.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    argv = record.read_text().splitlines()
    assert argv[:4] == ["ip", "netns", "exec", "site-a"]
    args = parse(diloco_argv(shlex.join(argv)))
    assert (args.id, args.index, args.syncer) == ("site-a-1", 5, "198.18.0.1:7000")
    assert args.workdir == str(tmp_path / "learners" / "1") and args.total_steps == 10
    del env["DILOCO_WRAP"], env["DILOCO_ID_PREFIX"], env["DILOCO_INDEX_OFFSET"]
    subprocess.run(["bash", str(DEPLOY / "slurm" / "learner.sbatch")], env=env, timeout=30)
    args = parse(diloco_argv(shlex.join(record.read_text().splitlines())))
    assert (args.id, args.index) == ("learner-1", 1)  # the defaults: one site


def ray_site_script():
    spec = importlib.util.spec_from_file_location("ray_site", DEPLOY / "ray" / "learners.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ray_site_script_gives_each_learner_its_id_index_and_workdir(tmp_path):
    site = ray_site_script()
    args, flags = site.parse_args(
        [
            "--syncer=198.18.0.5:7000",
            "--token-file=token",
            "--learners=2",
            "--first-index=2",
            "--id-prefix=ray-",
            f"--workdir={tmp_path}",
            "--wrap=ip netns exec site-b",
            "--",
            "--recipe=tiny",
            "--total-steps=10",
        ]
    )
    assert flags == ["--recipe=tiny", "--total-steps=10"]
    for k in range(2):
        parsed = parse(site.learner_command(args, k, flags))
        assert (parsed.id, parsed.index, parsed.syncer) == (f"ray-{k}", 2 + k, "198.18.0.5:7000")
        assert parsed.workdir == str(tmp_path / str(k)) and parsed.total_steps == 10
        assert Path(parsed.token_file).is_absolute()  # the actors' working directory may differ
    with pytest.raises(SystemExit):
        site.parse_args(["--syncer=x:1", "--token-file=t", "--learners=0", "--workdir=w"])
    assert "`deploy/ray/learners.py`" in DOC.read_text()


def stand_in_srun(tmp_path: Path) -> tuple[dict, Path]:
    """A ``PATH`` whose ``srun`` records the command it was given (no Slurm needed), and the
    file it records to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "srun.args"
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "srun").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}, record


def run_script(name: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DEPLOY / "slurm" / name)], env=env, capture_output=True, text=True, timeout=30
    )


def test_the_syncer_array_runs_one_shard_per_task_and_the_learners_read_every_shard(tmp_path):
    env, record = stand_in_srun(tmp_path)
    (tmp_path / "token").write_text("token")
    env |= {"DILOCO_HOME": str(tmp_path), "DILOCO_PORT": "7100", "DILOCO_SHARDS": "2"}
    for task in (0, 1):
        task_env = env | {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "2"}
        done = run_script("syncer.sbatch", task_env)
        assert done.returncode == 0, done.stderr
        args = parse(diloco_argv(shlex.join(record.read_text().splitlines())))
        assert (args.shard, args.bind) == (f"{task}/2", f"0.0.0.0:{7100 + task}")
        assert args.state_dir == str(tmp_path / f"state-{task}")
        assert args.port_file == str(tmp_path / f"syncer-{task}.addr")
        host = (tmp_path / f"syncer-{task}.at").read_text().strip()
        assert host.endswith(f":{7100 + task}")
    # an array that does not match DILOCO_SHARDS, or no array at all: refused, nothing run
    record.unlink()
    for wrong in ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}, {}):
        done = run_script("syncer.sbatch", env | wrong)
        assert done.returncode == 2 and "--array=0-1" in done.stderr, done.stderr
        assert not record.exists()
    # one syncer: as before (state/, syncer.at), every fragment
    done = run_script("syncer.sbatch", env | {"DILOCO_SHARDS": "1"})
    args = parse(diloco_argv(shlex.join(record.read_text().splitlines())))
    assert (args.shard, args.state_dir) == ("0/1", str(tmp_path / "state"))
    assert (tmp_path / "syncer.at").exists()
    # the learners of the sharded syncer: every shard's .at file, followed
    done = run_script("learner.sbatch", env | {"SLURM_ARRAY_TASK_ID": "0"})
    assert done.returncode == 0, done.stderr
    args = parse(diloco_argv(shlex.join(record.read_text().splitlines())))
    assert args.syncer == f"@{tmp_path}/syncer-0.at,@{tmp_path}/syncer-1.at"


@pytest.mark.parametrize("script", ["syncer.sbatch", "learner.sbatch", "learner-island.sbatch"])
def test_a_failed_array_task_requeues_itself_not_its_whole_array(tmp_path, script):
    """An array task whose job id is the array's (Slurm gives the array's id to one task)
    must requeue ``ARRAY_TASK``: ``scontrol requeue ARRAY`` requeues every task."""
    env, record = stand_in_srun(tmp_path)
    bin_dir = tmp_path / "bin"
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 137\n")  # the process was killed
    requeued = tmp_path / "scontrol.args"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {requeued}\n')
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "token").write_text("token")
    (tmp_path / "syncer-0.at").write_text("host:7000")
    (tmp_path / "syncer-1.at").write_text("host:7001")
    env |= {
        "DILOCO_HOME": str(tmp_path),
        "DILOCO_SHARDS": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_ARRAY_JOB_ID": "7",
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_ARRAY_TASK_COUNT": "2",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
    }
    done = run_script(script, env)
    assert done.returncode == 137, done.stderr
    assert requeued.read_text().split() == ["requeue", "7_1"]
    requeued.unlink()  # a job that is no array task requeues itself
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        del env[key]
    env["DILOCO_SHARDS"] = "1"
    if script == "syncer.sbatch":  # (the learner scripts are always array tasks)
        run_script(script, env)
        assert requeued.read_text().split() == ["requeue", "7"]

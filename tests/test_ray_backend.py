"""``diloco run --backend ray`` on a local Ray instance: real actors, real processes, real kill -9.

One run serves the two end-to-end tests (starting Ray and the processes dominates the time on
a small machine): 2 learners train the tiny recipe for a fixed number of steps; once learner-1
has trained and checkpointed, its process is killed with SIGKILL. Ray restarts its actor, which
starts the learner again with the same id and work directory; the run ends when both learners
have done their steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from kit import end_run, last_step, pids_mentioning, start_diloco, wait_until

from diloco.syncer.store import read_tape

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

STEPS = 500


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """Run the backend once, kill -9 learner-1 mid-run; yields what the tests inspect."""
    runs = tmp_path_factory.mktemp("ray-runs")
    run_dir = runs / "r"
    proc = start_diloco(
        "run",
        "--backend=ray",
        "--ray-learner-cpus=1",
        "--ray-learner-gpus=0",
        "--recipe=tiny",
        "--learners=2",
        f"--steps={STEPS}",
        "--minutes=3",
        "--checkpoint-every=1",
        "--eval-every=0",
        f"--runs-dir={runs}",
        "--name=r",
        "--json",
    )
    try:
        work = run_dir / "learners" / "learner-1"
        wait_until(
            lambda: last_step(work) >= 60 and (work / "checkpoint.pt").exists(),
            90,
            "learner-1 to train and checkpoint",
            alive=proc,
        )
        [victim] = pids_mentioning("learner", f"{run_dir}/config/learner-1.json")
        niceness = {pid: nice_of(pid) for pid in pids_mentioning(f"{run_dir}/config/")}
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        out, err = proc.communicate(timeout=240)
        yield {
            "code": proc.returncode,
            "out": out,
            "err": err,
            "run_dir": run_dir,
            "victim": victim,
            "killed_at": killed_at,
            "niceness": niceness,
        }
    finally:
        end_run(proc, run_dir)


def nice_of(pid: int) -> int:
    """The niceness of ``pid`` (its main thread's), from ``/proc``."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_the_syncer_and_learners_run_at_the_drivers_priority_not_rays_workers(ray_run):
    """Ray starts its workers at niceness 15; a learner inheriting it trained not one step in
    90 s beside two other test processes. The actor runs its child at the raylet's."""
    assert ray_run["victim"] in ray_run["niceness"], ray_run["niceness"]  # (learner-1)
    assert set(ray_run["niceness"].values()) == {os.getpriority(os.PRIO_PROCESS, 0)}


@pytest.mark.timeout(360)
def test_a_run_on_ray_trains_and_reports_the_backend(ray_run):
    assert ray_run["code"] == 0, ray_run["err"][-3000:]
    summary = json.loads(ray_run["out"])
    run_dir = ray_run["run_dir"]
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "ray"
    assert summary["stopped_by"] == "learners finished"
    assert summary["tokens"] > 0
    assert {ln["steps"] for ln in summary["per_learner"].values()} == {STEPS}
    assert all(ln["exit_code"] == 0 for ln in summary["per_learner"].values())
    loss = summary["val_loss"]
    assert loss["final"] < 0.8 * loss["initial"], loss
    # The local backend's run directory layout.
    for name in ("config.json", "metrics.jsonl", "syncer/events.jsonl", "logs/syncer.log"):
        assert (run_dir / name).exists(), name
    for i in range(2):
        assert (run_dir / "learners" / f"learner-{i}" / "final.json").exists()
        assert (run_dir / "logs" / f"learner-{i}.log").exists()
    assert pids_mentioning(str(run_dir)) == []


@pytest.mark.timeout(360)
def test_a_learner_killed_with_sigkill_is_restarted_by_ray_and_reintegrated(ray_run):
    assert ray_run["code"] == 0, ray_run["err"][-3000:]
    summary = json.loads(ray_run["out"])
    run_dir = ray_run["run_dir"]
    assert summary["per_learner"]["learner-1"]["restarts"] == 1
    assert summary["per_learner"]["learner-0"]["restarts"] == 0
    records = read_tape(run_dir / "syncer" / "events.jsonl")
    [restart] = [r for r in records if r.get("event") == "restart"]
    assert restart["target"] == "learner-1" and restart["by"] == "ray"
    assert restart["t"] >= ray_run["killed_at"] - 1.0
    # It came back under the same id and took part in a committed round after the restart.
    back = [
        r
        for r in records
        if r.get("event") == "round" and r["t"] > restart["t"] and "learner-1" in r["participants"]
    ]
    assert back, "learner-1 never contributed again"
    [reint] = [r for r in summary["reintegrations"] if r["learner"] == "learner-1"]
    assert reint["reintegration_s"] is not None and reint["reintegration_s"] >= 0
    # It resumed from its own checkpoint, in a new process.
    log = (run_dir / "logs" / "learner-1.log").read_text()
    assert "resumed from" in log and "Ray restarts it" in log
    assert summary["per_learner"]["learner-1"]["steps"] == STEPS


def run_config(*argv: str):
    """The ``RunConfig`` of ``diloco run ARGV``."""
    from diloco.cli import build_parser
    from diloco.config import from_namespace
    from diloco.config.run import RunConfig

    return from_namespace(RunConfig, build_parser().parse_args(["run", *argv]))


def test_what_the_ray_backend_cannot_do_is_refused_up_front(monkeypatch):
    from diloco.launch.ray_backend import check_config

    with pytest.raises(ValueError, match="not supported with --backend ray"):
        check_config(run_config("--backend=ray"), {"kill", "partition"})
    with pytest.raises(ValueError, match="--mode dp"):
        check_config(run_config("--backend=ray", "--mode=dp"), set())
    with pytest.raises(ValueError, match="only with --backend ray"):
        check_config(run_config("--ray-learner-gpus=1"), set())
    with pytest.raises(ValueError, match="--spares: local backend only"):
        check_config(run_config("--backend=ray", "--spares=1"), set())
    with pytest.raises(ValueError, match="--address auto"):
        check_config(run_config("--backend=ray", "--address=ray://head:10001"), set())
    config = run_config("--backend=ray", "--ray-learner-cpus=2")
    check_config(config, {"kill", "hang", "syncer-kill", "corrupt"})
    ray = config.ray
    assert (ray.ray_learner_cpus, ray.ray_learner_gpus, ray.ray_max_restarts) == (2, 0, -1)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ValueError, match=r"pip install 'diloco\[ray\]'"):
        check_config(run_config("--backend=ray"), set())


def test_a_sharded_syncer_is_accepted_and_each_shard_has_its_own_label():
    from diloco.launch.ray_backend import check_config, syncer_resources

    config = run_config("--backend=ray", "--shards=2", "--ray-syncer-resource=hub-0,hub-1")
    check_config(config, {"kill"})
    assert [syncer_resources("hub-0,hub-1", i) for i in range(3)] == [
        {"hub-0": 0.001},
        {"hub-1": 0.001},
        {"hub-0": 0.001},
    ]
    assert syncer_resources(None, 1) == {}
    with pytest.raises(ValueError, match="a resource name is empty"):
        check_config(run_config("--backend=ray", "--ray-syncer-resource=hub-0,"), set())
    with pytest.raises(ValueError, match="more --ray-syncer-resource names than --shards"):
        check_config(run_config("--backend=ray", "--ray-syncer-resource=a,b"), set())

"""``diloco run --backend ray`` on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``:
a head and several nodes on this machine, each its own raylet with its own resources),
started once for the module.

One run: the learners are spread over two "sites" (a custom resource per node, one site per
learner), the syncer runs on a "hub" node. Mid-run, site-b's node is lost (its raylet and
workers killed): only learner-1 stops, learner-0 keeps committing; a replacement site-b node
joins and learner-1 comes back there from its checkpoint. Then the syncer's node is lost: a
replacement hub node joins, Ray restarts the syncer there from its state directory, on a new
address the learners follow (``--syncer @FILE``). Every step is audited exactly once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kit import end_run, last_step, start_diloco, wait_until

from diloco.report.audit_files import audit_directories
from diloco.syncer.store import read_tape

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

STEPS = 4000
"""Per learner: enough that neither finishes before the syncer has moved (on an idle machine
learner-0, alone while site b is lost, trained 1,500 steps in 21 s and finished 2 s before
the moved syncer served; the moves take ~40 s)."""
LEARNERS = 2


def rounds_of(run_dir: Path) -> list[dict]:
    path = run_dir / "syncer" / "events.jsonl"
    return [r for r in read_tape(path) if r["event"] == "round"] if path.exists() else []


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    nodes = {}
    try:
        for name, resources in (("site-a", {"site-a": 1}), ("site-b", {"site-b": 1})):
            nodes[name] = cluster.add_node(num_cpus=1, resources=resources)
        nodes["hub"] = cluster.add_node(num_cpus=1, resources={"hub": 1})
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_run(cluster, tmp_path_factory):
    cluster, nodes = cluster
    runs = tmp_path_factory.mktemp("ray-cluster")
    run_dir = runs / "r"
    token = runs / "token"
    token.write_text("ray-cluster-test-token-0123456789")
    token.chmod(0o600)
    proc = start_diloco(
        "run",
        "--backend=ray",
        f"--address={cluster.address}",
        f"--token-file={token}",
        "--ray-learner-resources=site-a,site-b",
        "--ray-syncer-resource=hub",
        "--ray-syncer-cpus=0",
        "--recipe=tiny",
        f"--learners={LEARNERS}",
        f"--steps={STEPS}",
        "--slow=0=3",
        "--slow=1=3",
        "--minutes=4",
        "--checkpoint-every=1",
        "--eval-every=0",
        f"--runs-dir={runs}",
        "--name=r",
        "--json",
    )
    events = {}
    try:
        work = [run_dir / "learners" / f"learner-{i}" for i in range(LEARNERS)]
        wait_until(
            lambda: last_step(work[1]) >= 150 and (work[1] / "checkpoint.pt").exists(),
            150,
            "learner-1 to train and checkpoint",
            interval=0.2,
            alive=proc,
        )
        # Site b's node is lost: its raylet and workers die with it.
        events["site_lost"] = time.time()
        cluster.remove_node(nodes["site-b"], allow_graceful=False)
        step0 = last_step(work[0])
        wait_until(
            lambda: any(
                r["t"] > events["site_lost"] + 3 and r["participants"] == ["learner-0"]
                for r in rounds_of(run_dir)
            ),
            60,
            "learner-0 to commit alone",
            interval=0.2,
            alive=proc,
        )
        events["learner1_while_lost"] = last_step(work[1])
        events["learner0_progress_while_lost"] = last_step(work[0]) - step0
        events["site_back"] = time.time()
        nodes["site-b2"] = cluster.add_node(num_cpus=1, resources={"site-b": 1})
        wait_until(
            lambda: any(
                r["t"] > events["site_back"] and "learner-1" in r["participants"]
                for r in rounds_of(run_dir)
            ),
            90,
            "learner-1 back in a committed round",
            interval=0.2,
            alive=proc,
        )
        # The syncer's node is lost; a replacement hub node joins.
        port_file = run_dir / "syncer.addr"
        events["address_before"] = port_file.read_text().strip()
        events["hub_lost"] = time.time()
        cluster.remove_node(nodes["hub"], allow_graceful=False)
        time.sleep(1.0)
        nodes["hub2"] = cluster.add_node(num_cpus=1, resources={"hub": 1})
        wait_until(
            lambda: port_file.read_text().strip() != events["address_before"],
            90,
            "the syncer to serve again on the replacement node",
            interval=0.2,
            alive=proc,
        )
        events["moved_at"] = time.time()
        events["address_after"] = port_file.read_text().strip()
        wait_until(
            lambda: (
                {
                    p
                    for r in rounds_of(run_dir)
                    if r["t"] > events["moved_at"]
                    for p in r["participants"]
                }
                == {f"learner-{i}" for i in range(LEARNERS)}
            ),
            90,
            "both learners in rounds of the moved syncer",
            interval=0.2,
            alive=proc,
        )
        out, err = proc.communicate(timeout=300)
        yield {"code": proc.returncode, "out": out, "err": err, "run_dir": run_dir, **events}
    finally:
        end_run(proc, run_dir)


@pytest.mark.timeout(600)
def test_a_run_on_a_multi_node_cluster_finishes_and_counts_every_step_once(ray_run):
    assert ray_run["code"] == 0, ray_run["err"][-3000:]
    summary = json.loads(ray_run["out"])
    assert summary["backend"] == "ray" and summary["stopped_by"] == "learners finished"
    assert {ln["steps"] for ln in summary["per_learner"].values()} == {STEPS}
    run_dir = ray_run["run_dir"]
    verdict = audit_directories(
        run_dir / "syncer",
        {f"learner-{i}": run_dir / "learners" / f"learner-{i}" for i in range(LEARNERS)},
        stopped_cleanly=True,
    )
    assert verdict.ok, verdict.problems
    assert verdict.lives == LEARNERS + 1  # learner-1 lived twice


@pytest.mark.timeout(600)
def test_a_lost_node_stops_only_its_learners_and_they_rejoin_on_a_replacement(ray_run):
    # While site b was gone learner-1 did not train and learner-0 went on.
    assert ray_run["learner0_progress_while_lost"] > 0
    summary = json.loads(ray_run["out"])
    assert summary["per_learner"]["learner-1"]["restarts"] == 1
    assert summary["per_learner"]["learner-0"]["restarts"] == 0
    log = (ray_run["run_dir"] / "logs" / "learner-1.log").read_text()
    assert "resumed from" in log


@pytest.mark.timeout(600)
def test_the_syncer_moves_to_another_node_and_the_learners_follow_it(ray_run):
    assert ray_run["address_after"] != ray_run["address_before"]
    rounds = rounds_of(ray_run["run_dir"])
    before = {r["fragment"]: r["version"] for r in rounds if r["t"] < ray_run["hub_lost"]}
    after = [r for r in rounds if r["t"] > ray_run["moved_at"]]
    assert after and all(r["version"] > before.get(r["fragment"], 0) for r in after)
    log = (ray_run["run_dir"] / "logs" / "syncer.log").read_text()
    assert log.count("diloco syncer serving on") == 2, log[-2000:]

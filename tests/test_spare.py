"""Warm spares: real interpreters that import torch, then become the restarted child."""

import json
from pathlib import Path

import pytest
from kit import wait_until

from diloco.chaos import ChaosEvent
from diloco.launch.supervisor import Supervisor
from diloco.runtime.procs import Child, diloco_command
from diloco.runtime.spare import assignment, parse_assignment, spare_count


def wait_exit(child: Child, timeout: float = 90.0) -> int:
    return child.proc.wait(timeout)


def test_assignment_round_trips_and_bad_lines_are_refused():
    line = assignment(["learner", "--id=x"], "/tmp/x.log").decode()
    assert parse_assignment(line) == (["learner", "--id=x"], "/tmp/x.log")
    for bad in (
        "not json",
        json.dumps(["learner"]),
        json.dumps({"argv": [], "log": "l"}),
        json.dumps({"argv": ["a", 1], "log": "l"}),
        json.dumps({"argv": ["a"], "log": ""}),
        json.dumps({"argv": ["a"], "log": "l", "extra": 1}),
    ):
        with pytest.raises(ValueError):
            parse_assignment(bad)


def test_spare_count_default_follows_the_chaos_schedule():
    kill = [ChaosEvent(10.0, "kill", "learner-0", 5.0)]
    hang = [ChaosEvent(10.0, "hang", "learner-0", 5.0)]
    assert spare_count(-1, kill, restart_together=1, learners=4) == 2  # DiLoCo: two
    assert spare_count(-1, kill, restart_together=1, learners=1) == 1  # not more than learners
    assert spare_count(-1, kill, restart_together=4, learners=4) == 4  # dp: the whole group
    assert spare_count(-1, hang, restart_together=1, learners=4) == 0
    assert spare_count(-1, [], restart_together=1, learners=4) == 0
    assert spare_count(2, [], restart_together=1, learners=4) == 2
    with pytest.raises(ValueError):
        Supervisor(tape=lambda r: None, clock=lambda: 0.0, spares=-1)


@pytest.mark.slow
def test_a_spare_runs_the_command_it_is_given_into_the_given_log(tmp_path):
    spare = Child.spare(tmp_path / "spare.log")
    try:
        pid = spare.pid
        spare.assign("planner", diloco_command("plan", "--help"), tmp_path / "planner.log")
        assert wait_exit(spare) == 0
        assert spare.pid == pid and spare.name == "planner"
        assert "usage: diloco plan" in (tmp_path / "planner.log").read_text()
        assert "usage" not in (tmp_path / "spare.log").read_text()
        with pytest.raises(RuntimeError):
            spare.assign("again", diloco_command("plan"), tmp_path / "x.log")
    finally:
        spare.kill()


def test_a_spare_refuses_a_command_that_is_not_a_diloco_one(tmp_path):
    spare = Child.spare(tmp_path / "spare.log")
    try:
        with pytest.raises(ValueError):
            spare.assign("sh", ["/bin/sh", "-c", "echo hi"], tmp_path / "sh.log")
    finally:
        spare.kill()
        spare.proc.wait(10)


@pytest.mark.slow
def test_an_idle_spare_exits_when_the_supervisor_closes_its_pipe(tmp_path):
    spare = Child.spare(tmp_path / "spare.log")
    spare.proc.stdin.close()
    try:
        assert wait_exit(spare) == 0
    finally:
        spare.kill()


@pytest.mark.slow
def test_a_crashed_child_restarts_warm_and_the_spare_is_replaced(tmp_path):
    tape, clock = [], [0.0]
    sup = Supervisor(tape=tape.append, clock=lambda: clock[0], spares=1)
    try:
        # exits 2 at once (an unknown flag): an unplanned crash, restarted after 1 s
        slot = sup.add("learner-0", diloco_command("learner", "--bogus"), tmp_path / "l0.log")
        sup.start_chaos()
        first_spare = sup._spares[0].pid
        slot.child.proc.wait(60)
        sup.poll()
        clock[0] = 2.0
        sup.poll()
        restarts = [r for r in tape if r["event"] == "restart"]
        assert restarts and restarts[0]["warm"] is True
        assert slot.child.pid == first_spare
        assert len(sup._spares) == 1 and sup._spares[0].pid != first_spare
        slot.child.proc.wait(90)  # the spare ran the learner command: the same error, logged
        assert slot.child.poll() == 2
        assert (tmp_path / "l0.log").read_text().count("unrecognized arguments: --bogus") == 2
        spare = sup._spares[0]
    finally:
        sup.kill_everything()
        sup.close()
    wait_until(lambda: not spare.running, 10, "the spare to end", interval=0.05)
    assert sup._spares == []


@pytest.mark.slow
def test_a_dead_spare_is_replaced_and_the_syncer_never_takes_one(tmp_path):
    tape, clock = [], [0.0]
    sup = Supervisor(tape=tape.append, clock=lambda: clock[0], spares=1)
    try:
        syncer = sup.add("syncer", diloco_command("syncer", "--bogus"), tmp_path / "s.log")
        learner = sup.add("learner-0", diloco_command("learner", "--bogus"), tmp_path / "l.log")
        sup.start_chaos()
        dead = sup._spares[0]
        dead.kill()
        dead.proc.wait(10)
        syncer.child.proc.wait(60)
        learner.child.proc.wait(60)
        sup.poll()  # the syncer restarts at once, fresh; the learner after 1 s
        clock[0] = 2.0
        sup.poll()
        warm = {r["target"]: r["warm"] for r in tape if r["event"] == "restart"}
        assert warm == {"syncer": False, "learner-0": False}
        assert len(sup._spares) == 1 and sup._spares[0].pid != dead.pid
    finally:
        sup.kill_everything()
        sup.close()


def main_thread_nice(pid: int) -> int:
    """The niceness of ``pid``'s main thread (Linux keeps one per thread), from ``/proc``."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.mark.slow
def test_a_restart_handed_to_a_spare_still_warming_up_gets_full_priority_at_once(tmp_path):
    """A spare warms up at a lower priority; a restart handed over before its imports end must
    not finish them at that priority (on a busy machine, a warm restart once waited 35 s)."""
    import os
    import subprocess
    import sys

    from diloco.runtime.spare import WARM_UP_NICE, can_restore_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not can_restore_priority(base) or base + WARM_UP_NICE > 19:
        pytest.skip("this process may not raise a priority back")
    gate = tmp_path / "imports-done"
    warming = (  # the spare's own main, its imports held until the test opens the gate
        "import os, sys, time\n"
        "import diloco.cli.spare as spare\n"
        "def held():\n"
        "    while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
        "spare.warm_up = held\n"
        "sys.exit(spare.main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", warming, str(gate)], stdin=subprocess.PIPE)
    try:
        wait_until(lambda: main_thread_nice(proc.pid) == base + WARM_UP_NICE, 30, "warming up")
        proc.stdin.write(assignment(["plan", "--help"], str(tmp_path / "plan.log")))
        proc.stdin.flush()
        wait_until(lambda: main_thread_nice(proc.pid) == base, 20, "the priority restored")
        assert not gate.exists() and proc.poll() is None  # still in its imports
        gate.touch()
        assert proc.wait(60) == 0
        assert "usage" in (tmp_path / "plan.log").read_text()
    finally:
        proc.kill()
        proc.wait()

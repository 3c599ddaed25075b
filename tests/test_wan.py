"""Wide-area links: the spec grammar (pure), and real namespaces, real ``tbf``, real runs.

The tests that make namespaces need root and iproute2 (CI runs as root on this machine kind);
they are skipped elsewhere, with the reason. Every namespace they make is removed, also when
a test fails (the fabric's ``with``, and the sweep of a dead owner's namespaces).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kit import diloco_command, pids_mentioning, run_diloco_json, wait_until

from diloco.launch.wan import on_link, wan_section
from diloco.runtime.units import format_rate, parse_rate
from diloco.wan import fabric as fab
from diloco.wan.fabric import Fabric, LinkCounters, WanUnavailable, link_addresses, tbf_args
from diloco.wan.spec import LinkSpec, parse_link, plan_links

CAN_MAKE_NAMESPACES = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
_can_make_namespaces = pytest.mark.skipif(
    not CAN_MAKE_NAMESPACES, reason="needs root and iproute2 to make network namespaces"
)


def netns(test):
    """A test on real network namespaces: root only, and ``slow`` (it starts processes)."""
    return pytest.mark.slow(_can_make_namespaces(test))


# ----------------------------------------------------------------------- pure


def test_rates_parse_in_tc_units_and_print_back():
    assert parse_rate("50mbit") == 50e6
    assert parse_rate("1.5Gbit") == 1.5e9
    assert parse_rate("300kbit") == 3e5
    assert parse_rate("none", unshaped_ok=True) is None
    assert format_rate(5e7) == "50mbit" and format_rate(None) == "none"
    assert parse_rate(format_rate(2.5e8)) == 2.5e8
    for bad in ("50", "fast", "-1mbit", "0mbit", "mbit", "none"):  # a bare number: no unit
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)
    assert parse_link("rate=50Mbps").up_bps == 50e6  # diloco plan's spelling reads the same
    assert parse_link("rate=none") == LinkSpec()
    with pytest.raises(ValueError, match="say its unit"):
        parse_link("rate=50")


def test_link_specs_apply_in_order_and_name_learners():
    links = plan_links(["rate=50mbit,rtt=40ms", "2,3:rate=5mbit", "3:down=1mbit"], 4)
    assert links[0] == links[1] == LinkSpec(50e6, 50e6, 0.04)
    assert links[2] == LinkSpec(5e6, 5e6, 0.04)
    assert links[3] == LinkSpec(5e6, 1e6, 0.04)
    assert parse_link("up=1mbit") == LinkSpec(1e6, None, 0.0)
    assert links[3].describe() == "5mbit/1mbit 40ms"
    with pytest.raises(ValueError, match="does not exist"):
        plan_links(["4:rate=1mbit"], 4)
    with pytest.raises(ValueError, match="unknown key"):
        plan_links(["speed=1mbit"], 2)
    with pytest.raises(ValueError, match="key=value"):
        plan_links(["1mbit"], 2)
    with pytest.raises(ValueError, match="duration"):
        plan_links(["rtt=soon"], 2)


def test_addresses_stay_in_the_benchmarking_range_and_never_overlap():
    seen = set()
    for i in range(300):
        hub, learner = link_addresses(i)
        assert hub.startswith("198.1") and learner.startswith("198.1")
        assert not {hub, learner} & seen
        seen |= {hub, learner}
    assert link_addresses(0) == ("198.18.0.1", "198.18.0.2")
    with pytest.raises(ValueError):
        link_addresses(1 << 15)


def test_token_bucket_holds_at_least_two_frames_and_four_ms():
    assert tbf_args(1e6)[:3] == ["tbf", "rate", "1000000bit"]
    assert int(tbf_args(1e6)[4]) >= 3000
    assert int(tbf_args(1e9)[4]) == int(1e9 / 8 * 0.004)


def test_addresses_are_rewritten_per_link():
    assert on_link("0.0.0.0:7000", "198.18.0.5") == "198.18.0.5:7000"
    assert on_link("0.0.0.0:1,0.0.0.0:2", "127.0.0.1") == "127.0.0.1:1,127.0.0.1:2"


def test_wan_section_compares_like_with_like():
    class Plan:
        def __init__(self, i):
            self.index, self.id = i, f"learner-{i}"

    class FakeFabric:  # only its specs are read
        links = [LinkSpec(1e6, 1e6, 0.0), LinkSpec(1e6, 1e6, 0.0)]

    summary = {
        "tokens": 1000,
        "per_learner": {
            "learner-0": {"bytes_up": 100, "bytes_down": 0},
            "learner-1": {"bytes_up": 100, "bytes_down": 0},
        },
    }
    counters = [LinkCounters(up=110, down=120), LinkCounters(up=130, down=90)]
    wan = wan_section(FakeFabric(), counters, summary, [Plan(0), Plan(1)])
    assert wan["links"]["learner-0"]["up_ratio"] == pytest.approx(1.1)
    assert wan["links"]["learner-0"]["down_ratio"] is None  # the transport did not count it
    assert wan["up_ratio"] == pytest.approx(1.2)
    assert wan["iface_bytes_per_token"] == pytest.approx(0.45)


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fab.os, "geteuid", lambda: 1000)
    with pytest.raises(WanUnavailable, match="root"):
        fab.check_available()


def test_run_refuses_what_the_harness_cannot_carry(tmp_path):
    proc = subprocess.run(
        diloco_command("run", "--recipe=tiny", "--minutes=0.1")
        + ["--wan=rate=1mbit", "--chaos=partition:mtbf=90s,down=5-10s", f"--runs-dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not supported with --wan" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


# ------------------------------------------------------------ real namespaces


def _owned_by(pid: int) -> list[str]:
    return [name for name, owner in fab.owned_namespaces().items() if owner == pid]


@netns
def test_a_shaped_link_holds_its_rate_and_round_trip():
    from diloco.wan.probe import measure_rate, measure_rtt

    links = [LinkSpec(20e6, 8e6, 0.0), LinkSpec(10e6, 10e6, 0.04)]
    with Fabric(links) as f:
        assert len(_owned_by(os.getpid())) == 3  # the hub and two learners
        up = measure_rate(f, 0, up=True, seconds=2.5)
        down = measure_rate(f, 0, up=False, seconds=2.5)
        assert 0.85 * 20e6 <= up <= 1.15 * 20e6, up
        assert 0.85 * 8e6 <= down <= 1.15 * 8e6, down
        delayed = measure_rate(f, 1, up=True, seconds=2.5)  # through the delay bridge
        assert 0.85 * 10e6 <= delayed <= 1.15 * 10e6, delayed
        assert measure_rtt(f, 0) < 0.005
        assert 0.038 <= measure_rtt(f, 1) <= 0.060
        counted = f.counters()
        assert counted[0].up >= 2.5 * 0.85 * 20e6 / 8  # the kernel saw the bytes go out
    assert _owned_by(os.getpid()) == []


@netns
def test_namespaces_of_a_dead_owner_are_swept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    f = Fabric([LinkSpec(1e6, 1e6, 0.02)], owner=dead.pid)  # a run that crashed
    bridge = f.bridges[0]
    try:
        assert len(_owned_by(dead.pid)) == 2
        swept = fab.sweep_leftovers()
        assert sorted(swept) == sorted([f.hub, f.namespace(0)])
        assert _owned_by(dead.pid) == []
        assert bridge.wait(timeout=10) is not None  # the bridge inside was killed
    finally:
        f.close()


def _run_json(tmp_path, *flags: str) -> dict:
    """``diloco run`` of the tiny recipe, two learners, to its end: its summary."""
    return run_diloco_json(
        "run", "--recipe=tiny", "--learners=2", "--json", "--no-view",
        f"--runs-dir={tmp_path}", "--name=r", *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def shaped_runs(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Two runs over shaped links, side by side (each in namespaces of its own; both bounded
    by time, so together they take the time of one), by name: their summaries and runs
    directories.

    ``decoupled``: int4 up, int8 down (the former default): the tiny recipe's payloads in the
    default's one- and two-bit codecs are smaller than their headers, and the bound on it is
    about counting payloads, not headers. ``dp``: data-parallel ranks."""
    if not CAN_MAKE_NAMESPACES:
        pytest.skip("needs root and iproute2 to make network namespaces")
    flags = {
        "decoupled": ("--minutes=0.3", "--wan=rate=20mbit,rtt=20ms", "--wan=1:up=5mbit",
                      "--up-codec=int4", "--down-codec=int8"),
        "dp": ("--mode=dp", "--minutes=0.25", "--wan=rate=50mbit"),
    }  # fmt: skip
    dirs = {name: tmp_path_factory.mktemp(name) for name in flags}
    with ThreadPoolExecutor(len(flags)) as pool:
        running = {name: pool.submit(_run_json, dirs[name], *f) for name, f in flags.items()}
        return {name: (run.result(), dirs[name]) for name, run in running.items()}


@netns
def test_a_run_over_shaped_links_commits_and_its_interfaces_count_its_bytes(shaped_runs):
    summary, tmp_path = shaped_runs["decoupled"]
    assert summary["rounds"] > 0 and summary["stopped_by"] == "time"
    assert summary["val_loss"]["final"] < summary["val_loss"]["initial"]
    wan = summary["wan"]
    assert wan["links"]["learner-1"]["link"] == "5mbit/20mbit 20ms"
    for link in wan["links"].values():
        assert link["transport_up"] > 0 and link["transport_down"] > 0
        # every payload byte crossed the interface, plus gRPC, TCP/IP and Ethernet headers and
        # the heartbeats: more, but of the same order (the tiny recipe's fragments are small)
        assert 1.0 <= link["up_ratio"] <= 3.0, link
        assert 1.0 <= link["down_ratio"] <= 3.0, link
    assert (tmp_path / "r" / "token").stat().st_mode & 0o077 == 0  # a fresh token, private
    assert _owned_by_run_leftovers() == []


def _owned_by_run_leftovers() -> list[str]:
    """Namespaces whose owner is gone (a run that did not clean up)."""
    return [n for n, pid in fab.owned_namespaces().items() if not fab._alive(pid)]


@netns
def test_data_parallel_ranks_all_reduce_over_their_links(shaped_runs):
    summary, _ = shaped_runs["dp"]
    assert summary["rounds"] > 0
    for link in summary["wan"]["links"].values():
        # a rank counts the all-reduce bytes it sends; its interface sees them with headers
        assert 1.0 <= link["up_ratio"] <= 1.2, link
        assert link["iface_down"] >= link["transport_up"]  # and receives as much


@netns
def test_a_killed_run_leaves_nothing_after_the_next_start(tmp_path):
    proc = subprocess.Popen(
        diloco_command("run", "--recipe=tiny", "--learners=2")
        + ["--minutes=2", "--no-view", f"--runs-dir={tmp_path}", "--wan=rate=10mbit,rtt=10ms"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: len(_owned_by(proc.pid)) == 3, 60, "the run's namespaces", alive=proc)
        # learners and the bridges are up: both learners train (through their links)
        wait_until(lambda: _training(tmp_path) == 2, 60, "both learners training", alive=proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    leftovers = _owned_by(proc.pid)
    assert len(leftovers) == 3  # kill -9: nobody cleaned up
    with Fabric([LinkSpec()]):  # the next harness sweeps them at start
        assert _owned_by(proc.pid) == []
    # the children inside went with their namespaces
    wait_until(lambda: not pids_mentioning(str(tmp_path)), 20, "the run's children to end")


def _training(runs_dir) -> int:
    """How many learners of the run under ``runs_dir`` have logged that they train."""
    logs = runs_dir.glob("*/logs/learner-*.log")
    return sum("training from step" in log.read_text() for log in logs)


@netns
def test_torchft_replica_groups_sync_over_their_links(tmp_path):
    pytest.importorskip("torchft")
    from diloco.baselines.torchft.peer import run_torchft

    summary = run_torchft(
        learners=2, recipe="tiny", rounds=2, minutes=0.0, wan=("rate=20mbit,rtt=10ms",)
    )
    assert summary["rounds"] >= 2 and summary["replicas_max_diff"] == 0.0
    for link in summary["wan"]["links"].values():
        # the kernel's TCP_INFO payload count per socket, against the frames on the wire
        assert 1.0 <= link["up_ratio"] <= 1.3, link
        assert 1.0 <= link["down_ratio"] <= 1.3, link
    assert [n for n, pid in fab.owned_namespaces().items() if pid == os.getpid()] == []

"""Settings of the test process itself, the fixtures several test modules share, and how the
suite is spread over pytest-xdist's workers.

Many tests run several in-process learners (threads) beside a syncer on a 2-core machine;
one torch thread per process keeps them from oversubscribing the cores (the Learner leaves
the thread count to its user, see ``LearnerConfig.cpu_threads``).

``make test`` runs the suite on pytest-xdist's workers with ``--dist loadfile``: every module
runs whole on one worker, and the modules of a ``SHARED_MODULES`` group on one worker, one
after the other. The longest modules (``LONGEST_FIRST``) are handed out first, longest
first, then the other modules with ``slow`` tests, so that the many short modules fill the
end of the run and the workers end together. The ``solo`` modules (``SOLO_MODULES``) run
afterwards, in one process.
"""

from __future__ import annotations

import os

import pytest
import torch

from diloco.runtime.disk import SmallDisk

torch.set_num_threads(1)
# Ray in the tests serves this host only: its nodes take 127.0.0.1 as their address (read
# when Ray is imported; ``diloco.launch.ray_backend.LOOPBACK_CLUSTER_ENV``).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


#: Test modules that share something beyond their own temporary directories, by group: a
#: group runs on one worker, its modules one after the other. Ray instances on one host share
#: ``/tmp/ray`` (their sessions, the address of the latest cluster: ``test_launch`` starts
#: local ones too); the Slurm cluster's daemons and a Ray cluster's beside each other starved
#: Slurm's requeue of a shard (not restarted within 90 s; alone, within 10 s).
SHARED_MODULES = {
    "clusters": ("test_ray_backend.py", "test_ray_cluster.py", "test_slurm.py", "test_launch.py")
}
_GROUP_OF = {module: group for group, modules in SHARED_MODULES.items() for module in modules}
#: The modules (or ``SHARED_MODULES`` groups: their first module) that take longest on one
#: worker, longest first: a worker that starts one near the end of the run ends alone. The
#: clusters group is one chain of ~5 minutes (the Ray runs, then a Slurm cluster's two),
#: every other here 30-70 s (the clean-clone CI run's ``--durations``).
LONGEST_FIRST = (
    "test_ray_backend.py",
    "test_bench_e2e.py",
    "test_accounting.py",
    "test_recipes_run.py",
    "test_dp.py",
    "test_island.py",
    "test_cli_errors.py",
    "test_scavenging.py",
    "test_sync_mode.py",
)
#: Test modules whose claims are about time under chaos (commit gaps, stalls, a run's quality
#: at a wall-clock budget): marked ``solo``, and ``make test`` runs them after the parallel
#: part, one at a time, so that no other test process takes their CPU.
SOLO_MODULES = (
    "test_resilience.py",
    "test_torture.py",
    "test_corrupt.py",
    "test_wan.py",
    "test_dashboard_live.py",
)


def pytest_ignore_collect(collection_path, config):
    """Under ``-m solo`` (``make test``'s second part) only ``SOLO_MODULES`` are collected:
    importing every other test module only to deselect its tests took seconds."""
    if config.getoption("markexpr") == "solo" and collection_path.suffix == ".py":
        return collection_path.name.startswith("test_") and collection_path.name not in SOLO_MODULES
    return None


def pytest_collection_modifyitems(items):
    """Mark the tests of ``SOLO_MODULES`` ``solo``; order the modules: ``LONGEST_FIRST`` in
    its order, then the others with ``slow`` tests, then the rest; each module's tests stay
    together, in their order (a stable sort)."""
    for item in items:
        if item.path.name in SOLO_MODULES:
            item.add_marker(pytest.mark.solo)
    slow_modules = {item.path.name for item in items if item.get_closest_marker("slow")}
    ranks = {name: rank for rank, name in enumerate(LONGEST_FIRST)}

    def place(item) -> tuple[int, int]:
        name = item.path.name
        group = SHARED_MODULES.get(_GROUP_OF.get(name, ""), ())
        first = group[0] if group else name
        if first in ranks:
            return (0, ranks[first])
        return (1 if name in slow_modules else 2, 0)

    items.sort(key=place)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: every module whole on one worker (its module-scoped fixtures
    built once), the modules of a ``SHARED_MODULES`` group on the same worker, handed out
    in collection order (with ``--no-loadscope-reorder``: slow modules first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedModulesScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _GROUP_OF.get(path.rsplit("/", 1)[-1], path)

    return SharedModulesScheduling(config, log)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted in the test's directory (root only; skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    disk = SmallDisk(tmp_path / "small-disk", 4 << 20)
    try:
        yield disk
    finally:
        disk.unmount()


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple[str, str]]:
    """What the test's code asks of the disk from now on, in order: ``("fsync", path)`` for
    each ``os.fsync`` (the path its descriptor names) and ``("replace", source)`` for each
    ``os.replace``; both still happen."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events

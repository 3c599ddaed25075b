"""``benchmarks/bench_e2e_124m.py --quick``: the 124M end-to-end benchmark's whole path (plain
loop, a learner with a real syncer process, two learners, the export to shards) on a tiny
GPT-2. Its speed, memory and export-memory ratios mean nothing at this size (the processes'
imports outweigh the model); what it shows is that the benchmark runs, the syncer makes
every due commit, every trained step comes back merged, and the shards load back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e_124m.py"
QUICK_STEPS = 20
"""The ``--quick`` size's measured steps."""
WARMUP = 5
"""``bench_learner_overhead.WARMUP``: steps before the measured ones."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quick_end_to_end_benchmark_makes_every_due_commit_and_exports(tmp_path):
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--repeats", "1", "--json", str(result),
         "--keep", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=540, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, (done.stderr + done.stdout)[-4000:]
    summary = json.loads(result.read_text())
    [run] = summary["runs"]
    fleet = run["fleet"]
    assert set(fleet["learners"]) == {"a", "b"}
    for learner in [run["learner"], *fleet["learners"].values()]:
        assert learner["trained"] == WARMUP + QUICK_STEPS
        assert learner["merged_min"] == learner["trained"], learner  # every step, merged
    # The clock asked about P/H = 1.5 rounds per step of the 20 measured: all were made.
    assert fleet["due"] > QUICK_STEPS, fleet
    assert fleet["every_due_commit"] and fleet["made"] == fleet["ticks"], fleet
    assert summary["targets"]["every_due_commit"] and summary["targets"]["every_step_merged"]
    export = run["export"]
    assert export["shards"] > 1 and export["loads_back"], export
    index = json.loads((tmp_path / "runs" / "repeat-0" / "export" /
                        "model.safetensors.index.json").read_text())  # fmt: skip
    assert len(set(index["weight_map"].values())) == export["shards"]


def test_a_childs_peak_memory_is_its_own_not_its_large_parents():
    """The benchmarks' children report their own peak (``bench_learner_overhead.peak_rss_mb``):
    ``ru_maxrss`` would carry the peak of a parent that held 400 MiB when it started them
    (the 124M benchmark's own, once it had loaded an exported model back)."""
    parent = (
        "import subprocess, sys\n"
        "held = bytearray(400 << 20)\n"
        "for i in range(0, len(held), 4096): held[i] = 1\n"
        "child = 'import sys; sys.path.insert(0, sys.argv[1]); import bench_learner_overhead as o;"
        " print(o.peak_rss_mb())'\n"
        "sys.exit(subprocess.run([sys.executable, '-c', child, sys.argv[1]]).returncode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", parent, str(BENCH.parent)], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    child_peak_mb = float(done.stdout.strip().splitlines()[-1])
    assert child_peak_mb < 300, child_peak_mb  # (an interpreter with torch not imported: ~20)

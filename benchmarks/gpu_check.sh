#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA device (`make gpu-check`):
#
#   1. tests/test_gpu.py: a learner on the GPU merges every trained step exactly once and its
#      parameters never leave the device (it must pass, not be skipped);
#   2. benchmarks/bench_learner_overhead.py --device cuda: steps/s with syncing on and off,
#      the device's peak memory and the processes' resident memory;
#
# then one table with the card's name (nvidia-smi). At most 8 minutes on one GPU: each step
# has its own time limit. Without a CUDA device it exits 1 with one line.
#
# PYTHON: the interpreter to use (default .venv/bin/python); it needs a CUDA build of torch
# (`make setup` installs the CPU build: install torch's CUDA build into the venv first).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
TEST_LIMIT_S=240   # tests/test_gpu.py: its own timeout is 180 s, plus the interpreter's start
BENCH_LIMIT_S=210  # the benchmark: 3 repeats of 2 modes of a 50M-parameter GPT on the GPU
BENCH_ARGS=(--device cuda --batch 32 --steps 100 --repeats 3)

fail() {
    echo "gpu-check: $*" >&2
    exit 1
}

[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null || fail "no Python at $PYTHON (set PYTHON)"
command -v nvidia-smi >/dev/null || fail "no CUDA device: nvidia-smi is not installed"
card="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    | head -n 1)" || true
[ -n "$card" ] || fail "no CUDA device: nvidia-smi lists no GPU"
torch_seen="$("$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' \
    2>/dev/null)" || torch_seen="(not importable) False"
[ "${torch_seen##* }" = True ] ||
    fail "no CUDA device for torch ${torch_seen% *} on this machine (nvidia-smi: $card)"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

started=$SECONDS
test_ok=0
timeout "$TEST_LIMIT_S" "$PYTHON" -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py \
    --junitxml="$out/test_gpu.xml" >"$out/test_gpu.log" 2>&1 || test_ok=$?
test_s=$((SECONDS - started))

started=$SECONDS
bench_ok=0
timeout "$BENCH_LIMIT_S" "$PYTHON" benchmarks/bench_learner_overhead.py "${BENCH_ARGS[@]}" \
    --json "$out/overhead.json" >"$out/overhead.log" 2>&1 || bench_ok=$?
bench_s=$((SECONDS - started))

"$PYTHON" - "$out" "$card" "$test_ok" "$test_s" "$bench_ok" "$bench_s" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, card, test_rc, test_s, bench_rc, bench_s = sys.argv[1:]
out = Path(out)


def test_verdict() -> tuple[bool, str]:
    """Passed only if the test ran and passed: a skip (no device seen) is a failure."""
    try:
        suite = ET.parse(out / "test_gpu.xml").getroot().find("testsuite")
    except (OSError, ET.ParseError):
        suite = None
    if suite is None:
        return False, f"no result (exit {test_rc})"
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = test_rc == "0" and passed == counts["tests"] > 0
    return ok, f"{passed} of {counts['tests']} passed, {counts['skipped']} skipped"


def bench_rows() -> tuple[bool, list[tuple[str, str]]]:
    try:
        s = json.loads((out / "overhead.json").read_text())
    except (OSError, ValueError):
        return False, [("learner overhead", f"no result (exit {bench_rc})")]
    plain, learner = s["median"]["plain"], s["median"]["learner"]
    return bench_rc == "0", [
        ("model", f"{s['params'] / 1e6:.1f}M parameters (GPT, batch 32 x 64 bytes)"),
        ("steps/s plain / with Learner", f"{plain['steps_per_s']:.2f} / "
         f"{learner['steps_per_s']:.2f} ({100 * s['speed_ratio']:.1f}%)"),
        ("peak GPU memory plain / with Learner", f"{plain['peak_gpu_mb']:,.0f} MB / "
         f"{learner['peak_gpu_mb']:,.0f} MB"),
        ("peak host RSS plain / with Learner", f"{plain['peak_rss_mb']:,.0f} MB / "
         f"{learner['peak_rss_mb']:,.0f} MB ({s['rss_ratio']:.2f}x)"),
        ("syncer memory", f"{s['syncer_bytes_per_param']:.1f} bytes per parameter"),
    ]


test_ok, test_text = test_verdict()
bench_ok, rows = bench_rows()
table = [
    ("card", card),
    ("torch / CUDA", f"{torch.__version__} / {torch.version.cuda}"),
    ("tests/test_gpu.py", f"{'ok' if test_ok else 'FAILED'}: {test_text} in {test_s} s"),
    ("bench_learner_overhead", f"{'ok' if bench_ok else 'FAILED'} in {bench_s} s"),
    *rows,
]
width = max(len(k) for k, _ in table)
print(f"| {'GPU check'.ljust(width)} | result |")
print(f"|{'-' * (width + 2)}|--------|")
for key, value in table:
    print(f"| {key.ljust(width)} | {value} |")
for ok, log in ((test_ok, "test_gpu.log"), (bench_ok, "overhead.log")):
    if not ok:
        print(f"\n--- {log} (last lines) ---", file=sys.stderr)
        print("\n".join((out / log).read_text().splitlines()[-30:]), file=sys.stderr)
sys.exit(0 if test_ok and bench_ok else 1)
EOF

"""``benchmarks/gpu_check.sh`` (``make gpu-check``) where there is no GPU: it fails in one
line, and the benchmark command it runs on a GPU parses. Its GPU path runs on a GPU only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
SYSTEM_PATH = "/usr/bin:/bin"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")


def gpu_check(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": path, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_without_a_cuda_device_the_gpu_check_fails_in_one_line(tmp_path):
    if shutil.which("nvidia-smi", path=SYSTEM_PATH):
        pytest.skip("nvidia-smi is installed here")
    done = gpu_check(SYSTEM_PATH)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.splitlines() == ["gpu-check: no CUDA device: nvidia-smi is not installed"]
    # A driver that lists a card is not enough: torch must see a device.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA Example, 80 GiB, 1.0'\n")
    fake.chmod(0o755)
    done = gpu_check(f"{tmp_path}:{SYSTEM_PATH}")
    assert done.returncode == 1 and done.stdout == "", done
    [line] = done.stderr.splitlines()
    assert line.startswith(f"gpu-check: no CUDA device for torch {torch.__version__}"), line
    assert "NVIDIA Example" in line


def test_the_benchmark_command_of_the_gpu_check_parses():
    [args] = re.findall(r"^BENCH_ARGS=\((.*)\)$", SCRIPT.read_text(), re.M)
    bench = ROOT / "benchmarks" / "bench_learner_overhead.py"
    done = subprocess.run(
        [sys.executable, str(bench), *args.split(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for flag in re.findall(r"--[\w-]+", args):
        assert flag in done.stdout, flag

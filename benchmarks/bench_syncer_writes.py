"""What a real ``diloco syncer --model`` process writes to disk per commit, as the kernel
counts it, with one real ``Learner`` training a large model against it.

    python benchmarks/bench_syncer_writes.py [--layers 336 --width 1024] [--step 0.4]

**What runs.** The model is ``--layers`` square ``Linear`` layers of ``--width`` (no bias;
336 × 1024² = 352M parameters, seeded, each near the identity so that every layer's
gradient is not 0). A ``diloco syncer --model bench_syncer_writes:build
--state-dir ...`` process serves it with today's default exchange (P = 24, H = 16, sign1 up,
int2 down, the default snapshot interval); one learner process (``diloco.Learner``, SGD on
a batch of random inputs, each step at least ``--step`` seconds) trains against it until
the benchmark ends. Both are real processes; nothing is synthetic but the data.

**What it measures**, from the syncer's ``/proc/PID/io`` (``write_bytes`` less
``cancelled_write_bytes``: what reached the block layer, all its threads) and its tape
(``round`` records: when each commit was made and the compressed bytes it merged):

- *whole run*: from the syncer's start (its first commits write each fragment whole) to the
  end, over every commit;
- *steady*: a window that starts once every fragment has committed ``--settle-commits``
  times and lasts ``--cycles`` snapshot cycles (each fragment snapshotted about once per
  cycle), so snapshots are in it as often as they come.

Each is reported as bytes written per commit and as a multiple of the compressed bytes the
commits merged (issue 48's line: ≤ 4×, snapshots amortised over their interval). The
syncer's resident bytes per parameter at the end, and the learner's step time, are
reported beside. On the 2-core reference machine the default size needs about 12 GB free
and runs about 6 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_e2e_124m as e2e
from bench_syncer_scale import proc_io, proc_memory

SEED = 0
LAYERS, WIDTH = 336, 1024
"""The default model: 352M parameters in square layers (issue 48's own probe)."""


def build(layers: int | None = None, width: int | None = None):
    """``--model bench_syncer_writes:build``: the benchmark's model (``BENCH_LAYERS`` and
    ``BENCH_WIDTH`` in the environment choose its size)."""
    import torch
    from torch import nn

    layers = layers or int(os.environ.get("BENCH_LAYERS", LAYERS))
    width = width or int(os.environ.get("BENCH_WIDTH", WIDTH))
    torch.manual_seed(SEED)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    with torch.no_grad():  # near the identity: the signal and its gradient cross every layer
        for layer in model:
            layer.weight.mul_(0.1).add_(torch.eye(width))
    return model


def learn(args) -> int:
    """``--role learner``: train against ``--syncer`` until ``--stop-file`` exists."""
    import torch

    import diloco

    torch.set_num_threads(1)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    learner = diloco.Learner(model, optimizer, syncer=args.syncer, learner_id="probe")
    learner.wait_for_global(timeout=600)
    width = model[0].in_features
    gen = torch.Generator().manual_seed(SEED)
    steps, started = 0, time.monotonic()
    while not Path(args.stop_file).exists():
        t0 = time.monotonic()
        x = torch.randn(4, width, generator=gen)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        learner.step(tokens=x.shape[0])
        steps += 1
        time.sleep(max(0.0, args.step - (time.monotonic() - t0)))
    elapsed = time.monotonic() - started
    learner.close()
    print(json.dumps({"steps": steps, "step_s": elapsed / max(steps, 1)}))
    return 0


def commits(tape: Path) -> list[dict]:
    """The tape's ``round`` records (``t``: when the commit was made, ``bytes_up``)."""
    out = []
    for line in tape.read_text().splitlines():
        if '"round"' in line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "round":
                out.append(record)
    return out


def written(pid: int) -> int:
    io = proc_io(pid)
    return io["write_bytes"] - io["cancelled_write_bytes"]


def window_row(name: str, rounds: list[dict], t0: float, t1: float, bytes_written: int) -> dict:
    made = [r for r in rounds if t0 <= r["t"] <= t1]
    compressed = sum(r["bytes_up"] for r in made)
    return {
        "window": name,
        "seconds": t1 - t0,
        "commits": len(made),
        "written_bytes": bytes_written,
        "written_per_commit": bytes_written / max(len(made), 1),
        "compressed_per_commit": compressed / max(len(made), 1),
        "written_over_compressed": bytes_written / compressed if compressed else None,
    }


def bench(args) -> dict:
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.snapshot_interval import SNAPSHOT_BYTES_PER_VALUE, records_per_snapshot
    from diloco.wire.comms import bytes_per_value

    config = SyncerConfig()
    P = config.protocol.num_fragments
    work = Path(tempfile.mkdtemp(prefix="syncer-writes-", dir=args.state_root))
    os.environ.update(BENCH_LAYERS=str(args.layers), BENCH_WIDTH=str(args.width))
    state_dir, port_file, stop = work / "state", work / "port", work / "stop"
    tape = state_dir / "events.jsonl"
    syncer = e2e.start(
        e2e.diloco_command(
            work / "syncer.peak", "syncer", "--model", "bench_syncer_writes:build",
            "--state-dir", str(state_dir), "--bind", "127.0.0.1:0",
            "--port-file", str(port_file)),
    )  # fmt: skip
    procs = [syncer]
    try:
        e2e.wait_for_files([port_file], procs)
        served_at = time.time()
        learner_out = work / "learner.json"
        procs.append(
            e2e.start(
                [sys.executable, __file__, "--role=learner", f"--syncer={port_file.read_text().strip()}",
                 f"--stop-file={stop}", f"--step={args.step}"],
                output=learner_out,
            )
        )  # fmt: skip
        every = records_per_snapshot(
            bytes_per_value(config.up_codec), SNAPSHOT_BYTES_PER_VALUE, config.commits_per_snapshot
        )
        settled = P * args.settle_commits

        def count() -> int:
            return len(commits(tape)) if tape.exists() else 0

        while count() < settled:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("the syncer or the learner ended before the window")
            time.sleep(1.0)
        w0, b0 = time.time(), written(syncer.pid)
        while count() < settled + args.cycles * every * P:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("the syncer or the learner ended during the window")
            time.sleep(1.0)
        w1, b1 = time.time(), written(syncer.pid)
        memory = proc_memory(syncer.pid)
        rounds = commits(tape)
        stop.touch()
        e2e.finish(procs[1], timeout=600)
        learner = json.loads(learner_out.read_text().strip().splitlines()[-1])
    finally:
        for proc in procs[:1]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        e2e.kill_all(procs[1:])
        try:
            syncer.wait(120)
        except subprocess.TimeoutExpired:
            e2e.kill_all([syncer])
        shutil.rmtree(work, ignore_errors=True)
    params = args.layers * args.width * args.width
    return {
        "params": params,
        "step_s": learner["step_s"],
        "snapshot_every": every,
        "whole_run": window_row("whole run", rounds, served_at, w1, b1),
        "steady": window_row(f"steady ({args.cycles} snapshot cycles)", rounds, w0, w1, b1 - b0),
        "syncer_rss_bytes_per_param": memory["VmRSS"] / params,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="bench", choices=("bench", "learner"))
    p.add_argument("--syncer", default="", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--step", type=float, default=0.4, help="the learner's least step time, s")
    p.add_argument("--settle-commits", type=int, default=2, help="commits per fragment first")
    p.add_argument("--cycles", type=int, default=1, help="snapshot cycles in the window")
    p.add_argument("--state-root", default=None, help="where the state goes (a disk)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()
    if args.role == "learner":
        return learn(args)
    result = bench(args)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

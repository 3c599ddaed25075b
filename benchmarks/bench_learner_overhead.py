"""What the Learner costs a training process: peak memory and steps/s with syncing on and off.

    python benchmarks/bench_learner_overhead.py [--layers 8 --dim 720] [--steps 30] [--repeats 3]
        [--device cuda --batch 32]

The same training loop (our byte-level GPT at about 50M parameters, AdamW, batch 4 × 64
bytes of Shakespeare) runs in a fresh process per measurement:

- ``plain``: the loop alone (only the model class is imported from diloco: no Learner, no
  gRPC);
- ``learner``: the loop plus ``diloco.Learner`` (P = H = 24, int4 up, int8 down: the default
  exchange until 2026-11-27, pinned so the results stay comparable; the syncer's clock), talking to
  a syncer in another process (``SyncerServer.for_model``, same seed); ``--arenas 1`` sets
  its ``malloc_arenas`` (as ``diloco learner`` does), default: the process left alone.

Each process reports its peak resident memory (``peak_rss_mb``) and its steps/s over the
measured steps (after 5 warm-up steps); the syncer reports its own peak memory, per model
parameter. The training process (its training thread and the Learner's threads) is pinned
to CPU 0 with one torch thread, the syncer to CPU 1: on this 2-core machine the syncer would
otherwise take its merges' CPU time from the training (in a deployment it runs elsewhere).
Modes alternate, ``--repeats`` times; medians are printed and, with ``--json``, written as
JSON. ``--device cuda`` trains on the GPU (the step time then measured over all measured
steps between two device synchronisations, and the device's peak allocated memory reported
beside the process's resident memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

WARMUP = 5


def build(layers: int, dim: int, seed: int = 0):
    import torch

    from diloco.recipes.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=64, layers=layers, dim=dim, heads=dim // 60))


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB: its address space's high-water mark
    (``VmHWM`` in ``/proc/self/status``). Not ``ru_maxrss`` where ``/proc`` has it: Linux
    carries the forking parent's peak across ``exec`` into the child's ``ru_maxrss``, so a
    child of a large process reports at least that process's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_loop(
    model, optimizer, loss_of, next_batch, steps: int, learner=None, min_step_s: float = 0.0
) -> dict:
    """``WARMUP + steps`` training steps (``loss_of(model, x)`` on ``next_batch()``, backward,
    ``optimizer.step``, and ``learner.step`` after each when a learner is given); returns
    ``steps_per_s`` over the ``steps`` measured ones and their wall-clock window
    (``measured_from``, ``measured_to``, ``time.time()``). On a CUDA model the window is
    closed by device synchronisations. ``min_step_s``: each step lasts at least this long (a
    stated step time, for a model too small to give the syncer's clock a pace of its own)."""
    import torch

    cuda = next(model.parameters()).device.type == "cuda"
    for step in range(WARMUP + steps):
        if step == WARMUP:
            if cuda:
                torch.cuda.synchronize()
            started, measured_from = time.perf_counter(), time.time()
        began = time.perf_counter()
        x = next_batch()
        loss = loss_of(model, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if learner is not None:
            learner.step(tokens=x.numel())
        time.sleep(max(0.0, began + min_step_s - time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {"steps_per_s": steps / elapsed, "measured_from": measured_from,
            "measured_to": measured_from + elapsed}  # fmt: skip


def train(args) -> dict:
    """One measured run in this process; ``args.syncer`` empty: no Learner."""
    import os

    import torch

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build(args.layers, args.dim).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = None
    if args.syncer:
        import diloco

        learner = diloco.Learner(model, optimizer, syncer=args.syncer, num_fragments=24,
                                 learner_id="bench",
                                 malloc_arenas=args.arenas or None)  # fmt: skip
        learner.wait_for_global(timeout=120)
    gen = torch.Generator().manual_seed(0)
    timing = timed_loop(
        model,
        optimizer,
        lambda m, x: m(x, x)[1],
        lambda: torch.randint(0, 256, (args.batch, 64), generator=gen).to(device),
        args.steps,
        learner,
    )
    result = {
        "steps_per_s": timing["steps_per_s"],
        "peak_rss_mb": peak_rss_mb(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if learner is not None:
        result["uploads"] = learner.stats.get("uploads_sent", 0)
        result["merged"] = learner.stats.get("merged", 0)
        learner.close(flush=False)
    return result


def serve(args) -> None:
    """A syncer of the same model; prints its address, then its peak memory when told to stop."""
    import os

    import torch

    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer
    from diloco.wire.experimental import FORMER_DEFAULT
    from diloco.wire.protocol import ProtocolConfig

    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    model = build(args.layers, args.dim)
    params = sum(p.numel() for p in model.parameters())
    with SyncerServer.for_model(
        model,
        config=SyncerConfig(
            protocol=ProtocolConfig(num_fragments=24, sync_every=FORMER_DEFAULT.sync_every),
            up_codec=FORMER_DEFAULT.up_codec,
            down_codec=FORMER_DEFAULT.down_codec,
        ),
    ) as server:
        del model
        print(server.address, flush=True)
        sys.stdin.readline()  # the parent writes a line when the learner is done
        rss = peak_rss_mb() * 2**20
        print(json.dumps({"peak_rss_mb": rss / 2**20, "bytes_per_param": rss / params}), flush=True)


def child(role: str, args, extra: list[str]) -> list[str]:
    return [sys.executable, __file__, f"--role={role}", f"--layers={args.layers}",
            f"--dim={args.dim}", f"--steps={args.steps}", f"--threads={args.threads}",
            f"--arenas={args.arenas}", f"--device={args.device}", f"--batch={args.batch}",
            *extra]  # fmt: skip


def measure(args, mode: str) -> dict:
    if mode == "plain":
        out = subprocess.run(child("train", args, []), capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    syncer = subprocess.Popen(child("serve", args, []), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        address = syncer.stdout.readline().strip()
        out = subprocess.run(child("train", args, [f"--syncer={address}"]), capture_output=True,
                             text=True, check=True)  # fmt: skip
        result = json.loads(out.stdout.strip().splitlines()[-1])
        syncer.stdin.write("done\n")
        syncer.stdin.flush()
        result["syncer"] = json.loads(syncer.stdout.readline())
        return result
    finally:
        syncer.kill()
        syncer.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="bench", choices=("bench", "train", "serve"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=720)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--arenas", type=int, default=0, help="the Learner's malloc_arenas (0: None, untouched)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (the training process)")
    p.add_argument("--batch", type=int, default=4, help="sequences of 64 bytes per step")
    p.add_argument("--syncer", default="")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    if args.role == "train":
        print(json.dumps(train(args)))
        return 0
    if args.role == "serve":
        serve(args)
        return 0
    runs = {"plain": [], "learner": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(measure(args, mode))
            print(mode, runs[mode][-1], flush=True)
    plain, learner = runs["plain"], runs["learner"]
    keys = ("steps_per_s", "peak_rss_mb", *(("peak_gpu_mb",) if args.device == "cuda" else ()))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in keys}
           for m, rs in runs.items()}  # fmt: skip
    summary = {
        "params": plain[0]["params"],
        "median": med,
        "rss_ratio": med["learner"]["peak_rss_mb"] / med["plain"]["peak_rss_mb"],
        "speed_ratio": med["learner"]["steps_per_s"] / med["plain"]["steps_per_s"],
        "syncer_bytes_per_param": statistics.median(
            r["syncer"]["bytes_per_param"] for r in learner
        ),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

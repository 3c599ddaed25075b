"""What the syncer process holds, per parameter, and who holds it.

    python benchmarks/bench_syncer_memory.py                    # 100M parameters, M = 2
    python benchmarks/bench_syncer_memory.py --params 50e6 --commits 48 --learners 4

**What runs.** Two measurements over one synthetic model (``build``: square 1024-column
layers, ``--params`` values; ``--fragments`` P, default exchange otherwise):

1. *The program a user starts*: ``diloco syncer --model bench_syncer_memory:build`` in its
   own process, with a state directory, on the learners' schedule (quorum 1). M
   synthetic learners (threads of this script, gRPC, no model) join, subscribe (every
   fragment's keyframe is sent to each), and upload every fragment in turn, a real
   ``sign1`` payload encoded once, until ``--commits`` commits are made. The syncer's
   resident memory (``VmRSS`` and ``VmHWM`` from ``/proc``) is read after it serves and after
   the commits, in bytes per parameter, and so is a bare Python that imported torch and
   diloco (the interpreter's share, which a larger model does not grow).
2. *Who holds it* (``--no-breakdown`` skips it): the same exchange against a
   ``SyncerServer.for_model`` in this process, then every live tensor storage and every
   large ``bytes`` object is found (``gc``) and attributed to its owner: Θ, outer momentum,
   the committer's wire images, keyframes and their payloads, uploads waiting in open
   rounds (held as they arrived: their payloads are ``bytes``), the model the server was
   built from, anything else.

Prints one JSON object per measurement. Run it under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

COLS = 1024
"""Columns of every synthetic layer."""
PARAMS_ENV = "BENCH_SYNCER_MEMORY_PARAMS"
"""How ``build`` learns the model size in the syncer's process."""
DEFAULT_PARAMS = 100_000_000
UPLOAD_STEPS = 16
"""Steps each synthetic upload claims (tokens: 1024 per step)."""


def build():
    """The synthetic model (``diloco syncer --model bench_syncer_memory:build``): square
    ``COLS``-column layers holding ``$BENCH_SYNCER_MEMORY_PARAMS`` values, no biases."""
    import torch
    from torch import nn

    rows = max(1, int(float(os.environ.get(PARAMS_ENV, DEFAULT_PARAMS))) // COLS)
    layers = nn.ParameterDict()
    for i in range(-(-rows // COLS)):
        n = min(COLS, rows - i * COLS)
        layers[f"layer{i}"] = nn.Parameter(torch.randn(n, COLS) * 0.02)
    model = nn.Module()
    model.layers = layers
    return model


def rss_bytes(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of process ``pid``, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def interpreter_rss() -> int:
    """RSS of a Python that imported torch and the syncer and holds no model."""
    code = (
        "import torch, diloco.syncer.server, diloco.launch.syncer_process, pathlib;"
        "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines()"
        " if l.startswith('VmRSS')][0].split()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout) * 1024


# ------------------------------------------------------------------------- the learners
def drive(address: str, layout, learners: int, commits: int, versions_of, timeout_s: float):
    """``learners`` synthetic learners join ``address``, subscribe and upload every fragment
    in turn (a sign1 payload) until ``versions_of()`` sums ``commits`` more versions."""
    import grpc
    import torch

    from diloco.algorithm import codecs
    from diloco.wire import diloco_pb2 as pb
    from diloco.wire import diloco_pb2_grpc as pb_grpc

    gen = torch.Generator().manual_seed(1)
    payloads = [
        codecs.encode(torch.randn(f.numel, generator=gen) * 1e-4, "sign1") for f in layout.fragments
    ]
    tensors = [pb.TensorSpec(name=n, shape=list(s), dtype=d) for n, s, d in layout.tensors]
    target = sum(versions_of()) + commits
    done = threading.Event()
    errors: list[BaseException] = []

    def learner(index: int) -> None:
        lid = f"probe-{index}"
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.SyncerStub(channel)
        try:
            reply = stub.Join(
                pb.JoinRequest(
                    learner_id=lid,
                    layout_hash=layout.hash,
                    num_fragments=layout.num_fragments,
                    tensors=tensors,
                ),
                timeout=60,
            )
            versions = list(reply.versions)
            stream = stub.Subscribe(pb.SubscribeRequest(learner_id=lid, session=reply.session))

            def listen() -> None:
                try:
                    for chunk in stream:
                        if not chunk.request and chunk.chunk_index == 0:
                            versions[chunk.fragment] = max(versions[chunk.fragment], chunk.version)
                except grpc.RpcError:
                    pass

            threading.Thread(target=listen, daemon=True).start()
            k = 0
            while not done.is_set():
                p = k % layout.num_fragments
                k += 1
                payload = payloads[p]
                chunks = [
                    pb.UploadChunk(
                        learner_id=lid,
                        session=reply.session,
                        fragment=p,
                        base_version=versions[p],
                        steps=UPLOAD_STEPS,
                        tokens=UPLOAD_STEPS * 1024,
                        codec="sign1",
                        numel=layout.fragments[p].numel,
                        num_chunks=-(-len(payload) // (1 << 20)),
                        chunk_index=i // (1 << 20),
                        data=payload[i : i + (1 << 20)],
                        step_time_s=0.5,
                    )
                    for i in range(0, len(payload), 1 << 20)
                ]
                answer = stub.Upload(iter(chunks), timeout=120)
                deadline = time.monotonic() + timeout_s
                while (  # its round commits (seen on the stream) before its next upload
                    answer.accepted
                    and versions[p] <= answer.current_version
                    and not done.is_set()
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.02)
                versions[p] = max(versions[p], answer.current_version)
            stream.cancel()
        except BaseException as exc:  # said by the caller
            errors.append(exc)
            done.set()
        finally:
            channel.close()

    threads = [threading.Thread(target=learner, args=(i,), daemon=True) for i in range(learners)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while sum(versions_of()) < target and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    if sum(versions_of()) < target:
        raise TimeoutError(f"{target - sum(versions_of())} commits still missing")


def status_versions(address: str):
    """A function reading the syncer's versions through its ``Status`` RPC."""
    import grpc

    from diloco.wire import diloco_pb2 as pb
    from diloco.wire import diloco_pb2_grpc as pb_grpc

    stub = pb_grpc.SyncerStub(grpc.insecure_channel(address))
    return lambda: list(stub.Status(pb.StatusRequest(), timeout=30).versions)


# ------------------------------------------------------------------------ measurements
def measure_program(args, layout) -> dict:
    """Measurement 1: the ``diloco syncer --model`` process."""
    with tempfile.TemporaryDirectory(prefix="syncer-memory-") as work:
        port_file = Path(work, "port")
        env = {
            **os.environ,
            PARAMS_ENV: str(args.params),
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        command = [
            sys.executable, "-m", "diloco.cli", "syncer",
            "--model", "bench_syncer_memory:build",
            "--fragments", str(args.fragments),
            "--schedule", "learner",
            "--state-dir", str(Path(work, "state")),
            "--port-file", str(port_file),
            "--threads", "1",
            "--exit-with-parent",
        ]  # fmt: skip
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + args.timeout
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the syncer did not start (exit {proc.poll()})")
                time.sleep(0.1)
            address = port_file.read_text()
            started = rss_bytes(proc.pid)
            drive(
                address, layout, args.learners, args.commits, status_versions(address), args.timeout
            )
            after = rss_bytes(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    base = interpreter_rss()
    return {
        "measurement": "diloco syncer --model",
        "params": layout.numel,
        "commits": args.commits,
        "learners": args.learners,
        "interpreter_mb": round(base / 2**20, 1),
        **{f"started_{k}_B_per_param": round(v / layout.numel, 2) for k, v in started.items()},
        **{f"after_{k}_B_per_param": round(v / layout.numel, 2) for k, v in after.items()},
        "after_VmRSS_less_interpreter_B_per_param": round(
            (after["VmRSS"] - base) / layout.numel, 2
        ),
    }


def owners_of(server, model) -> dict[str, set[int]]:
    """Storage addresses by owner ."""
    import torch

    state, committer = server.state, server.service.committer
    owners: dict[str, set[int]] = {
        "theta": {t.untyped_storage().data_ptr() for t in state.params},
        "momentum": {
            state.outer.buffer(p).untyped_storage().data_ptr()
            for p in state.served
            if state.outer.buffer(p) is not None
        },
        "wire_images": {committer.wire_image(p).untyped_storage().data_ptr() for p in state.served},
        "decoded_uploads": {  # (the service keeps uploads as they arrived: none)
            c.delta.untyped_storage().data_ptr()
            for r in state.rounds.values()
            for c in r.contributions.values()
            if isinstance(c.delta, torch.Tensor)
        },
        "model_built": {t.untyped_storage().data_ptr() for t in model.parameters()},
    }
    return owners


def measure_breakdown(args, layout) -> dict:
    """Measurement 2: the same exchange in this process, every tensor attributed."""
    os.environ[PARAMS_ENV] = str(args.params)
    import torch

    from diloco.runtime.memory import tune_for_large_tensors
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer
    from diloco.wire.protocol import ProtocolConfig

    torch.set_num_threads(1)
    tune_for_large_tensors()  # as ``diloco syncer`` does
    base = rss_bytes()["VmRSS"]
    model = build()
    config = SyncerConfig(
        schedule="learner",
        protocol=ProtocolConfig(num_fragments=args.fragments),
    )
    with tempfile.TemporaryDirectory(prefix="syncer-memory-") as work:
        server = SyncerServer.for_model(model, config=config, state_dir=work).start()
        try:
            drive(
                server.address,
                layout,
                args.learners,
                args.commits,
                lambda: list(server.state.versions),
                args.timeout,
            )
            gc.collect()
            rss = rss_bytes()["VmRSS"]
            owners = owners_of(server, model)
            held: dict[str, int] = dict.fromkeys([*owners, "other_tensors"], 0)
            seen: set[int] = set()
            large_bytes = 0
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    storage = obj.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr in seen or storage.nbytes() == 0:
                        continue
                    seen.add(ptr)
                    owner = next((o for o, ptrs in owners.items() if ptr in ptrs), "other_tensors")
                    held[owner] += storage.nbytes()
            for obj in gc.get_objects():  # bytes are not tracked by gc: found via referrers
                if isinstance(obj, dict | list | tuple):
                    for value in obj.values() if isinstance(obj, dict) else obj:
                        if isinstance(value, bytes) and len(value) >= 1 << 16:
                            large_bytes += len(value)
            ctypes.CDLL(None).malloc_trim(0)  # what the allocator held free, given back
            trimmed = rss_bytes()["VmRSS"]
        finally:
            server.stop(grace=1.0)
    n = layout.numel
    per = {k: round(v / n, 2) for k, v in held.items()}
    counted = sum(held.values()) + large_bytes
    return {
        "measurement": "SyncerServer.for_model in this process (model kept by the caller)",
        "params": n,
        "commits": args.commits,
        "learners": args.learners,
        "rss_less_interpreter_B_per_param": round((rss - base) / n, 2),
        "held_B_per_param": per,
        "large_bytes_B_per_param": round(large_bytes / n, 2),
        "unattributed_B_per_param": round((rss - base - counted) / n, 2),
        "allocator_free_B_per_param": round((rss - trimmed) / n, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=DEFAULT_PARAMS)
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--commits", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-program", action="store_true")
    args = parser.parse_args(argv)
    args.params = int(args.params)
    os.environ[PARAMS_ENV] = str(args.params)
    import torch

    from diloco.algorithm.fragments import balanced_fragments

    with torch.device("meta"):
        layout = balanced_fragments(build().named_parameters(), args.fragments)
    if not args.no_program:
        print(json.dumps(measure_program(args, layout)), flush=True)
    if not args.no_breakdown:
        print(json.dumps(measure_breakdown(args, layout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

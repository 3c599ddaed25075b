"""How many learners can one syncer process serve? Synthetic learners against real syncers.

    python benchmarks/bench_syncer_capacity.py --quick          # smoke test, ~1 minute
    python benchmarks/bench_syncer_capacity.py                  # M = 2..64, S = 1 and 2

**What runs.** The syncer is the real ``SyncerServer`` (gRPC, validation, int4 decode, RDA
merge, outer step, durable per-fragment commit with fsync, int8 delta downloads) in its own
process (``serve`` sub-command of this script: the real server over a synthetic ~100M
parameter model of 1024-column matrices, P fragments, H = P, quorum 1, default grace window),
one process per shard with ``--shards 2`` (``--shard i/S``, fragments ``p mod S``). The learners
are synthetic: no model, no compute. Each one joins every shard with the generated stubs,
heartbeats its step time, holds a ``Subscribe`` stream per shard (it receives and discards
every download, as a real learner applies them; ``--no-subscribe`` drops this to measure the
upload path alone) and steps every ``--step`` seconds. With the syncer's schedule (default)
it answers every request the syncer's clock sent since its last step at that step boundary,
as a real learner does: the syncer opens one fragment's round per fleet step and asks every
live learner, so each round merges up to M contributions. With ``--schedule learner`` (the
former protocol) it sends ``p = k mod P`` at its k-th step on its own, all learners in step.
An upload is the int4 payload of a real delta encoded once up front, with ``base_version``
the newest version the learner has seen.
Learners run as threads in ``--client-procs`` separate processes that import neither torch
nor the syncer (only grpc and the generated protobuf code).

**Measures** (over a ``--duration`` window after ``--warmup``): offered uploads/s
(= M / step: one upload per learner per step); accepted contributions/s (client-side replies); commits/s and merged MB/s
(Status RPC of every shard: rounds and admitted upload bytes, before and after the window);
broadcast MB/s received by the learners; upload latency (the Upload RPC, send to reply,
p50/p95); schedule lag (reply time minus the time the upload was due; a learner that falls
behind sends its next upload at once, so lag grows without bound when the syncer does not
keep up); CPU of the syncer process(es) and of the client processes (percent of one core).

**"Serves M learners"** means, in the window: (1) accepted contributions/s >= 95% of the
offered rate and nothing refused; (2) commits/s >= 95% of 1/step, less one commit per window (one fragment is due
per step and every due fragment commits); (3) p95 upload latency <= one step; (4) maximum
schedule lag <= two steps (bounded backlog). The capacity of one syncer process is the
largest M of the sweep that is served with every smaller M served too.

**Limits of this machine.** Everything shares one host: with 2 cores, the syncer, the
client processes and the loopback transfers (every commit is broadcast to all M learners)
compete for the same CPU, so the result is a lower bound on what a syncer on its own
machine serves, and client CPU is reported so that one can see when the clients, not the
syncer, are the bottleneck. Two shards on 2 cores cannot show the scaling that two shards
on two machines give; they show that sharding works and what it costs. Run it on a quiet
machine (``nproc`` >= 4 recommended) for numbers worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path

from diloco.wire.protocol import ProtocolConfig

COLS = 1024
"""Columns of every synthetic matrix: the model is ``params / COLS`` rows of 1024 floats."""


# ----------------------------------------------------------------------------- syncer
def synthetic_layout(num_params: int, fragments: int):
    """A ~``num_params`` model of [1024, 1024] matrices (plus one remainder), as a layout."""
    import torch

    from diloco.algorithm.fragments import balanced_fragments

    rows = max(fragments, num_params // COLS)
    shapes = [(f"layer{i}.weight", (COLS, COLS)) for i in range(rows // COLS)]
    if rows % COLS:
        shapes.append(("tail.weight", (rows % COLS, COLS)))
    named = [(n, torch.empty(s, device="meta")) for n, s in shapes]
    return balanced_fragments(named, fragments)


def serve(args: argparse.Namespace) -> int:
    """One real syncer (shard) process over the synthetic model; prints nothing, writes its
    address to ``--port-file`` and serves until SIGTERM."""
    import torch

    from diloco.algorithm.shards import parse_shard
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer

    torch.set_num_threads(1)
    layout = synthetic_layout(args.params, args.fragments)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(f.numel, generator=gen) * 0.02 for f in layout.fragments]
    config = SyncerConfig(
        quorum=1,
        lease_s=10.0,
        heartbeat_s=2.0,
        up_codec="int4",
        down_codec="int8",  # the codecs it was measured with (the default until 2026-11-27)
        schedule=args.schedule,
        protocol=ProtocolConfig(sync_every=args.fragments),
    )
    server = SyncerServer(
        layout,
        params,
        config,
        shard=parse_shard(args.shard),
        state_dir=args.state_dir or None,
        max_learners=args.max_learners,
    ).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(server.address)
    os.replace(tmp, args.port_file)
    while not stop.wait(0.5):
        if os.getppid() == 1:  # the benchmark died: do not linger
            break
    server.stop(grace=1.0)
    return 0


# ----------------------------------------------------------------------------- client
def client(args: argparse.Namespace) -> int:
    """Synthetic learners ``--first`` .. ``--first + --count - 1`` as threads (no torch).

    Writes to ``--out``: ``records``, one row per upload ``(due, sent, answered, fragment,
    outcome, current_version, learner)``; ``arrivals``, per learner the ``(fragment, version,
    time)`` of every download's first chunk; the CPU and bytes received in the window. The
    spec's optional ``steps`` is the steps each upload claims (default P) and ``stop_file``
    a file whose existence ends the learners before the window does."""
    import grpc

    from diloco.wire import diloco_pb2 as pb
    from diloco.wire import diloco_pb2_grpc as pb_grpc

    spec = json.loads(Path(args.spec).read_text())
    payloads = [Path(f).read_bytes() for f in spec["payloads"]]
    P, owner, step = spec["fragments"], spec["owner"], spec["step_s"]
    steps = spec.get("steps", P)
    stop_file = spec.get("stop_file")
    start = spec["start_at"]
    window = (start + spec["warmup_s"], start + spec["warmup_s"] + spec["duration_s"])
    options = [
        ("grpc.max_receive_message_length", 4 << 20),
        ("grpc.max_send_message_length", 4 << 20),
        # each synthetic learner on a TCP connection of its own, as a real learner's link:
        # sharing one, they met the syncer's per-connection caps (2 subscriptions each)
        ("grpc.use_local_subchannel_pool", 1),
    ]
    tensors = [pb.TensorSpec(name=n, shape=s, dtype=d) for n, s, d in spec["tensors"]]
    clocked = spec["schedule"] == "syncer"
    heartbeat_every = max(1, round(2.0 / step))  # steps between heartbeats (~2 s)
    records: list[tuple] = []
    received: list[list[int]] = []  # one counter per stream, each written by its own thread
    arrivals: dict[str, list[tuple[int, int, float]]] = {}

    def stopped() -> bool:
        return stop_file is not None and os.path.exists(stop_file)

    lock = threading.Lock()

    def learner(index: int) -> None:
        lid = f"{spec['prefix']}-{index}"
        channels = [grpc.insecure_channel(a, options=options) for a in spec["addresses"]]
        stubs = [pb_grpc.SyncerStub(c) for c in channels]
        sessions, versions = [], [0] * P
        for stub in stubs:
            reply = stub.Join(
                pb.JoinRequest(
                    learner_id=lid,
                    layout_hash=spec["layout_hash"],
                    num_fragments=P,
                    tensors=tensors,
                ),
                timeout=30,
            )
            sessions.append(reply.session)
            for p in reply.fragments:
                versions[p] = reply.versions[p]
        streams = []
        requested: deque[int] = deque()  # fragments the clock asked for (appended by streams)

        def heartbeat() -> None:
            for stub, session in zip(stubs, sessions, strict=True):
                try:
                    stub.Heartbeat(
                        pb.HeartbeatRequest(
                            learner_id=lid, session=session, steps_per_s=1.0 / step
                        ),
                        timeout=10,
                    )
                except grpc.RpcError:
                    pass

        arrived = arrivals[lid] = []

        def listen(stream, counter: list[int]) -> None:
            try:
                for chunk in stream:
                    if chunk.request:
                        requested.append(chunk.fragment)
                        continue
                    if chunk.chunk_index == 0:
                        arrived.append((chunk.fragment, chunk.version, time.time()))
                        versions[chunk.fragment] = max(versions[chunk.fragment], chunk.version)
                    counter[0] += len(chunk.data)
            except grpc.RpcError:
                pass

        def upload(p: int) -> tuple[float, float, int, str, int, str]:
            shard = owner[p]
            payload = payloads[p]
            pieces = [payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
            header = dict(
                learner_id=lid,
                session=sessions[shard],
                fragment=p,
                base_version=versions[p],
                steps=steps,
                tokens=steps * 1024,
                codec=spec["up_codec"],
                numel=spec["numel"][p],
                num_chunks=len(pieces),
                step_time_s=step,
            )
            chunks = (
                pb.UploadChunk(chunk_index=i, data=piece, **header)
                for i, piece in enumerate(pieces)
            )
            t0 = time.time()
            outcome, current = "failed", -1
            try:
                reply = stubs[shard].Upload(chunks, timeout=60)
                outcome = "accepted" if reply.accepted else "stale"
                current = reply.current_version
                versions[p] = max(versions[p], reply.current_version)
            except grpc.RpcError as exc:
                outcome = f"refused:{exc.code().name}"
            return t0, time.time(), p, outcome, current, lid

        if spec["subscribe"]:
            for stub, session in zip(stubs, sessions, strict=True):
                stream = stub.Subscribe(
                    pb.SubscribeRequest(learner_id=lid, session=session, have_versions=versions)
                )
                streams.append(stream)
                counter = [0]
                with lock:
                    received.append(counter)
                threading.Thread(target=listen, args=(stream, counter), daemon=True).start()
        k = 0
        while True:
            due = start + k * step
            if due >= window[1] or stopped():
                break
            time.sleep(max(0.0, due - time.time()))
            if k % heartbeat_every == 0:
                heartbeat()
            if clocked:  # answer what the clock asked for since the last step boundary
                asked = []
                while requested:
                    asked.append(requested.popleft())
                todo = list(dict.fromkeys(asked))
            else:
                todo = [k % P]
            for p in todo:
                row = (due, *upload(p))
                with lock:
                    records.append(row)
            k += 1
        for stub, session in zip(stubs, sessions, strict=True):
            try:
                stub.Leave(pb.LeaveRequest(learner_id=lid, session=session), timeout=5)
            except grpc.RpcError:
                pass
        for stream in streams:
            stream.cancel()
        for c in channels:
            c.close()

    threads = [
        threading.Thread(target=learner, args=(i,), daemon=True)
        for i in range(args.first, args.first + args.count)
    ]
    for t in threads:
        t.start()
    time.sleep(max(0.0, window[0] - time.time()))
    with lock:
        cpu0, rx0 = time.process_time(), sum(c[0] for c in received)
    while time.time() < window[1] and not stopped():
        time.sleep(min(0.1, max(0.0, window[1] - time.time())))
    with lock:
        cpu1, rx1 = time.process_time(), sum(c[0] for c in received)
    for t in threads:
        t.join(timeout=120)
    out = {
        "records": records,
        "arrivals": arrivals,
        "cpu_s": cpu1 - cpu0,
        "received_bytes": rx1 - rx0,
        "stuck": sum(t.is_alive() for t in threads),
    }
    Path(args.out).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------- harness
def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def start_syncers(args, shards: int, work: Path) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    try:
        for i in range(shards):
            port_file = work / f"syncer-{shards}-{i}.addr"
            argv = [
                sys.executable,
                __file__,
                "serve",
                f"--params={args.params}",
                f"--fragments={args.fragments}",
                f"--shard={i}/{shards}",
                f"--port-file={port_file}",
                # every synthetic learner calls from 127.0.0.1 with no token of its own, and
                # one address may hold half of each cap (``limits.ADDRESS_SHARE``) while the
                # clock asks all M at once: sized for 2·M, so that the M uploads fit (at
                # M + 8, half of the uploads at M = 24 and 32 were refused, RESOURCE_EXHAUSTED)
                f"--max-learners={2 * max(args.learners) + 8}",
                f"--schedule={args.schedule}",
            ]
            if not args.no_persist:
                argv.append(f"--state-dir={work / f'state-{shards}-{i}'}")
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + 300
            while not port_file.exists():
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"syncer shard {i}/{shards} did not start")
                time.sleep(0.1)
            addresses.append(port_file.read_text())
    except BaseException:
        stop_all(procs)
        raise
    return procs, addresses


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def measure(args, layout, payload_files, syncers, addresses, shards, m, work, tag) -> dict:
    """One sweep point: ``m`` synthetic learners for warm-up + window; returns a table row."""
    from diloco.algorithm.shards import shard_of
    from diloco.launch.syncers import StatusClient

    P = layout.num_fragments
    start_at = time.time() + 2.0  # time for every client to join before the first step
    spec = {
        "addresses": addresses,
        "prefix": f"{tag}-m{m}",
        "fragments": P,
        "owner": [shard_of(p, shards) for p in range(P)],
        "layout_hash": layout.hash,
        "tensors": [[n, list(s), d] for n, s, d in layout.tensors],
        "numel": [f.numel for f in layout.fragments],
        "payloads": [str(f) for f in payload_files],
        "up_codec": "int4",
        "step_s": args.step,
        "start_at": start_at,
        # The window starts half a step after a due time, so that no step's commit sits on a
        # window edge (the count is then exact in steady state).
        "warmup_s": args.warmup + args.step / 2,
        "duration_s": args.duration,
        "subscribe": not args.no_subscribe,
        "schedule": args.schedule,
    }
    spec_path = work / f"spec-{tag}-{m}.json"
    spec_path.write_text(json.dumps(spec))
    nproc = min(args.client_procs, m)
    clients, outs = [], []
    for c in range(nproc):
        first, count = c * m // nproc, (c + 1) * m // nproc - c * m // nproc
        out = work / f"client-{tag}-{m}-{c}.json"
        outs.append(out)
        argv = [sys.executable, __file__, "client", f"--spec={spec_path}"]
        argv += [f"--first={first}", f"--count={count}", f"--out={out}"]
        clients.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
    status = StatusClient(addresses)
    try:
        w0 = start_at + spec["warmup_s"]
        w1 = w0 + args.duration
        time.sleep(max(0.0, w0 - time.time()))
        s0, cpu0 = status.fetch(), [proc_cpu_s(p.pid) for p in syncers]
        time.sleep(max(0.0, w1 - time.time()))
        s1, cpu1 = status.fetch(), [proc_cpu_s(p.pid) for p in syncers]
    finally:
        status.close()
        deadline = time.monotonic() + args.duration + 120
        for c in clients:
            try:
                c.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(timeout=10)
    results = [json.loads(o.read_text()) for o in outs if o.exists()]
    recs = [r for res in results for r in res["records"] if w0 <= r[2] <= w1]
    lat = [r[2] - r[1] for r in recs]
    lag = [r[2] - r[0] for r in recs]
    accepted = sum(r[4] == "accepted" for r in recs)
    stale = sum(r[4] == "stale" for r in recs)
    refused = sum(r[4].startswith(("refused", "failed")) for r in recs)
    dur = args.duration
    ok_status = s0 is not None and s1 is not None
    commits = (s1.rounds - s0.rounds) / dur if ok_status else float("nan")
    merged = (s1.bytes_up - s0.bytes_up) / dur / 1e6 if ok_status else float("nan")
    row = {
        "shards": shards,
        "learners": m,
        "offered_per_s": m / args.step,
        "accepted_per_s": accepted / dur,
        "stale": stale,
        "refused": refused,
        "refused_by": dict(Counter(r[4] for r in recs if r[4].startswith(("refused", "failed")))),
        "commits_per_s": commits,
        "merged_MBps": merged,
        "down_MBps": sum(r["received_bytes"] for r in results) / dur / 1e6,
        "lat_p50_s": percentile(lat, 0.5),
        "lat_p95_s": percentile(lat, 0.95),
        "lag_max_s": max(lag) if lag else float("nan"),
        "syncer_cpu_pct": 100 * sum(b - a for a, b in zip(cpu0, cpu1, strict=True)) / dur,
        "client_cpu_pct": 100 * sum(r["cpu_s"] for r in results) / dur,
        "clients_missing": nproc - len(results) + sum(r["stuck"] for r in results),
    }
    row["serves"] = bool(
        row["accepted_per_s"] >= 0.95 * row["offered_per_s"]
        and refused == 0
        and row["clients_missing"] == 0
        and commits >= 0.95 / args.step - 1 / dur  # one commit of slack at the window's ends
        and row["lat_p95_s"] <= args.step
        and row["lag_max_s"] <= 2 * args.step
    )
    return row


def write_payloads(layout, work: Path, codec: str = "int4") -> list[Path]:
    """One payload per fragment in ``codec``: a real encoded delta (small random values)."""
    import torch

    from diloco.algorithm import codecs

    gen = torch.Generator().manual_seed(1)
    files = []
    for p, f in enumerate(layout.fragments):
        path = work / f"payload-{p:03d}.bin"
        path.write_bytes(codecs.encode(torch.randn(f.numel, generator=gen) * 1e-4, codec))
        files.append(path)
    return files


COLUMNS = [
    ("shards", "S", "{}"),
    ("learners", "M", "{}"),
    ("offered_per_s", "offered/s", "{:.1f}"),
    ("accepted_per_s", "accepted/s", "{:.1f}"),
    ("commits_per_s", "commits/s", "{:.2f}"),
    ("merged_MBps", "merged MB/s", "{:.1f}"),
    ("down_MBps", "bcast MB/s", "{:.1f}"),
    ("lat_p50_s", "lat p50", "{:.3f}"),
    ("lat_p95_s", "lat p95", "{:.3f}"),
    ("lag_max_s", "lag max", "{:.2f}"),
    ("syncer_cpu_pct", "syncer CPU%", "{:.0f}"),
    ("client_cpu_pct", "client CPU%", "{:.0f}"),
    ("stale", "stale", "{}"),
    ("refused", "refused", "{}"),
    ("serves", "serves", "{}"),
]


def format_table(rows: list[dict]) -> str:
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in rows:
        cells = [
            ("yes" if r[k] else "NO") if k == "serves" else fmt.format(r[k])
            for k, _, fmt in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capacity(rows: list[dict], shards: int) -> int:
    """Largest M served by ``shards`` shards with every smaller M of the sweep served too."""
    best = 0
    for r in sorted((r for r in rows if r["shards"] == shards), key=lambda r: r["learners"]):
        if not r["serves"]:
            break
        best = r["learners"]
    return best


def bench(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    layout = synthetic_layout(args.params, args.fragments)
    n = sum(f.numel for f in layout.fragments)
    print(
        f"synthetic model: {n / 1e6:.1f}M parameters, P = H = {args.fragments}, step "
        f"{args.step}s, fragment {n / args.fragments / 1e6:.2f}M values; cores: {os.cpu_count()}; "
        f"client processes: {args.client_procs}; subscribe: {not args.no_subscribe}; "
        f"persist: {not args.no_persist}; schedule: {args.schedule}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-syncer-") as tmp:
        work = Path(tmp)
        payloads = write_payloads(layout, work)
        print(f"upload per fragment (int4): {payloads[0].stat().st_size / 1e6:.2f} MB", flush=True)
        for shards in args.shards:
            syncers, addresses = start_syncers(args, shards, work)
            try:
                for m in args.learners:
                    row = measure(
                        args, layout, payloads, syncers, addresses, shards, m, work, f"s{shards}"
                    )
                    rows.append(row)
                    print(format_table([row]).splitlines()[-1], flush=True)
            finally:
                stop_all(syncers)
    print()
    print(format_table(rows))
    for shards in args.shards:
        print(
            f"largest M served with {shards} shard(s) at step {args.step}s: "
            f"{capacity(rows, shards) or 'none of the sweep'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) one syncer shard process")
    s.add_argument("--params", type=int, required=True)
    s.add_argument("--fragments", type=int, required=True)
    s.add_argument("--shard", default="0/1")
    s.add_argument("--port-file", required=True)
    s.add_argument("--state-dir", default="")
    s.add_argument("--max-learners", type=int, default=72)
    s.add_argument("--schedule", default="syncer")
    c = sub.add_parser("client", help="(internal) one process of synthetic learners")
    c.add_argument("--spec", required=True)
    c.add_argument("--first", type=int, required=True)
    c.add_argument("--count", type=int, required=True)
    c.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, ~1 minute (smoke test)")
    parser.add_argument("--params", type=float, default=100e6, help="model size (default 100M)")
    parser.add_argument("--fragments", type=int, default=24, help="P = H (default 24)")
    parser.add_argument("--step", type=float, default=0.5, help="learner step in s (default 0.5)")
    parser.add_argument("--learners", default="2,4,8,16,32,64", help="M values to sweep")
    parser.add_argument("--shards", default="1,2", help="shard counts to sweep")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    parser.add_argument("--client-procs", type=int, default=2, help="synthetic learner processes")
    parser.add_argument("--no-subscribe", action="store_true", help="learners do not download")
    parser.add_argument("--no-persist", action="store_true", help="syncer keeps no state dir")
    parser.add_argument(
        "--schedule",
        choices=["syncer", "learner"],
        default="syncer",
        help="who drives the rounds (default: the syncer's clock)",
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)
    if args.cmd == "client":
        return client(args)
    if args.quick:
        args.params, args.learners, args.shards = 2e6, "2,4", "1,2"
        args.warmup, args.duration = 1.0, 3.0
    args.params = int(args.params)
    args.learners = [int(x) for x in str(args.learners).split(",")]
    args.shards = [int(x) for x in str(args.shards).split(",")]
    if args.no_subscribe and args.schedule == "syncer":
        parser.error(
            "--no-subscribe needs --schedule learner (the clock's requests come on the stream)"
        )
    if min(args.learners) < 1 or min(args.shards) < 1 or args.step <= 0:
        parser.error("--learners and --shards must be >= 1 and --step > 0")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())

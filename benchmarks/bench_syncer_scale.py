"""The syncer at real sizes: where a commit's time goes, what it makes durable, what it holds.

    python benchmarks/bench_syncer_scale.py --params 100M --learners 1,4 --step 1.0
    python benchmarks/bench_syncer_scale.py --params 100M,350M,1B --json scale.json

**What runs.** For every model size N of ``--params`` (any count: ``100M``, ``1B``, ``2.5e6``)
and every M of ``--learners``, a fresh real syncer process (the ``serve`` sub-command: the real
``SyncerServer`` with a state directory and its event tape in it, as ``diloco syncer
--state-dir`` runs it, with that command's default torch and commit threads) over a synthetic
model of N parameters (1024-column matrices: ``bench_syncer_capacity.synthetic_layout``; Θ
starts as a ramp, which costs no random draws at a restart). The exchange is today's default,
``SyncerConfig()`` as it is: its P, H, codecs, quorum, grace window and snapshot interval
(none of them is restated here). M synthetic learners (``bench_syncer_capacity``'s client
processes: no model, no torch) join, heartbeat a ``--step`` step time, hold a ``Subscribe``
stream (receiving every download) and answer each of the clock's requests at their next step
boundary with a pre-encoded upload of the fragment's size in the up codec (one per fragment,
encoded once: small random values), claiming H steps. The state directory goes under
``--state-root`` (default: the system's temporary directory; it must be on a disk, not a
tmpfs, for the kernel to count write bytes).

**Phases.** Warm-up until every fragment has committed once (a fragment's first commit is
written whole; later ones append to the journal), then ``--settle`` seconds; the measured
window (``--duration`` seconds; by default one snapshot cycle at the due rate, K·P commits
with K the records between a fragment's snapshots for M uploads per commit,
``snapshot_interval.records_per_snapshot``, so that the kernel's count holds each fragment's
snapshot once); the learners listen ``--drain-steps`` more steps and stop; the syncer is killed
(SIGKILL) and started again on its state directory.

**Measures**, per (N, M), over the window:

- *Stages*: the syncer's own recorder (``diloco.syncer.stage_times``, read in the syncer
  process and reset at the window's start): per stage the time per commit (its total in the
  window / the commits the syncer made in it), p50 and p95 of its samples (decode: one per upload; snapshot: one
  per background snapshot, off the commit path; the others: one per commit).
- *Memory-bandwidth reference* (measured in this process before the syncer starts, with the
  syncer's torch threads): the median time of ``dst.copy_(src)`` of one fragment in fp32
  (4·n bytes read, 4·n written; n: the fragment's values). A stage's *fraction* is the time
  that copy's bandwidth needs for the fragment-sized fp32 passes the stage cannot avoid
  (``PASSES``: a pass reads or writes 4·n bytes), divided by the stage's time per commit: 1.0
  runs at the speed of a plain copy, 0.1 ten times slower. Stages without such passes (the
  logs, the broadcast's queueing) have none. This is a memory reference; persist and
  snapshot go to disk, so their fraction also shows how far the disk is below memory. A
  fragment that fits in the CPU's caches (a few million parameters) is copied from them:
  the reference is then far above what memory moves.
- *Commits*: made against due. The clock opens one fragment's round every
  ``tick_period(step, H, P)`` seconds (P/H per fleet step), so a window of W seconds holds
  at most ``floor(W / period) + 1`` due times, whatever their phase; made are the commits
  (the tape's round records, read after the learners stop) of rounds the clock opened in
  the window. The per-commit figures below divide by the commits the syncer made in the
  window (its Status), whichever round they closed. The clock's own count is exact, phase
  included: its ticks in the window (the tape's tick records), those whose round was
  committed, and the due ticks it lost in the window (``RoundClock.lost``, in periods).
  Every due commit was made when the ticks committed are the ticks made and none was lost.
- *Upload-to-commit latency*, in steps: from an accepted upload's send to the arrival, on
  its learner's stream, of the version that merges it (``current_version + 1``); an upload
  whose version had not arrived when the learners stopped counts as infinite (JSON:
  ``Infinity``; how many: ``uploads_never_merged``). p50 and p95.
- *Bytes*: compressed bytes merged per commit (the tape's round records: their ``bytes_up``);
  the kernel's ``write_bytes`` (less ``cancelled_write_bytes``) and ``wchar`` of the syncer
  process (``/proc/PID/io``: all its threads) per commit; the *durable bytes per commit*:
  those write bytes less the snapshots written in the window, plus one snapshot file's size
  over the snapshot interval (snapshots amortised: each fragment is written whole every K
  of its commits, K as the syncer decides it from those bytes per commit,
  ``snapshot_every``), and its ratio to the compressed bytes merged.
- *Memory*: the syncer's peak (``VmHWM``: its start included) and steady (``VmRSS`` at the
  window's end) resident bytes per parameter.
- *Restart*: from starting the syncer again on its state directory (after SIGKILL) until it
  answers both Status and a Join (s), the journal records it replayed, its peak RSS, and
  where its start went (``SyncerServer.restart_times``: the seconds of each phase, and of
  the restore's parts summed over its threads; the restart table).

Output: a markdown summary table, one stage table per (N, M), and with ``--json PATH`` every
row as JSON (``check_row`` says what a complete one holds). Everything shares one host:
the learners' processes compete with the syncer for CPU; run it on a quiet machine for
numbers worth quoting (``nproc`` >= 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_syncer_capacity as fleet

PASSES = {
    "decode": "M",  # each upload's values written in fp32
    "guard": "M",  # each contribution read (the direction check of a round of 3 or more)
    "merge": "M+1",  # each contribution read, the merged delta written
    "outer": 5,  # Θ, momentum and the merged delta read; Θ and momentum written
    "encode": 3,  # Θ and W read, W' written
    "checksum": 1,  # Θ read
    "persist": "journal",  # the journal's record: the admitted uploads as they arrived
    "snapshot": 3,  # Θ, momentum and W written (to disk)
}
"""The fragment-sized fp32 passes (reads or writes of 4·n bytes) each stage cannot avoid,
per commit: M for contributions per commit, "journal" for the compressed bytes merged (over
4·n); a stage not named has none. The snapshot's are per snapshot."""
REFERENCE_COPIES = 7
"""Copies timed for the bandwidth reference (their median is taken)."""
READY_WAIT_S = 1800.0
"""Longest wait for a syncer process to serve (a 1B restore on a slow disk included)."""
RPC_TIMEOUT_S = 60.0
"""Deadline of the Status and Join calls this benchmark makes."""


# ----------------------------------------------------------------------------- syncer
class RampParams:
    """One tensor per fragment of ``layout``, made when asked for (a ramp in [-0.05, 0.05]):
    the syncer's initial Θ without a second copy of the model in its process."""

    def __init__(self, layout) -> None:
        self.layout = layout

    def __len__(self) -> int:
        return self.layout.num_fragments

    def __getitem__(self, p: int):
        import torch

        if not 0 <= p < len(self):
            raise IndexError(p)
        return torch.linspace(-0.05, 0.05, self.layout.fragments[p].numel)


def syncer_default(name: str) -> int:
    """``diloco syncer``'s default of setting ``name`` (a ``ServiceConfig`` field)."""
    from diloco.config.service import ServiceConfig

    return next(f.default for f in dataclasses.fields(ServiceConfig) if f.name == name)


def serve(args: argparse.Namespace) -> int:
    """One real syncer process over the synthetic model, with today's default exchange and a
    state directory; writes ``--ready-file`` once it serves (its address and the journal
    records its restore replayed) and on every SIGUSR1 writes ``--stats-file`` (the stage
    times since the last one, then forgotten; the snapshots written so far); serves until
    SIGTERM (or until the benchmark dies)."""
    import torch

    from diloco.algorithm import chunk_threads
    from diloco.runtime.memory import tune_for_large_tensors
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SyncerServer

    torch.set_num_threads(syncer_default("threads"))
    tune_for_large_tensors()  # (as ``diloco syncer`` does)
    config = SyncerConfig()
    layout = fleet.synthetic_layout(args.params, config.protocol.num_fragments)
    server = SyncerServer(
        layout,
        RampParams(layout),
        config,
        state_dir=args.state_dir,
        tape_path=Path(args.state_dir) / "events.jsonl",
        max_learners=args.max_learners,
    )
    chunk_threads.set_threads(syncer_default("commit_threads"))  # (after the restore, as there)
    server.start()
    committer = server.service.committer
    stop, dump = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: dump.set())

    def write_stats() -> None:
        seq = 0
        while not stop.is_set():
            if not dump.wait(0.5):
                continue
            dump.clear()
            seq += 1
            stats = {
                "seq": seq,
                "stages": committer.stage_times.take(),
                "snapshots_written": committer.snapshots.written,
                "clock_lost": server.state.clock.lost,
            }
            write_atomically(Path(args.stats_file), json.dumps(stats))

    threading.Thread(target=write_stats, daemon=True).start()
    ready = {
        "address": server.address,
        "replayed": sum(server.store.replayed.values()),
        "phases": server.restart_times.summary(),
    }
    write_atomically(Path(args.ready_file), json.dumps(ready))
    while not stop.wait(0.5):
        if os.getppid() == 1:  # the benchmark died: do not linger
            break
    server.stop(grace=1.0)
    return 0


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- harness
def proc_io(pid: int) -> dict[str, int]:
    """``/proc/PID/io`` as a dict (all the process's threads)."""
    fields = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        key, value = line.split(":")
        fields[key] = int(value)
    return fields


def proc_memory(pid: int) -> dict[str, int]:
    """``VmHWM`` and ``VmRSS`` of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def copy_reference_s(numel: int, threads: int) -> float:
    """Median seconds of ``dst.copy_(src)`` of ``numel`` fp32 values (``REFERENCE_COPIES``)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.rand(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)  # (pages touched once before timing)
    times = []
    for _ in range(REFERENCE_COPIES):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Syncer:
    """A ``serve`` process of this script on ``state_dir`` (started by the constructor, which
    returns once it serves)."""

    def __init__(self, args, params: int, state_dir: Path, tag: str, max_learners: int):
        self.ready_file = state_dir.parent / f"{tag}.ready"
        self.stats_file = state_dir.parent / f"{tag}.stats"
        argv = [sys.executable, __file__, "serve", f"--params={params}"]
        argv += [f"--state-dir={state_dir}", f"--ready-file={self.ready_file}"]
        argv += [f"--stats-file={self.stats_file}", f"--max-learners={max_learners}"]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self.seq = 0
        deadline = self.started_at + READY_WAIT_S
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the syncer on {state_dir} did not start")
            time.sleep(0.05)
        self.ready = json.loads(self.ready_file.read_text())
        self.address = self.ready["address"]

    def stats(self) -> dict:
        """The syncer's stage times since the last call (SIGUSR1), and its snapshots."""
        self.seq += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.stats_file.exists():
                stats = json.loads(self.stats_file.read_text())
                if stats["seq"] == self.seq:
                    return stats
            time.sleep(0.02)
        raise RuntimeError("the syncer did not write its stage times")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        fleet.stop_all([self.proc])


def rpc(address: str):
    """A stub on ``address`` and its channel."""
    import grpc

    from diloco.wire import diloco_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    return pb_grpc.SyncerStub(channel), channel


def status(address: str):
    from diloco.wire import diloco_pb2 as pb

    stub, channel = rpc(address)
    try:
        return stub.Status(pb.StatusRequest(), timeout=RPC_TIMEOUT_S)
    finally:
        channel.close()


def join_and_leave(address: str, layout, learner_id: str) -> None:
    """A Join the syncer answers, then its Leave (``grpc.RpcError`` if refused)."""
    from diloco.wire import diloco_pb2 as pb

    stub, channel = rpc(address)
    try:
        reply = stub.Join(
            pb.JoinRequest(
                learner_id=learner_id,
                layout_hash=layout.hash,
                num_fragments=layout.num_fragments,
                tensors=[pb.TensorSpec(name=n, shape=s, dtype=d) for n, s, d in layout.tensors],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        stub.Leave(pb.LeaveRequest(learner_id=learner_id, session=reply.session), timeout=30)
    finally:
        channel.close()


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def tape_records(tape: Path, event: str) -> list[dict]:
    """The tape's records of ``event`` (a torn last line, from the kill, skipped). Rounds:
    ``t`` when the round closed, ``opened_at`` when the clock last opened it (wall time);
    ticks: ``t`` when the clock opened a round and asked its learners."""
    records = []
    with tape.open() as f:
        for line in f:
            if f'"{event}"' not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == event:
                records.append(record)
    return records


def committed_after(rounds: list[dict], tick: dict) -> bool:
    """Whether the round ``tick`` opened was committed: the tape holds a round of its
    fragment at a version above the one the tick asked about."""
    return any(r["fragment"] == tick["fragment"] and r["version"] > tick["version"] for r in rounds)


def latencies_steps(results: list[dict], t0: float, t1: float, step: float) -> list[float]:
    """Per accepted upload sent within [t0, t1]: steps from its send to the arrival on its
    learner's stream of the version that merges it (``inf``: it never arrived)."""
    first: dict[tuple[str, int, int], float] = {}
    for result in results:
        for lid, arrived in result["arrivals"].items():
            for p, version, t in arrived:
                key = (lid, p, version)
                first[key] = min(first.get(key, math.inf), t)
    by_fragment: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for (lid, p, version), t in first.items():
        by_fragment.setdefault((lid, p), []).append((version, t))
    out = []
    for result in results:
        for _, sent, _, p, outcome, current, lid in result["records"]:
            if outcome != "accepted" or not t0 <= sent <= t1:
                continue
            later = [t for v, t in by_fragment.get((lid, p), ()) if v > current and t >= sent]
            out.append((min(later) - sent) / step if later else math.inf)
    return out


def measure(args, params: int, m: int, work: Path) -> dict:
    """One (N, M) point: a fresh syncer, M learners, the window, the restart; its row."""
    from diloco.algorithm.rounds import tick_period
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.snapshot_interval import records_per_snapshot
    from diloco.syncer.stage_times import STAGES, percentile

    config = SyncerConfig()
    P, H = config.protocol.num_fragments, config.protocol.sync_every
    layout = fleet.synthetic_layout(params, P)
    n = sum(f.numel for f in layout.fragments)
    numel = n / P
    threads = syncer_default("threads")
    copy_s = copy_reference_s(round(numel), threads)
    tag = f"n{n}-m{m}"
    duration = args.duration if args.duration is not None else snapshot_cycle_s(args.step, m)
    payload_dir = work / f"payloads-{tag}"
    payload_dir.mkdir()
    payloads = fleet.write_payloads(layout, payload_dir, config.up_codec)
    state_dir = work / f"state-{tag}"
    syncer = Syncer(args, params, state_dir, tag, m + 8)
    stop_file = work / f"{tag}.stop"
    clients, outs = [], []
    try:
        spec = {
            "addresses": [syncer.address],
            "prefix": tag,
            "fragments": P,
            "owner": [0] * P,
            "layout_hash": layout.hash,
            "tensors": [[name, list(shape), dtype] for name, shape, dtype in layout.tensors],
            "numel": [f.numel for f in layout.fragments],
            "payloads": [str(f) for f in payloads],
            "up_codec": config.up_codec,
            "step_s": args.step,
            "start_at": time.time() + 2.0,  # time for every client to join first
            "warmup_s": 0.0,
            "duration_s": args.warmup_timeout + args.settle + duration + 600,
            "subscribe": True,
            "schedule": config.schedule,
            "steps": H,
            "stop_file": str(stop_file),
        }
        spec_path = work / f"{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        nproc = min(args.client_procs, m)
        for c in range(nproc):
            first, count = c * m // nproc, (c + 1) * m // nproc - c * m // nproc
            outs.append(work / f"{tag}.client{c}.json")
            argv = [sys.executable, fleet.__file__, "client", f"--spec={spec_path}"]
            argv += [f"--first={first}", f"--count={count}", f"--out={outs[-1]}"]
            clients.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        wait_for(
            lambda: min(status(syncer.address).versions) >= 1,
            args.warmup_timeout,
            "every fragment's first commit",
            poll_s=min(1.0, args.step),
        )
        time.sleep(args.settle)
        syncer.stats()  # (the warm-up's stage times, forgotten)
        s0, io0, w0 = status(syncer.address), proc_io(syncer.proc.pid), time.time()
        stats0 = syncer.stats()
        time.sleep(duration)
        window = syncer.stats()
        s1, io1, w1 = status(syncer.address), proc_io(syncer.proc.pid), time.time()
        memory = proc_memory(syncer.proc.pid)
        time.sleep(args.drain_steps * args.step)  # (the window's last commits reach the streams)
    except BaseException:
        syncer.stop()
        raise
    finally:
        stop_file.touch()
        for c in clients:
            try:
                c.wait(timeout=120)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(timeout=10)
    results = [json.loads(o.read_text()) for o in outs if o.exists()]
    # --- restart: SIGKILL, then the same state directory
    syncer.kill()
    t_restart = time.monotonic()
    again = Syncer(args, params, state_dir, tag + "-restart", m + 8)
    try:
        status(again.address)
        join_and_leave(again.address, layout, f"{tag}-restart-probe")
        restart_s = time.monotonic() - t_restart
        restart_memory = proc_memory(again.proc.pid)
    finally:
        again.stop()
    # --- the row
    committed = s1.rounds - s0.rounds
    span = w1 - w0
    period = tick_period(args.step, sync_every=H, fragments=P)
    taped = tape_records(state_dir / "events.jsonl", "round")
    rounds = [r for r in taped if w0 <= r["t"] <= w1]
    opened = [r for r in taped if r["opened_at"] is not None and w0 <= r["opened_at"] <= w1]
    compressed = statistics.mean(r["bytes_up"] for r in rounds) if rounds else 0.0
    contributions = statistics.mean(len(r["participants"]) for r in rounds) if rounds else 0.0
    written = (io1["write_bytes"] - io0["write_bytes"]) - (
        io1["cancelled_write_bytes"] - io0["cancelled_write_bytes"]
    )
    snapshot_files = list((state_dir / "fragments").glob("p*.safetensors"))
    snapshot_bytes = statistics.mean(f.stat().st_size for f in snapshot_files)
    snapshots = window["snapshots_written"] - stats0["snapshots_written"]
    ticks = [t for t in tape_records(state_dir / "events.jsonl", "tick") if w0 <= t["t"] <= w1]
    per_commit = max(committed, 1)
    journal = max(0.0, written - snapshots * snapshot_bytes) / per_commit
    snapshot_every = records_per_snapshot(journal, snapshot_bytes, config.commits_per_snapshot)
    durable = journal + snapshot_bytes / snapshot_every
    lat = latencies_steps(results, w0, w1, args.step)
    records = [r for res in results for r in res["records"] if w0 <= r[1] <= w1]
    stages = {}
    for stage in STAGES:
        got = window["stages"].get(stage)
        if got is None:
            continue
        passes = PASSES.get(stage, 0)
        if passes == "M":
            passes = contributions if stage == "decode" or contributions >= 3 else 0
        elif passes == "M+1":
            passes = contributions + 1
        elif passes == "journal":
            passes = compressed / (4 * numel)
        per_commit_s = got["total_s"] / per_commit
        if stage == "snapshot":  # per snapshot: its passes against one snapshot's time
            per_commit_s = got["total_s"] / got["count"]
        stages[stage] = {
            "ms_per_commit": 1e3 * got["total_s"] / per_commit,
            "p50_ms": 1e3 * got["p50_s"],
            "p95_ms": 1e3 * got["p95_s"],
            "samples": got["count"],
            "passes": passes,
            "bandwidth_fraction": (
                passes * (copy_s / 2) / per_commit_s if passes and per_commit_s > 0 else None
            ),
        }
    return {
        "params": n,
        "learners": m,
        "step_s": args.step,
        "fragments": P,
        "sync_every": H,
        "up_codec": config.up_codec,
        "down_codec": config.down_codec,
        "commits_per_snapshot": config.commits_per_snapshot,
        "snapshot_every": snapshot_every,
        "fragment_values": numel,
        "window_s": span,
        "commits_in_window": committed,
        "commits_made": len(opened),
        "commits_due": math.floor(span / period) + 1,
        "clock_ticks": len(ticks),
        "clock_ticks_committed": sum(committed_after(taped, tick) for tick in ticks),
        "clock_lost": window["clock_lost"] - stats0["clock_lost"],
        "due_per_s": 1 / period,
        "uploads": len(records),
        "uploads_accepted": sum(r[4] == "accepted" for r in records),
        "latency_p50_steps": percentile(lat, 0.5),
        "latency_p95_steps": percentile(lat, 0.95),
        "uploads_never_merged": sum(math.isinf(x) for x in lat),
        "contributions_per_commit": contributions,
        "compressed_bytes_per_commit": compressed,
        "write_bytes_per_commit": written / per_commit,
        "wchar_per_commit": (io1["wchar"] - io0["wchar"]) / per_commit,
        "snapshots_in_window": snapshots,
        "snapshot_bytes": snapshot_bytes,
        "durable_bytes_per_commit": durable,
        "durable_over_compressed": durable / compressed if compressed else None,
        "rss_peak_bytes_per_param": memory["VmHWM"] / n,
        "rss_steady_bytes_per_param": memory["VmRSS"] / n,
        "restart_s": restart_s,
        "restart_replayed": again.ready["replayed"],
        "restart_phases": again.ready["phases"],
        "restart_rss_peak_bytes_per_param": restart_memory["VmHWM"] / n,
        "copy_ms": 1e3 * copy_s,
        "copy_GBps": 8 * numel / copy_s / 1e9,
        "threads": threads,
        "stages": stages,
    }


def check_row(row: dict) -> list[str]:
    """What is missing or inconsistent in a row (empty: complete): every commit-path stage
    timed, bytes written and merged, made ≤ due, latencies and the restart measured."""
    from diloco.syncer.stage_times import STAGES

    problems = []
    missing = [s for s in STAGES if s != "snapshot" and s not in row["stages"]]
    if missing:
        problems.append(f"stages not timed: {', '.join(missing)}")
    if row["commits_made"] < 1 or row["commits_in_window"] < 1:
        problems.append("no commit in the window")
    if row["commits_made"] > row["commits_due"]:
        problems.append(f"{row['commits_made']} commits made of {row['commits_due']} due")
    if not row["clock_ticks_committed"] <= row["clock_ticks"]:
        problems.append(f"{row['clock_ticks_committed']} of {row['clock_ticks']} ticks committed")
    if row["clock_lost"] < 0:
        problems.append(f"the clock lost {row['clock_lost']} ticks")
    for key in ("compressed_bytes_per_commit", "write_bytes_per_commit", "snapshot_bytes"):
        if not row[key] > 0:
            problems.append(f"{key} is {row[key]}")
    if not row["uploads_accepted"] or not math.isfinite(row["latency_p50_steps"]):
        problems.append("no upload-to-commit latency")
    if not row["restart_s"] > 0:
        problems.append("restart not measured")
    return problems


def fmt(value, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return format(value, spec)


def size_name(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def summary_table(rows: list[dict]) -> str:
    head = (
        "| N | M | step s | made / due | ticks committed / made, lost "
        "| upload→commit p50 / p95 (steps) | compressed B/commit "
        "| durable B/commit | durable / compressed | RSS peak / steady B/param | restart s "
        "| copy GB/s |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {size_name(r['params'])} | {r['learners']} | {r['step_s']:g} "
            f"| {r['commits_made']} / {r['commits_due']} "
            f"| {r['clock_ticks_committed']} / {r['clock_ticks']}, {r['clock_lost']:.2g} "
            f"| {fmt(r['latency_p50_steps'], '.2f')} / {fmt(r['latency_p95_steps'], '.2f')} "
            f"| {r['compressed_bytes_per_commit'] / 1e6:.2f} MB "
            f"| {r['durable_bytes_per_commit'] / 1e6:.2f} MB "
            f"| {fmt(r['durable_over_compressed'], '.2f')} "
            f"| {r['rss_peak_bytes_per_param']:.1f} / {r['rss_steady_bytes_per_param']:.1f} "
            f"| {r['restart_s']:.1f} | {r['copy_GBps']:.1f} |"
        )
    return "\n".join(lines)


def stage_table(row: dict) -> str:
    lines = [
        f"N = {size_name(row['params'])}, M = {row['learners']}: fragment {row['fragment_values']:.3g} "
        f"values, one fp32 copy of it {row['copy_ms']:.3g} ms",
        "",
        "| stage | ms/commit | p50 ms | p95 ms | samples | fp32 passes | bandwidth fraction |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage, s in row["stages"].items():
        lines.append(
            f"| {stage} | {s['ms_per_commit']:.2f} | {s['p50_ms']:.2f} | {s['p95_ms']:.2f} "
            f"| {s['samples']} | {fmt(s['passes'] or None, '.3g')} "
            f"| {fmt(s['bandwidth_fraction'], '.3f')} |"
        )
    return "\n".join(lines)


def restart_table(row: dict) -> str:
    """Where the restart's time went: the syncer's own phases (wall seconds), then the
    restore's parts (seconds summed over its threads)."""
    from diloco.syncer.restart_times import PARTS, PHASES

    phases = row["restart_phases"]
    lines = [
        f"restart of N = {size_name(row['params'])}, M = {row['learners']}: "
        f"{row['restart_s']:.2f} s to serve, {phases['total_s']:.2f} s of it in the syncer's "
        f"start ({phases['fragments']} fragments restored on {phases['threads']} threads, "
        f"{phases['replayed']} journal records replayed)",
        "",
        "| phase | s |",
        "|---|---|",
    ]
    lines += [f"| {name} | {phases[name + '_s']:.2f} |" for name in PHASES]
    lines += [f"| restore: {name} (thread s) | {phases[name + '_s']:.2f} |" for name in PARTS]
    return "\n".join(lines)


def bench(args: argparse.Namespace) -> int:
    rows = []
    root = Path(args.state_root) if args.state_root else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-syncer-scale-", dir=root) as tmp:
        for params in args.params:
            for m in args.learners:
                work = Path(tmp) / f"n{params}-m{m}"
                work.mkdir()
                row = measure(args, params, m, work)
                rows.append(row)
                print(summary_table([row]).splitlines()[-1], flush=True)
                subprocess.run(["rm", "-rf", str(work)], check=False)
    print()
    print(summary_table(rows))
    for row in rows:
        print()
        print(stage_table(row))
        print()
        print(restart_table(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    from diloco.plan import parse_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) the syncer process")
    s.add_argument("--params", type=int, required=True)
    s.add_argument("--state-dir", required=True)
    s.add_argument("--ready-file", required=True)
    s.add_argument("--stats-file", required=True)
    s.add_argument("--max-learners", type=int, required=True)
    parser.add_argument("--params", default="100M,350M,1B", help="model sizes (e.g. 100M,1B)")
    parser.add_argument("--learners", default="1,4", help="M values (synthetic learners)")
    parser.add_argument("--step", type=float, default=1.0, help="learner step in s")
    parser.add_argument(
        "--duration", type=float, default=None, help="measured s (one snapshot cycle)"
    )
    parser.add_argument("--settle", type=float, default=None, help="s after the warm-up (2 steps)")
    parser.add_argument("--warmup-timeout", type=float, default=1800.0, help="longest warm-up in s")
    parser.add_argument(
        "--drain-steps", type=float, default=3.0, help="steps the learners listen after the window"
    )
    parser.add_argument("--client-procs", type=int, default=2, help="synthetic learner processes")
    parser.add_argument("--state-root", help="where state directories go (on a disk)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)
    try:
        args.params = [int(parse_count(x)) for x in args.params.split(",")]
        args.learners = [int(x) for x in args.learners.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.learners) < 1 or min(args.params) < 1 or not args.step > 0:
        parser.error("--learners and --params must be >= 1 and --step > 0")
    if args.settle is None:
        args.settle = 2 * args.step
    return bench(args)


def snapshot_cycle_s(step: float, learners: int) -> float:
    """Seconds the clock takes, at ``step``, to make every fragment due K times (K: the
    records between a fragment's snapshots, ``snapshot_interval.records_per_snapshot`` for
    ``learners`` uploads of the default up codec per commit): each fragment's snapshot is
    written once per cycle."""
    from diloco.algorithm.rounds import tick_period
    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.snapshot_interval import SNAPSHOT_BYTES_PER_VALUE, records_per_snapshot
    from diloco.wire.comms import bytes_per_value

    config = SyncerConfig()
    P, H = config.protocol.num_fragments, config.protocol.sync_every
    journal = learners * bytes_per_value(config.up_codec)  # (per value of a fragment)
    every = records_per_snapshot(journal, SNAPSHOT_BYTES_PER_VALUE, config.commits_per_snapshot)
    return every * P * tick_period(step, sync_every=H, fragments=P)


if __name__ == "__main__":
    sys.exit(main())

"""The test kit: what many test modules need, written once.

Imported by test modules as ``from kit import ...`` (pytest puts ``tests/`` on the path);
``conftest.py`` turns the parts that need setup and teardown into fixtures. Everything here
is real: a real ``SyncerServer`` on a real port, real ``diloco`` processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file
from torch import nn

from diloco.algorithm import codecs
from diloco.algorithm.fragments import FragmentLayout, balanced_fragments
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.state import SyncerState
from diloco.wire import auth
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    what: str = "",
    *,
    interval: float = 0.02,
    alive: subprocess.Popen | None = None,
):
    """Poll ``condition`` until it returns something true (returned), or fail with an
    ``AssertionError`` naming ``what`` once ``timeout`` seconds pass (or, with ``alive``,
    as soon as that process has ended)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the process ended (exit {alive.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or condition}")
        time.sleep(interval)


def unused_port() -> int:
    """A loopback port that no one listens on now. Racy (another process may take it before
    it is used): only for a program told its port before it starts and that publishes it
    itself (deploy/slurm/syncer.sbatch); anything that reports the port it bound takes 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(seed: int = 0, sizes: tuple[int, ...] = (8, 32, 1), *, tanh: bool = True):
    """A small MLP (``nn.Sequential``) of ``Linear`` layers of ``sizes``, a ``Tanh`` between
    two when ``tanh``; its parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        if i and tanh:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def local_syncer(
    model: nn.Module,
    config: SyncerConfig | None = None,
    *,
    num_fragments: int | None = None,
    start: bool = True,
    **server_options,
) -> SyncerServer:
    """An in-process syncer on a free loopback port whose global model starts from
    ``model`` (``SyncerServer.for_model``), started unless ``start`` is false.
    ``num_fragments`` overrides the config's P; ``server_options`` go to the server
    (``tape_path``, ``state_dir``, ``bind``, tokens, ...). The caller stops it."""
    config = config or SyncerConfig()
    if num_fragments is not None:
        protocol = dataclasses.replace(config.protocol, num_fragments=num_fragments)
        config = dataclasses.replace(config, protocol=protocol)
    server = SyncerServer.for_model(model, config=config, **server_options)
    return server.start() if start else server


def syncer_state(
    model: nn.Module, config: SyncerConfig | None = None, *, num_fragments: int | None = None
) -> tuple[SyncerState, FragmentLayout, list[dict]]:
    """The syncer's decisions without a server: a ``SyncerState`` whose global model starts
    from ``model`` (``num_fragments`` overrides the config's P), its layout, and the list its
    events are appended to."""
    config = config or SyncerConfig()
    if num_fragments is not None:
        protocol = dataclasses.replace(config.protocol, num_fragments=num_fragments)
        config = dataclasses.replace(config, protocol=protocol)
    layout = balanced_fragments(model.named_parameters(), config.protocol.num_fragments)
    named = dict(model.named_parameters())
    values = [layout.gather(p, named) for p in range(layout.num_fragments)]
    events: list[dict] = []
    return SyncerState(layout, values, config, emit=events.append), layout, events


def join_state(state: SyncerState, learner_id: str, now: float = 0.0, **fields) -> str:
    """Join ``learner_id`` to ``state`` with its own layout (``fields``: ``observer``,
    ``tokens_per_step``, ...); returns the session."""
    layout = state.layout
    request = {"observer": False, **fields}
    return state.join(
        learner_id,
        tensors=layout.tensors,
        layout_hash=layout.hash,
        num_fragments=layout.num_fragments,
        now=now,
        **request,
    ).session


def join_request(layout, learner_id: str = "a", **fields) -> pb.JoinRequest:
    """A valid ``JoinRequest`` of ``layout`` (``fields`` override or add to it)."""
    tensors = [pb.TensorSpec(name=n, shape=list(s), dtype=d) for n, s, d in layout.tensors]
    request = {
        "learner_id": learner_id,
        "layout_hash": layout.hash,
        "num_fragments": layout.num_fragments,
        "tensors": tensors,
        **fields,
    }
    return pb.JoinRequest(**request)


def diloco_command(*args: str) -> list[str]:
    """The command line of ``diloco ARGS`` with this interpreter."""
    return [sys.executable, "-m", "diloco.cli", *args]


def run_diloco(
    *args: str, timeout: float = 240, cwd: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``diloco ARGS`` to its end (bounded by ``timeout``), output captured as text,
    no stdin; ``env`` is added to this process's environment."""
    return subprocess.run(
        diloco_command(*args),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def pids_mentioning(*texts: str) -> list[int]:
    """Processes (other than this one) whose command line contains every one of ``texts``:
    to find what a test left running."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(t in cmd for t in texts):
            out.append(int(entry.name))
    return out


def end_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Stop a ``diloco run`` a test started (SIGTERM, bounded wait, SIGKILL) and kill
    whatever of its run is still alive: nothing of a run may outlive its test."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for pid in pids_mentioning(str(run_dir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_step(workdir: Path) -> int:
    """The newest step a learner's ``progress.jsonl`` in ``workdir`` records (0: none)."""
    try:
        lines = (workdir / "progress.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(x).get("step", 0) for x in lines if x.endswith("}")), default=0)


def steps_then_trained_past(
    workdirs: list[Path], timeout: float, what: str, alive: subprocess.Popen | None = None
) -> list[int]:
    """The step each learner (by its work directory) has reached now, returned once every
    one has recorded a later step: what a test records at the last event it checks, before it
    stops the run there (its learners then trained after that event, and a final step of
    at least this shows that nothing they reached was lost). Fails naming ``what`` after
    ``timeout`` seconds (or, with ``alive``, once that process ended)."""
    reached = [last_step(w) for w in workdirs]
    wait_until(
        lambda: all(last_step(w) > s for w, s in zip(workdirs, reached, strict=True)),
        timeout,
        what,
        interval=0.2,
        alive=alive,
    )
    return reached


def run_diloco_json(*args: str, timeout: float = 240) -> dict:
    """Run ``diloco ARGS`` (a command with ``--json``), assert it exited 0 (its output is the
    message otherwise) and return what it printed, parsed."""
    proc = run_diloco(*args, timeout=timeout)
    assert proc.returncode == 0, (proc.stderr + proc.stdout)[-4000:]
    return json.loads(proc.stdout)


class GrowingTape:
    """The records of a running ``diloco run``'s tape (a JSONL file) as it grows: each
    ``read()`` parses only the complete lines written since the last one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict] = []
        self._offset = 0

    def read(self) -> list[dict]:
        """Every complete record so far (empty while there is no tape yet)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        complete = data.rfind(b"\n") + 1
        self.records += [json.loads(line) for line in data[:complete].splitlines() if line]
        self._offset += complete
        return self.records


def stop_when(
    proc: subprocess.Popen,
    tape: GrowingTape,
    done: Callable[[list[dict]], object],
    timeout: float,
    what: str,
) -> None:
    """End the ``diloco run`` ``proc`` as Ctrl+C does (SIGTERM: its learners flush, the final
    model is scored, the summary written) once ``done(its tape's records)`` is true, so that
    a run bounded by a generous ``--minutes`` ends as soon as what a test checks has
    happened. Sends nothing to a run that ended or is stopping by itself already (its
    learners' ``stopping`` records are taped: late in its stop it no longer catches the
    signal); fails naming ``what`` after ``timeout`` seconds."""
    wait_until(lambda: proc.poll() is not None or done(tape.read()), timeout, what, interval=0.2)
    stopping = any(r["event"] == "stopping" for r in tape.read())
    if proc.poll() is None and not stopping:
        proc.send_signal(signal.SIGTERM)


def start_diloco(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``diloco ARGS`` in the background: output to pipes as text, no stdin. The
    caller ends it (and reads its pipes)."""
    return subprocess.Popen(
        diloco_command(*args),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


#: Seconds a ``diloco run`` may take to stop after its SIGTERM: its learners flush and drain,
#: the final model is scored, the summary written (a loaded machine takes tens of seconds).
STOP_S = 120.0


def run_diloco_until(
    run_dir: Path,
    *args: str,
    done: Callable[[list[dict]], object],
    timeout: float,
    what: str,
) -> dict:
    """Run ``diloco run ARGS`` (its run directory ``run_dir``, ``--json`` among ``ARGS``) until
    ``done(its tape's records)``, then end it as Ctrl+C does (``stop_when``): a run bounded by
    a generous ``--minutes`` or ``--steps`` ends as soon as what a test checks has happened.
    Asserts it exited 0 and returns the summary it printed; nothing of it outlives the call
    (``end_run``). Its output goes to files, not pipes: a pipe nobody reads while it runs
    could fill and stall it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            diloco_command("run", *args),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            tape = GrowingTape(run_dir / "syncer" / "events.jsonl")
            stop_when(proc, tape, done, timeout, what)
            proc.wait(STOP_S)
        finally:
            end_run(proc, run_dir)
        out.seek(0)
        err.seek(0)
        printed, logged = out.read(), err.read()
    assert proc.returncode == 0, (logged + printed)[-4000:]
    return json.loads(printed)


def progress_of(run: Path, learner: str) -> list[dict]:
    """A learner's (or data-parallel rank's) progress records of ``diloco run``'s run
    directory ``run`` so far: the complete lines of its ``progress.jsonl``."""
    try:
        text = (run / "learners" / learner / "progress.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()[: text.count("\n")] if line]


def train_in_threads(train: Callable, learners: list, models: list, *args, timeout: float = 30):
    """``train(learner, model, i, *args)`` for every learner on a thread of its own, all
    joined (each bounded by ``timeout`` seconds)."""
    threads = [
        threading.Thread(target=train, args=(lr, m, i, *args))
        for i, (lr, m) in enumerate(zip(learners, models, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def current_fragments(workdir: Path, final: dict) -> tuple[dict, int]:
    """A finished learner's ``final.json`` and how many of its fragments are the syncer's
    last version, bit for bit as sent on the wire (``final``: fragment -> what
    ``FragmentStore.load`` returned). A fragment it holds must be no newer than the
    syncer's (asserted)."""
    held = json.loads((workdir / "final.json").read_text())
    anchors = load_file(str(workdir / "final.safetensors"))
    current = 0
    for p, (version, _, saved) in final.items():
        assert 0 <= held["versions"][p] <= version, (workdir, p)
        if held["versions"][p] == version:
            assert torch.equal(anchors[f"anchor.{p}"], saved["wire"]), (workdir, p)
            current += 1
    return held, current


def wandb_history(run_file: Path) -> list[dict] | None:
    """The ``history`` records of a W&B run file (``run-*.wandb``), read as its own format
    is written: a 7-byte header, then LevelDB-log records (crc32, length, type; 32 KiB
    blocks) of ``wandb_internal_pb2.Record`` messages. None until its ``exit`` record is
    there (W&B's service writes the file after ``finish()`` returns)."""
    from wandb.proto import wandb_internal_pb2 as wpb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wpb.Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "exit":
                return records
            if record.WhichOneof("record_type") == "history":
                records.append(
                    {
                        (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return None


def upload_chunks(data: bytes, *, chunk_bytes: int | None = None, **header) -> list[pb.UploadChunk]:
    """An upload's chunks: ``data`` cut into pieces of ``chunk_bytes`` (None: one chunk), each
    with the same ``header`` fields (``learner_id``, ``session``, ``fragment``, ...) and its
    ``chunk_index``; ``num_chunks`` is theirs unless ``header`` names another."""
    step = chunk_bytes or max(len(data), 1)
    pieces = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    header.setdefault("num_chunks", len(pieces))
    return [pb.UploadChunk(chunk_index=i, data=piece, **header) for i, piece in enumerate(pieces)]


class Peer:
    """The raw client of the wire protocol, honest or not: it says what it is told to say
    (join, heartbeat, subscribe, an upload, leave), with no ledger and no retries."""

    def __init__(
        self,
        server: SyncerServer,
        learner_id: str = "a",
        *,
        token: str | None = None,
        generation: int = 0,
        address: str | None = None,
        options: list[tuple[str, object]] | None = None,
    ):
        """``generation``: the process generation it joins with (0: not given); ``address``:
        where it dials (default the syncer's; a relay's to come from elsewhere); ``options``:
        gRPC channel options (``OWN_CONNECTION``: a TCP connection of its own)."""
        self.server, self.learner_id = server, learner_id
        self.channel = grpc.insecure_channel(address or server.address, options=options)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.metadata = auth.call_metadata(token)
        self.session = ""
        self.generation = generation
        self.up_codec = "fp32"
        """The codec its uploads use unless told: the one the syncer named at the last join."""

    def join(self, tokens_per_step: int = 0, timeout: float = 5.0, **fields) -> pb.JoinReply:
        """Join (``fields``: more of the ``JoinRequest``, e.g. ``observer=True``); keeps the
        session and the syncer's up codec."""
        request = join_request(
            self.server.layout,
            self.learner_id,
            tokens_per_step=tokens_per_step,
            generation=self.generation,
            **fields,
        )
        reply = self.stub.Join(request, timeout=timeout, metadata=self.metadata)
        self.session, self.up_codec = reply.session, reply.up_codec or self.up_codec
        return reply

    def heartbeat(self, *, steps_per_s: float = 10.0, tokens: int = 0) -> bool:
        reply = self.stub.Heartbeat(
            pb.HeartbeatRequest(
                learner_id=self.learner_id,
                session=self.session,
                steps_per_s=steps_per_s,
                tokens=tokens,
                state="training",
            ),
            timeout=5,
            metadata=self.metadata,
        )
        return reply.known

    def leave(self) -> None:
        self.stub.Leave(
            pb.LeaveRequest(learner_id=self.learner_id, session=self.session),
            timeout=5,
            metadata=self.metadata,
        )

    def subscribe(self, session: str | None = None):
        """The version stream (an iterator of replies; ``session``: another than its own)."""
        request = pb.SubscribeRequest(learner_id=self.learner_id, session=session or self.session)
        return self.stub.Subscribe(request, timeout=60, metadata=self.metadata)

    def upload(
        self,
        fragment: int = 0,
        delta: torch.Tensor | None = None,
        *,
        steps: int = 24,
        tokens: int | None = None,
        step_time_s: float = 0.1,
        base: int | None = None,
        upload_id: int = 0,
        resend: bool = False,
        codec: str | None = None,
        chunk_bytes: int | None = None,
        timeout: float = 10,
    ) -> pb.UploadReply:
        """Upload ``delta`` (default 1e-3 everywhere) of ``fragment``: against version ``base``
        (default the syncer's current one), in ``codec`` (default the syncer's up codec),
        claiming ``steps`` and ``tokens`` (default 10 per step), in one chunk or pieces of
        ``chunk_bytes``."""
        numel = self.server.layout.fragments[fragment].numel
        delta = torch.full((numel,), 1e-3) if delta is None else delta
        codec = codec or self.up_codec
        chunks = upload_chunks(
            codecs.encode(delta, codec),
            chunk_bytes=chunk_bytes,
            learner_id=self.learner_id,
            session=self.session,
            fragment=fragment,
            base_version=self.server.state.versions[fragment] if base is None else base,
            steps=steps,
            tokens=10 * steps if tokens is None else tokens,
            codec=codec,
            numel=delta.numel(),
            step_time_s=step_time_s,
            upload_id=upload_id,
            resend=resend,
        )
        return self.stub.Upload(iter(chunks), timeout=timeout, metadata=self.metadata)

    def silent_uploads(self, n: int, release: threading.Event) -> list:
        """``n`` upload streams that send no chunk until ``release`` is set (their futures)."""

        def never():
            release.wait(60)
            return
            yield

        return [
            self.stub.Upload.future(never(), timeout=60, metadata=self.metadata) for _ in range(n)
        ]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Channel options that give a :class:`Peer` a TCP connection of its own (not shared
in-process): what tests of per-connection caps need."""


def join_and_upload(server: SyncerServer, upload_id: int, *, learner_id: str = "a", base: int = 0):
    """Join ``server`` as ``learner_id`` (a new session) and upload a small delta of fragment
    0 against version ``base`` in the syncer's up codec, with ``upload_id``; the reply."""
    with Peer(server, learner_id) as peer:
        peer.join()
        return peer.upload(upload_id=upload_id, base=base, steps=4, tokens=32, timeout=5)


OWN_MODEL_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_model"


def run_own_model_example(work: Path, *syncer_flags: str, steps: int) -> tuple[str, list[str]]:
    """``examples/own_model`` run by hand in ``work`` as its README says: ``diloco syncer
    --model model:build --state-dir syncer-state --stop-when-learners-leave`` (plus
    ``syncer_flags``) and two ``python train.py`` learners of ``steps`` steps, until the
    syncer ends by itself; each must exit 0. Returns the syncer's stdout and the learners'."""
    import shutil

    shutil.copytree(OWN_MODEL_EXAMPLE, work)
    syncer = start_diloco(
        "syncer",
        "--model=model:build",
        "--bind=127.0.0.1:0",
        f"--port-file={work / 'port'}",
        "--state-dir=syncer-state",
        "--stop-when-learners-leave",
        *syncer_flags,
        cwd=work,
    )
    learners, outs = [], []
    try:
        address = wait_until(
            lambda: (work / "port").is_file() and (work / "port").read_text(),
            60,
            "the syncer's port file",
            alive=syncer,
        )
        learners = [
            subprocess.Popen(
                [sys.executable, "train.py", f"--syncer={address}", f"--id={site}"]
                + [f"--steps={steps}"],
                cwd=work,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for site in ("site-a", "site-b")
        ]
        for proc in learners:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            outs.append(out)
        out, err = syncer.communicate(timeout=60)  # it ends by itself once both left
        assert syncer.returncode == 0, err
        return out, outs
    finally:
        for proc in [syncer, *learners]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

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
import struct
import subprocess
import sys
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


def run_diloco_json(*args: str, timeout: float = 240) -> dict:
    """Run ``diloco ARGS`` (a command with ``--json``), assert it exited 0 (its output is the
    message otherwise) and return what it printed, parsed."""
    proc = run_diloco(*args, timeout=timeout)
    assert proc.returncode == 0, (proc.stderr + proc.stdout)[-4000:]
    return json.loads(proc.stdout)


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


class Peer:
    """A raw client of the wire protocol, honest or not: it says what it is told to say
    (join, heartbeat, an fp32 upload, leave), with no ledger and no retries."""

    def __init__(
        self,
        server: SyncerServer,
        learner_id: str,
        *,
        token: str | None = None,
        generation: int = 0,
    ):
        """``generation``: the process generation it joins with (0: not given)."""
        self.server, self.learner_id = server, learner_id
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.metadata = auth.call_metadata(token)
        self.session = ""
        self.generation = generation

    def join(self, tokens_per_step: int = 0, timeout: float = 5.0) -> pb.JoinReply:
        layout = self.server.layout
        request = join_request(
            layout, self.learner_id, tokens_per_step=tokens_per_step, generation=self.generation
        )
        reply = self.stub.Join(
            request,
            timeout=timeout,
            metadata=self.metadata,
        )
        self.session = reply.session
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

    def upload(
        self, fragment: int, delta: torch.Tensor, *, steps=24, tokens=240, step_time_s=0.1
    ) -> pb.UploadReply:
        payload = codecs.encode(delta, "fp32")
        chunk = pb.UploadChunk(
            learner_id=self.learner_id,
            session=self.session,
            fragment=fragment,
            base_version=self.server.state.versions[fragment],
            steps=steps,
            tokens=tokens,
            codec="fp32",
            numel=delta.numel(),
            chunk_index=0,
            num_chunks=1,
            data=payload,
            step_time_s=step_time_s,
        )
        return self.stub.Upload(iter([chunk]), timeout=10, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def join_and_upload(server: SyncerServer, upload_id: int, *, learner_id: str = "a", base: int = 0):
    """Join ``server`` as ``learner_id`` (a new session) and upload a small delta of fragment
    0 against version ``base`` in the syncer's up codec, with ``upload_id``; the reply."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SyncerStub(channel)
        joined = stub.Join(join_request(server.layout, learner_id), timeout=5)
        n = server.layout.fragments[0].numel
        chunk = pb.UploadChunk(
            learner_id=learner_id,
            session=joined.session,
            fragment=0,
            base_version=base,
            steps=4,
            tokens=32,
            codec=joined.up_codec,
            numel=n,
            chunk_index=0,
            num_chunks=1,
            data=codecs.encode(torch.full((n,), 1e-3), joined.up_codec),
            step_time_s=0.1,
            upload_id=upload_id,
        )
        return stub.Upload(iter([chunk]), timeout=5)

"""The processes of the torchft peer: a lighthouse, and one replica group per learner.

``python -m diloco.cli.torchft_replica lighthouse --port-file F --min-replicas M``
    runs torchft's in-wheel ``LighthouseServer`` on a free port and writes its address to F.

``python -m diloco.cli.torchft_replica replica --config FILE``
    (a :class:`diloco.config.torchft.ReplicaConfig`: ``index``, ``workdir``, ...) runs one replica group (one process, world size 1, gloo on CPU). It hosts its own
    ``TCPStore`` on a free port, builds torchft's ``Manager`` (synchronous quorum, as DiLoCo
    requires) and trains the recipe exactly like our learner (:mod:`diloco.launch.learner_worker`:
    same model init, AdamW, lr schedule, gradient clipping, per-learner data stream, ``--slow``
    emulation) under ``torchft.local_sgd.DiLoCo``: every ``sync_every`` inner steps (every
    ``sync_every / fragments`` with streaming fragments) the pseudo-gradients are all-reduced
    across the replica groups in the quorum and the outer optimizer (SGD, Nesterov when the
    momentum is > 0) steps.

Contract of a replica (what :mod:`diloco.baselines.torchft.peer` relies on):

* after every fragment sync it appends one JSON line to ``D/progress.jsonl`` (``t``, inner
  ``step``, ``tokens``, ``outer_step`` = torchft's committed step, ``committed``,
  ``useful_tokens``, ``compute_s``, ``sync_s``, ``bytes_sent``, ``bytes_received``, ``loss``);
* it stops at a sync boundary once the committed step reaches ``--rounds`` or the parent has
  created ``D/../stop``; a replica that sees that a peer stopped (``D/../replica-J/stopped``)
  stops at once, so every replica ends after the same commit (see :class:`_ReplicaRun`);
* at exit it writes ``D/stopped``, the global model (the last committed value of every
  fragment, i.e. torchft's backup copy) to ``D/final.safetensors`` and an
  ``{"event": "exit"}`` progress line;
* it never outlives ``--hard-deadline`` (epoch seconds), a SIGTERM or its parent by more than
  ~15 s.

``--slow F`` stretches the compute of each inner step (forward, backward, AdamW) to F times its
cost *before* the sync, so only compute is slowed, never the time spent waiting for peers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from diloco.baselines.torchft.netbytes import SocketBytes
from diloco.config.torchft import LighthouseConfig, ReplicaConfig
from diloco.runtime.training import inner_step, schedule_length, set_lr, stop_on_signals

STOP_FILE = "stop"


def lighthouse_main(config: LighthouseConfig) -> int:
    """Serve a torchft lighthouse until SIGTERM or parent death."""
    from torchft._torchft import LighthouseServer

    from diloco.runtime.procs import exit_with_parent

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exit_with_parent(stop)
    server = LighthouseServer(
        bind=config.bind,
        min_replicas=config.min_replicas,
        join_timeout_ms=config.join_timeout_ms,
        quorum_tick_ms=config.quorum_tick_ms,
        heartbeat_timeout_ms=config.heartbeat_timeout_ms,
    )
    _atomic_write(Path(config.port_file), server.address())
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0


def split_fragments(model, count: int) -> list:
    """``count`` modules that hold disjoint subsets of ``model``'s parameters (the same
    ``Parameter`` objects), balanced by size: largest tensor first into the lightest fragment.

    torchft's DiLoCo takes fragments as modules; whole tensors only (torchft cannot cut one).
    ``count = 1`` returns ``[model]``.
    """
    from torch import nn

    if count == 1:
        return [model]
    named = sorted(model.named_parameters(), key=lambda kv: (-kv[1].numel(), kv[0]))
    if count > len(named):
        raise ValueError(f"{count} fragments but only {len(named)} parameter tensors")
    holders = [nn.Module() for _ in range(count)]
    sizes = [0] * count
    for name, param in named:
        i = min(range(count), key=lambda j: (sizes[j], j))
        holders[i].register_parameter(name.replace(".", "__"), param)
        sizes[i] += param.numel()
    return holders


def replica_main(config: ReplicaConfig) -> int:
    """Run one replica group until its budget is spent, a peer stops, or a signal (the
    module docstring gives the contract)."""
    import torch

    from diloco.recipes import recipe_of

    if config.recipe.inner_optimizer != "adamw":  # torchft hooks the optimizer's own step
        print("torchft replica: only --inner-optimizer adamw (torchft's DiLoCo)", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    _advertise_as(config.host)
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stop = stop_on_signals()
    _watchdog(stop, config.hard_deadline_epoch_s)
    recipe = recipe_of(config.recipe)
    lighthouse = _lighthouse_address(config, stop)
    model = recipe.build_model(config.recipe.seed)  # same init in every replica, as ours
    inner = recipe.build_optimizer(model)
    fragments = split_fragments(model, config.fragments)
    manager = _manager(config, model, inner, lighthouse)
    run = _ReplicaRun(config, workdir, model, fragments)
    try:
        _train(config, recipe, run, manager, inner, stop)
    finally:
        run.close()
        manager.shutdown(wait=False)
    return 0


def _advertise_as(host: str) -> None:
    """Make this process's host name ``host`` for torchft. Its process group advertises
    ``socket.gethostname()`` to the other replica groups (the store in its reconfigure handle,
    ``torchft/process_group.py``); on a wide-area link (``--wan``) that name must be the
    replica's link address, not a name that resolves to the loopback. Only this child process
    is affected."""
    if host != "127.0.0.1":
        import socket

        socket.gethostname = lambda: host


def _manager(config: ReplicaConfig, model, inner, lighthouse: str):
    """torchft's ``Manager`` for this replica group, on a ``TCPStore`` it hosts itself."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    store = TCPStore(config.host, 0, is_master=True, wait_for_workers=False)
    return Manager(
        pg=ProcessGroupGloo(timeout=_td(config.timeout_s)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=config.min_replica_size,
        use_async_quorum=False,
        timeout=_td(config.timeout_s),
        quorum_timeout=_td(config.quorum_timeout_s),
        connect_timeout=_td(config.timeout_s),
        rank=0,
        world_size=1,
        store_addr=config.host,
        store_port=store.port,
        hostname=config.host,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{config.index}",
        init_sync=False,  # every replica builds the same initial model from the seed
    )


def _outer_optimizers(config: ReplicaConfig, fragments: list) -> list:
    """One outer SGD per fragment (Nesterov when the momentum is > 0; torch refuses Nesterov
    without momentum)."""
    import torch

    nesterov = config.outer_momentum > 0
    return [
        torch.optim.SGD(
            f.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=nesterov
        )
        for f in fragments
    ]


def _train(config: ReplicaConfig, recipe, run: _ReplicaRun, manager, inner, stop) -> None:
    """The training loop under torchft's DiLoCo (which syncs inside ``inner.step()`` every
    ``sync_every / fragments`` steps); ends with :meth:`_ReplicaRun.finish`."""
    from torchft.local_sgd import DiLoCo

    stream = recipe.stream(
        learner_id=config.index, seed=config.recipe.seed, batch_size=config.batch_size
    )
    timing = {"t0": 0.0, "compute_end": 0.0}

    def after_inner_step(*_args) -> None:
        # Registered before DiLoCo's own hook, so it runs after AdamW and before the sync.
        now = time.perf_counter()
        if config.slow > 1.0:
            time.sleep((config.slow - 1.0) * (now - timing["t0"]))
        timing["compute_end"] = time.perf_counter()

    hook = inner.register_step_post_hook(after_inner_step)
    steps_per_sync = config.sync_every // config.fragments
    run_started_epoch_s = config.run_started_epoch_s or run.started
    since_sync = 0
    outer = _outer_optimizers(config, run.fragments)
    with DiLoCo(
        manager,
        run.fragments,
        inner,
        outer,
        sync_every=config.sync_every,
        fragment_sync_delay=config.sync_delay,
    ) as diloco:
        run.diloco = diloco
        _finisher(run, manager, stop)
        reason = "signal"
        while not stop.is_set():
            if run.peer_stopped():
                reason = "peer stopped"  # no full quorum can form again: stop right here
                break
            if since_sync == 0 and run.should_stop(manager.current_step()):
                reason = "budget"
                break
            length = schedule_length(config, run.steps, time.time() - run_started_epoch_s)
            set_lr(inner, recipe.lr_at(run.steps, length))
            outer_before = manager.current_step()
            timing["t0"] = time.perf_counter()
            batch = stream.next_batch()
            run.in_step = time.monotonic()
            # DiLoCo syncs inside inner.step()
            loss = inner_step(run.model, inner, batch, loss_fn=recipe.loss)
            run.in_step = None
            compute_s = timing["compute_end"] - timing["t0"]
            run.count(recipe.tokens(batch), compute_s, time.perf_counter() - timing["compute_end"])
            since_sync += 1
            if since_sync == steps_per_sync:
                since_sync = 0
                run.synced(outer_before, manager.current_step(), loss)
        run.finish(manager.current_step(), reason)
    hook.remove()


class _ReplicaRun:
    """One replica's counters, progress file and exit protocol.

    Stopping: a replica stops at a sync boundary when the committed step reaches ``--rounds``
    or the parent has written the stop file. It then writes ``stopped`` (its committed step),
    the global model and its exit line (:meth:`finish`). A replica that sees a peer's
    ``stopped`` stops at once, wherever it is: no quorum of every replica can form again, so
    its work since the last commit could never be committed (it is not counted as useful).
    :meth:`finish` is idempotent and may run on the finisher thread when the main thread is
    blocked in a quorum that can no longer form.
    """

    def __init__(self, config: ReplicaConfig, workdir: Path, model, fragments: list) -> None:
        self.config = config
        self.workdir = workdir
        self.model = model
        self.fragments = fragments
        self.diloco = None
        self.stop_file = workdir.parent / STOP_FILE
        self.peers = [
            workdir.parent / f"replica-{j}" / "stopped"
            for j in range(config.replicas)
            if j != config.index
        ]
        self.progress = (workdir / "progress.jsonl").open("a")
        self.netbytes = SocketBytes()
        self.lock = threading.Lock()
        self.finished = False
        self.in_step: float | None = None  # monotonic time the current inner step began
        self.steps = self.tokens = self.failures = 0
        self.useful = self.compute_s = self.sync_s = 0.0
        self.loss = float("nan")
        self.marks = [0] * config.fragments  # tokens at the last sync of each fragment
        self.started = time.time()

    def peer_stopped(self) -> bool:
        return any(p.exists() for p in self.peers)

    def should_stop(self, outer_step: int) -> bool:
        return (
            bool(self.config.rounds and outer_step >= self.config.rounds) or self.stop_file.exists()
        )

    def count(self, tokens: int, compute_s: float, sync_s: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.compute_s += compute_s
        self.sync_s += sync_s

    def synced(self, outer_before: int, outer_after: int, loss: float) -> None:
        """Account for the fragment sync that ended the last inner step; log a progress line."""
        committed = outer_after > outer_before
        frag = outer_before % self.config.fragments
        if committed:
            self.useful += (self.tokens - self.marks[frag]) / self.config.fragments
        else:
            self.failures += 1  # torchft restored this fragment: its local progress is lost
        self.marks[frag] = self.tokens
        self.loss = loss
        self._write(outer_step=outer_after, committed=committed)

    def finish(self, outer_step: int, reason: str) -> None:
        """Write ``stopped``, the global model and the exit line (once)."""
        from safetensors.torch import save_file

        with self.lock:
            if self.finished:
                return
            self.finished = True
            _atomic_write(self.workdir / "stopped", str(outer_step))
            tmp = self.workdir / "final.safetensors.tmp"
            save_file(self.global_state(), str(tmp))
            os.replace(tmp, self.workdir / "final.safetensors")
            self._write(
                event="exit",
                outer_step=outer_step,
                train_s=time.time() - self.started,
                commit_failures=self.failures,
                stopped_by=reason,
            )

    def global_state(self) -> dict:
        """The model with every fragment at its last committed value (torchft's backup copy,
        ``_StreamingDiLoCoFragment.original_parameters``: private, read only)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        state = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        for module, fragment in zip(self.fragments, self.diloco._fragments, strict=True):
            for local, param in module.named_parameters():
                state[names[id(param)]] = fragment.original_parameters[local].detach().clone()
        return state

    def _write(self, **fields) -> None:
        sent, received = self.netbytes.sample()
        record = {
            "t": time.time(),
            "step": self.steps,
            "tokens": self.tokens,
            "useful_tokens": self.useful,
            "compute_s": self.compute_s,
            "sync_s": self.sync_s,
            "bytes_sent": sent,
            "bytes_received": received,
            "loss": self.loss,
            **fields,
        }
        self.progress.write(json.dumps(record) + "\n")
        self.progress.flush()

    def close(self) -> None:
        self.progress.close()


def _finisher(run: _ReplicaRun, manager, stop: threading.Event, grace_s: float = 2.0) -> None:
    """When a peer has stopped but the main thread stays inside an inner step for ``grace_s``
    (blocked in a quorum that cannot form), finish from this thread and exit the process."""

    def watch() -> None:
        while True:
            time.sleep(0.1)
            began = run.in_step
            if began is None or time.monotonic() - began < grace_s:
                continue
            if run.peer_stopped() or stop.is_set():
                run.finish(manager.current_step(), "peer stopped (blocked in quorum)")
                run.close()
                os._exit(0)

    threading.Thread(target=watch, name="finisher", daemon=True).start()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _lighthouse_address(config: ReplicaConfig, stop: threading.Event) -> str:
    """``--lighthouse``, or the address the lighthouse writes to ``--lighthouse-file`` (waited
    for, so that replicas start in parallel with the lighthouse, bounded by the deadline)."""
    if config.lighthouse:
        return config.lighthouse
    path = Path(config.lighthouse_file)
    while not stop.is_set():
        if path.exists():
            address = path.read_text().strip()
            if config.lighthouse_host:  # http://name:port -> http://host:port
                scheme, _, rest = address.rpartition("://")
                port = rest.rsplit(":", 1)[1]
                address = f"{scheme + '://' if scheme else ''}{config.lighthouse_host}:{port}"
            return address
        time.sleep(0.05)
    raise SystemExit("torchft replica: stopped before the lighthouse was up")


def _watchdog(stop: threading.Event, hard_deadline_epoch_s: float) -> None:
    """Exit hard at ``hard_deadline_epoch_s``, or 15 s after a stop request the loop did not honour
    (a replica blocked in a quorum whose peers are gone), or when the parent goes away."""
    parent = os.getppid()

    def watch() -> None:
        stop_seen = None
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                stop.set()
            if stop.is_set() and stop_seen is None:
                stop_seen = time.monotonic()
            late = stop_seen is not None and time.monotonic() - stop_seen > 15.0
            if late or (hard_deadline_epoch_s and time.time() > hard_deadline_epoch_s):
                print("torchft replica: watchdog exit", file=sys.stderr, flush=True)
                os._exit(3)

    threading.Thread(target=watch, name="watchdog", daemon=True).start()


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)

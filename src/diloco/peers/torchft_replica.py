"""The processes of the torchft peer: a lighthouse, and one replica group per learner.

``python -m diloco.peers.torchft_replica lighthouse --port-file F --min-replicas M``
    runs torchft's in-wheel ``LighthouseServer`` on a free port and writes its address to F.

``python -m diloco.peers.torchft_replica replica --index I --lighthouse-file F --workdir D ...``
    runs one replica group (one process, world size 1, gloo on CPU). It hosts its own
    ``TCPStore`` on a free port, builds torchft's ``Manager`` (synchronous quorum, as DiLoCo
    requires) and trains the recipe exactly like our learner (:mod:`diloco.learner.worker`:
    same model init, AdamW, lr schedule, gradient clipping, per-learner data stream, ``--slow``
    emulation) under ``torchft.local_sgd.DiLoCo``: every ``sync_every`` inner steps (every
    ``sync_every / fragments`` with streaming fragments) the pseudo-gradients are all-reduced
    across the replica groups in the quorum and the outer optimizer (SGD, Nesterov when the
    momentum is > 0) steps.

Contract of a replica (what :mod:`diloco.peers.torchft_peer` relies on):

* after every fragment sync it appends one JSON line to ``D/progress.jsonl`` (``t``, inner
  ``step``, ``tokens``, ``outer_step`` = torchft's committed step, ``committed``,
  ``useful_tokens``, ``compute_s``, ``sync_s``, ``bytes_sent``, ``bytes_received``, ``loss``);
* it stops only at a fragment-sync boundary once the committed step reaches ``--rounds`` or the
  step written in ``D/../stop_step`` (so every replica stops after the same commit), or at
  the next inner step on SIGTERM / parent death;
* at exit it writes the global model (the last committed value of every fragment, i.e.
  torchft's backup copy) to ``D/final.safetensors`` and an ``{"event": "exit"}`` line;
* it never outlives ``--hard-deadline`` (epoch seconds) nor its parent by more than ~15 s.

``--slow F`` stretches the compute of each inner step (forward, backward, AdamW) to F times its
cost *before* the sync, so only compute is slowed, never the time spent waiting for peers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

STOP_FILE = "stop_step"


def lighthouse_main(args: argparse.Namespace) -> int:
    """Serve a torchft lighthouse until SIGTERM or parent death."""
    from torchft._torchft import LighthouseServer

    from diloco.launch.procs import exit_with_parent

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    exit_with_parent(stop)
    server = LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(server.address())
    os.replace(tmp, args.port_file)
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


def replica_main(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed import TCPStore

    from diloco.learner.worker import schedule_length
    from diloco.peers.netbytes import SocketBytes
    from diloco.recipes import get_recipe

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _watchdog(stop, args.hard_deadline)

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    recipe = get_recipe(args.recipe, data_path=args.data)
    lighthouse = _lighthouse_address(args, stop)
    model = recipe.build_model(args.seed)  # same init in every replica, as in our learners
    inner = recipe.build_optimizer(model)
    stream = recipe.stream(learner_id=args.index, seed=args.seed, batch_size=args.batch_size)
    fragments = split_fragments(model, args.fragments)
    outer = [
        torch.optim.SGD(
            f.parameters(),
            lr=args.outer_lr,
            momentum=args.outer_momentum,
            nesterov=args.outer_momentum > 0,  # torch refuses Nesterov without momentum
        )
        for f in fragments
    ]

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    # Each replica group hosts its own store (torchft's Manager connects to it as a client).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=_td(args.timeout_s)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        use_async_quorum=False,
        timeout=_td(args.timeout_s),
        quorum_timeout=_td(args.quorum_timeout_s),
        connect_timeout=_td(args.timeout_s),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{args.index}",
        init_sync=False,  # every replica builds the same initial model from the seed
    )

    timing = {"t0": 0.0, "compute_end": 0.0}

    def after_inner_step(*_args) -> None:
        # Registered before DiLoCo's own hook, so it runs after AdamW and before the sync.
        now = time.perf_counter()
        if args.slow > 1.0:
            time.sleep((args.slow - 1.0) * (now - timing["t0"]))
        timing["compute_end"] = time.perf_counter()

    hook = inner.register_step_post_hook(after_inner_step)
    steps_per_sync = args.sync_every // args.fragments
    netbytes = SocketBytes()
    progress = (workdir / "progress.jsonl").open("a")
    stop_file = workdir.parent / STOP_FILE
    steps = tokens = 0
    useful = 0.0
    marks = [0] * args.fragments  # tokens at the last sync of each fragment
    compute_s = sync_s = 0.0
    since_sync = 0
    failures = 0
    loss_value = float("nan")
    started = time.time()
    run_started = args.run_started or started
    try:
        with DiLoCo(
            manager,
            fragments,
            inner,
            outer,
            sync_every=args.sync_every,
            fragment_sync_delay=args.sync_delay,
        ) as diloco:
            while not stop.is_set():
                if since_sync == 0 and _should_stop(manager.current_step(), args, stop_file):
                    break
                length = schedule_length(_ScheduleArgs(args), steps, time.time() - run_started)
                for group in inner.param_groups:
                    group["lr"] = recipe.lr_at(steps, length)
                outer_before = manager.current_step()
                timing["t0"] = time.perf_counter()
                x, y = stream.next_batch()
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                inner.step()  # DiLoCo's hook syncs inside this call every steps_per_sync
                done = time.perf_counter()
                inner.zero_grad(set_to_none=True)
                compute_s += timing["compute_end"] - timing["t0"]
                sync_s += done - timing["compute_end"]
                steps += 1
                tokens += x.numel()
                since_sync += 1
                if since_sync < steps_per_sync:
                    continue
                since_sync = 0
                committed = manager.current_step() > outer_before
                frag = outer_before % args.fragments
                if committed:
                    useful += (tokens - marks[frag]) / args.fragments
                else:
                    failures += 1  # torchft restored this fragment: its local progress is lost
                marks[frag] = tokens
                loss_value = loss.item()
                sent, received = netbytes.sample()
                _write(
                    progress,
                    t=time.time(),
                    step=steps,
                    tokens=tokens,
                    outer_step=manager.current_step(),
                    committed=committed,
                    useful_tokens=useful,
                    compute_s=compute_s,
                    sync_s=sync_s,
                    bytes_sent=sent,
                    bytes_received=received,
                    loss=loss_value,
                )
            # The global model: the last committed value of every fragment (torchft's backup).
            diloco._restore_parameters()
        hook.remove()
        from safetensors.torch import save_file

        params = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
        save_file(params, str(workdir / "final.safetensors"))
        sent, received = netbytes.sample()
        _write(
            progress,
            event="exit",
            t=time.time(),
            step=steps,
            tokens=tokens,
            outer_step=manager.current_step(),
            useful_tokens=useful,
            compute_s=compute_s,
            sync_s=sync_s,
            train_s=time.time() - started,
            commit_failures=failures,
            bytes_sent=sent,
            bytes_received=received,
            loss=loss_value,
            stopped_by="signal" if stop.is_set() else "step",
        )
    finally:
        progress.close()
        manager.shutdown(wait=False)
    return 0


class _ScheduleArgs:
    """The fields :func:`diloco.learner.worker.schedule_length` reads, from our arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.schedule_steps = args.schedule_steps
        self.total_steps = 0
        self.schedule_seconds = args.schedule_seconds


def _lighthouse_address(args: argparse.Namespace, stop: threading.Event) -> str:
    """``--lighthouse``, or the address the lighthouse writes to ``--lighthouse-file`` (waited
    for, so that replicas start in parallel with the lighthouse, bounded by the deadline)."""
    if args.lighthouse:
        return args.lighthouse
    path = Path(args.lighthouse_file)
    while not stop.is_set():
        if path.exists():
            return path.read_text().strip()
        time.sleep(0.05)
    raise SystemExit("torchft replica: stopped before the lighthouse was up")


def _should_stop(outer_step: int, args: argparse.Namespace, stop_file: Path) -> bool:
    if args.rounds and outer_step >= args.rounds:
        return True
    try:
        target = int(stop_file.read_text())
    except (OSError, ValueError):
        return False
    return outer_step >= target


def _watchdog(stop: threading.Event, hard_deadline: float) -> None:
    """Exit hard at ``hard_deadline``, or 15 s after a stop request the loop did not honour
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
            if late or (hard_deadline and time.time() > hard_deadline):
                print("torchft replica: watchdog exit", file=sys.stderr, flush=True)
                os._exit(3)

    threading.Thread(target=watch, name="watchdog", daemon=True).start()


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _write(f, **record) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m diloco.peers.torchft_replica")
    sub = p.add_subparsers(dest="role", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--port-file", required=True)
    lh.add_argument("--bind", default="[::]:0")
    lh.add_argument("--min-replicas", type=int, required=True)
    lh.add_argument("--join-timeout-ms", type=int, default=60000)
    lh.add_argument("--quorum-tick-ms", type=int, default=100)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    lh.set_defaults(func=lighthouse_main)
    r = sub.add_parser("replica")
    r.add_argument("--index", type=int, required=True)
    where = r.add_mutually_exclusive_group(required=True)
    where.add_argument("--lighthouse", help="lighthouse address")
    where.add_argument("--lighthouse-file", help="file the lighthouse writes its address to")
    r.add_argument("--workdir", required=True)
    r.add_argument("--recipe", default="tiny")
    r.add_argument("--data")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=None)
    r.add_argument("--slow", type=float, default=1.0)
    r.add_argument("--sync-every", type=int, default=24)
    r.add_argument("--fragments", type=int, default=1)
    r.add_argument("--sync-delay", type=int, default=0)
    r.add_argument("--outer-lr", type=float, default=1.0)
    r.add_argument("--outer-momentum", type=float, default=0.0)
    r.add_argument("--rounds", type=int, default=0, help="stop at this committed step (0: none)")
    r.add_argument("--schedule-steps", type=int, default=0)
    r.add_argument("--schedule-seconds", type=float, default=0.0)
    r.add_argument("--run-started", type=float, default=0.0, help="epoch s (lr schedule clock)")
    r.add_argument("--min-replica-size", type=int, default=1)
    r.add_argument("--timeout-s", type=float, default=60.0)
    r.add_argument("--quorum-timeout-s", type=float, default=120.0)
    r.add_argument("--hard-deadline", type=float, default=0.0)
    r.add_argument("--threads", type=int, default=1)
    r.set_defaults(func=replica_main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

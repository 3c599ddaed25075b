"""``diloco learner``: one learner process training a recipe with the ``Learner`` library.

This is an ordinary training loop plus the ``Learner`` lines; the supervisor starts one
per learner. SIGTERM (a preemption notice) stops the loop at the next step boundary, flushes
every fragment's progress to the syncer and exits 0; so does reaching ``--deadline``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from diloco.cadence import AUTO, CheckpointCadence, parse_every
from diloco.checkpoint_writer import CheckpointWriter


def run(args: argparse.Namespace) -> int:
    import torch

    if not args.syncer and not args.no_sync:
        print("diloco learner: --syncer HOST:PORT is required (or --no-sync)", file=sys.stderr)
        return 2

    from diloco.learner.learner import Learner, LearnerConfig
    from diloco.learner.shards import parse_syncer_addresses
    from diloco.recipes import get_recipe

    if args.syncer and not args.no_sync:
        try:
            parse_syncer_addresses(args.syncer)
        except ValueError as exc:
            print(f"diloco learner: --syncer: {exc}", file=sys.stderr)
            return 2

    torch.set_num_threads(args.threads)
    rank, world = island_rank()
    if world > 1 and args.wait_for_merge >= 0:
        print("diloco learner: --wait-for-merge is not supported in an island", file=sys.stderr)
        return 2  # (0, 1) unless started by torchrun with several ranks
    recipe = get_recipe(args.recipe, data_path=args.data)
    model = recipe.build_model(args.seed)
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model)
    optimizer = recipe.build_optimizer(model)
    # Every rank of every island reads its own stream of the data.
    stream = recipe.stream(
        learner_id=args.index * world + rank, seed=args.seed, batch_size=args.batch_size
    )
    workdir = Path(args.workdir) if args.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    leader = rank == 0  # the rank that reports progress and writes the learner's files
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_with_parent:
        from diloco.launch.procs import exit_with_parent

        exit_with_parent(stop)

    from diloco.wire.auth import AuthConfigError, load_token

    try:
        token = None if args.no_sync else load_token(args.token_file)
    except AuthConfigError as exc:
        print(f"diloco learner: {exc}", file=sys.stderr)
        return 2
    config = LearnerConfig(
        fragments=args.fragments,
        sync_every=args.sync_every,
        rebase_own=not args.overwrite_own,
        learner_id=args.id,
        # what one step of this island holds: the syncer refuses claims above it
        tokens_per_step=(args.batch_size or recipe.batch_size) * recipe.model.seq_len * world,
        cpu_threads=args.threads,
        token=token,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        # beside the checkpoint: what was delivered after it is not sent again on restore
        delivery_file=str(workdir / DELIVERY_LOG)
        if workdir and leader and not args.no_sync
        else None,
    )
    link_options = {}
    if args.corrupt:
        from diloco.learner.corrupt import Corruptor

        end = args.corrupt_end if args.corrupt_end > 0 else float("inf")
        link_options["corruptor"] = Corruptor(args.corrupt, args.corrupt_start, end)
        print(f"learner {args.id}: chaos: corrupting uploads ({args.corrupt})", flush=True)
    name = CHECKPOINT if leader else f"checkpoint.rank{rank}.pt"
    checkpoint = workdir / name if workdir and not args.no_sync else None
    saved = load_checkpoint(checkpoint) if checkpoint else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        stream.load_state_dict(saved["stream"])
        if leader:
            step = saved["learner"]["local_step"]
            print(f"learner {args.id}: resumed from {checkpoint} at step {step}")
    if args.no_sync:
        learner = LocalOnly()
    elif world > 1:
        from diloco.learner.island import IslandLearner

        learner = IslandLearner(
            train_model,
            optimizer,
            syncer=args.syncer,
            config=config,
            state=saved["learner"] if saved and leader else None,
            link_options=link_options,
        )
    else:
        learner = Learner(
            model,
            optimizer,
            syncer=args.syncer,
            config=config,
            state=saved["learner"] if saved else None,
            link_options=link_options,
        )
    dropped = getattr(learner, "dropped_on_restore", [])  # (none without a syncer)
    if dropped:
        print(
            f"learner {args.id}: {len(dropped)} fragments' checkpointed progress was delivered "
            "after the checkpoint; not sending it again"
        )
    if not learner.wait_for_global(timeout=args.join_timeout):
        print(
            f"learner {args.id}: no global model from {args.syncer} within {args.join_timeout}s; training from the local init"
        )
    progress = (workdir / "progress.jsonl").open("a") if workdir and leader else None
    last_report = time.time()
    started = time.time()
    cadence = CheckpointCadence(every=args.checkpoint_every, start=started)
    writer = CheckpointWriter() if checkpoint else None
    run_started = args.run_started or started
    first_step = learner.local_step  # > 0 when resumed from a checkpoint
    busy_s = 0.0  # seconds computing steps in this incarnation (goodput's busy rate)
    jitter = random.Random(f"{args.seed}/{args.index}/{learner.local_step}")
    while not args.total_steps or learner.local_step < args.total_steps:
        step = learner.local_step
        now = time.time()
        length = schedule_length(args, step, now - run_started)
        # a save is due when the cadence says so and the previous one has reached the disk
        save = writer is not None and cadence.due(now) and not writer.busy
        should_stop = stop.is_set() or bool(args.deadline and now >= args.deadline)
        if world > 1:  # the ranks of an island agree on stopping, the lr and checkpoints
            should_stop, length, save = island_agree(should_stop, length, save, writer)
        if save and writer:  # the training thread pays the copy; a background thread writes it
            saving = time.perf_counter()
            writer.submit(checkpoint, checkpoint_state(model, optimizer, learner, stream))
            cadence.saved(time.time(), time.perf_counter() - saving)
        if should_stop:
            break
        waited = args.wait_for_merge < 0 or learner.wait_for_merges(
            args.wait_for_merge, args.merge_timeout, stop
        )
        if not waited and not stop.is_set():
            print(f"learner {args.id}: no merge within {args.merge_timeout}s; going on")
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step, length)
        t0 = time.perf_counter()
        x, y = stream.next_batch()
        _, loss = train_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # emulate slower (and uneven) hardware: stretch this step to `stretch` times its cost
        stretch = args.slow * (1.0 + args.jitter * jitter.uniform(-1.0, 1.0))
        if stretch > 1.0:
            time.sleep((stretch - 1.0) * (time.perf_counter() - t0))
        learner.step(tokens=x.numel())
        busy_s += time.perf_counter() - t0
        now = time.time()
        if progress and now - last_report >= args.report_every:
            last_report = now
            sps = (learner.local_step - first_step) / max(now - started, 1e-9)
            progress.write(
                json.dumps(
                    {
                        "t": now,
                        "step": learner.local_step,
                        "tokens": learner.total_tokens,
                        "loss": loss.item(),
                        "steps_per_s": sps,
                        "busy_s": round(busy_s, 4),
                        "bytes_up": learner.stats.get("bytes_up", 0),
                        "bytes_down": learner.stats.get("bytes_down", 0),
                    }
                )
                + "\n"
            )
            progress.flush()
    train_s = time.time() - started
    learner.close(flush=True)
    if writer:
        writer.save_now(checkpoint, checkpoint_state(model, optimizer, learner, stream))
    if workdir and not args.no_sync and leader:
        write_final_state(workdir, learner)
    if world > 1:
        if workdir:  # what every replica holds at exit, to check that they agree
            from safetensors.torch import save_file

            params = {n: t.detach().contiguous() for n, t in model.named_parameters()}
            save_file(params, str(workdir / f"replica.rank{rank}.safetensors"))
        import torch.distributed as dist

        dist.destroy_process_group()
    if progress:
        final = {"t": time.time(), "event": "exit", **learner.stats}
        final["steps_per_s"] = (learner.local_step - first_step) / max(train_s, 1e-9)
        progress.write(json.dumps(final) + "\n")
        progress.close()
    return 0


CHECKPOINT = "checkpoint.pt"
DELIVERY_LOG = "delivered.json"  # diloco.learner.delivery


def island_rank() -> tuple[int, int]:
    """``(rank, world size)``; under torchrun with several ranks, initializes the process
    group (gloo: the recipes train on CPU) so that this process is one rank of an island."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=rank == 0 and not agent_store,
            timeout=timedelta(minutes=5),
        )
        # torchrun's agent keeps one store across restarts: without a prefix per attempt a
        # restarted rank can read a dead rank's address left by the previous attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"diloco/attempt-{attempt}", store),
            rank=rank,
            world_size=world,
        )
    return dist.get_rank(), dist.get_world_size()


def island_agree(
    stop: bool, schedule_len: int, save: bool, writer: CheckpointWriter | None = None
) -> tuple[bool, int, bool]:
    """One collective per step, so that every rank does the same thing at the same step:
    stop if any rank was asked to; rank 0's lr schedule length and checkpoint decision,
    taken only when no rank is still writing its previous checkpoint (so every rank's file
    holds the same step)."""
    import torch
    import torch.distributed as dist

    leader = dist.get_rank() == 0
    writing = writer is not None and writer.busy
    mine = [int(stop), schedule_len if leader else 0, int(save and leader), int(writing)]
    flags = torch.tensor(mine, dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), int(flags[1]), bool(flags[2]) and not bool(flags[3])


def checkpoint_state(model, optimizer, learner, stream) -> dict:
    """This learner's own local checkpoint: model, inner optimizer, Learner state, data
    position (references to the live tensors: ``CheckpointWriter`` copies them)."""
    return {
        "format": 1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "learner": learner.state_dict(),
        "stream": stream.state_dict(),
    }


def load_checkpoint(path: Path) -> dict | None:
    """The checkpoint at ``path`` (``weights_only=True``), or None if there is none or it is
    unreadable (then the learner starts fresh from the global model, and says so)."""
    import torch

    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged checkpoint must not keep a learner down
        print(f"ignoring unreadable checkpoint {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(state, dict) or state.get("format") != 1:
        print(f"ignoring checkpoint {path}: unknown format", file=sys.stderr)
        return None
    return state


class LocalOnly:
    """Stands in for ``Learner`` with ``--no-sync``: counts steps, talks to nobody (baseline)."""

    def __init__(self) -> None:
        self.local_step = 0
        self.total_tokens = 0

    def wait_for_global(self, timeout: float) -> bool:
        return True

    def step(self, tokens: int) -> list[int]:
        self.local_step += 1
        self.total_tokens += tokens
        return []

    def close(self, flush: bool = True) -> None:
        pass

    @property
    def stats(self) -> dict:
        return {"step": self.local_step, "tokens": self.total_tokens}


def schedule_length(args: argparse.Namespace, step: int, elapsed: float) -> int:
    """Length of the lr schedule in steps: given, or estimated from a time budget.

    With ``--schedule-seconds`` the schedule ends when the time budget does: the length is
    re-estimated every step as ``step × budget / elapsed`` (0 = unknown, constant lr).
    """
    if args.schedule_steps or args.total_steps:
        return args.schedule_steps or args.total_steps
    if args.schedule_seconds and step > 0 and elapsed > 0:
        return max(step + 1, int(step * args.schedule_seconds / elapsed))
    return 0


def write_final_state(workdir: Path, learner) -> None:
    """Write what this learner holds at exit: its anchor (last global value received) and
    version per fragment, as ``final.safetensors`` + ``final.json`` (with the steps of each
    fragment that never reached the syncer: the unsent tail), for audits and tests."""
    from safetensors.torch import save_file

    anchors = {
        f"anchor.{p}": a.contiguous() for p, a in enumerate(learner.anchors) if a is not None
    }
    save_file(anchors, str(workdir / "final.safetensors"))
    (workdir / "final.json").write_text(
        json.dumps(
            {
                "versions": learner.versions,
                "unsent": learner.unsent(),
                "dropped": list(getattr(learner, "dropped", [])),
                **learner.stats,
            },
            indent=1,
        )
    )


def register(subparsers) -> None:
    p = subparsers.add_parser("learner", help="run one learner process")
    p.add_argument(
        "--syncer",
        help="syncer address HOST:PORT, or every shard's address comma-separated for a sharded "
        "syncer (HOST0:PORT0,HOST1:PORT1,...); required unless --no-sync",
    )
    p.add_argument(
        "--no-sync", action="store_true", help="train alone without a syncer (a baseline)"
    )
    p.add_argument("--id", required=True, help="learner id (keep it across restarts)")
    p.add_argument(
        "--index", type=int, default=0, help="learner index: selects this learner's data stream"
    )
    p.add_argument("--recipe", default="shakespeare")
    p.add_argument("--data", help="UTF-8 text file instead of Shakespeare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument(
        "--slow", type=float, default=1.0, help="emulated slowdown factor (3: each step takes 3x)"
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="each step takes up to +-this fraction more or less than --slow says (seeded)",
    )
    p.add_argument("--fragments", type=int, default=24)
    p.add_argument("--sync-every", type=int, default=24)
    p.add_argument(
        "--total-steps", type=int, default=0, help="stop after this many steps (0: until SIGTERM)"
    )
    p.add_argument(
        "--schedule-steps", type=int, default=0, help="length of the lr schedule (0: --total-steps)"
    )
    p.add_argument(
        "--schedule-seconds",
        type=float,
        default=0.0,
        help="fit the lr schedule to this time budget when the step count is unknown",
    )
    p.add_argument(
        "--run-started",
        type=float,
        default=0.0,
        help="epoch seconds the run started (schedule-seconds counts from it; default: now)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="epoch seconds: stop (cleanly, as on SIGTERM) at the first step boundary after it "
        "(0: none); for launchers whose signals may not reach the learner",
    )
    p.add_argument(
        "--checkpoint-every",
        type=parse_every,
        default=AUTO,
        help="seconds between local checkpoints in --workdir (0: only at exit), or 'auto' "
        "(default: as often as keeps saving under 1%% of the time, 1-300 s; diloco.cadence)",
    )
    p.add_argument(
        "--wait-for-merge",
        type=int,
        default=-1,
        metavar="LAG",
        help="synchronous DiLoCo: before each step, wait until every fragment sent LAG or "
        "more steps ago came back merged (-1: never wait, the decoupled default)",
    )
    p.add_argument(
        "--merge-timeout",
        type=float,
        default=120.0,
        help="with --wait-for-merge: the longest wait before training on regardless",
    )
    p.add_argument(
        "--overwrite-own",
        action="store_true",
        help="apply a merge that holds this learner's delta by the paper's overwrite, dropping "
        "the steps trained while the delta was in flight (default: keep them)",
    )
    p.add_argument("--workdir", help="directory for progress and checkpoints")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--report-every", type=float, default=1.0, help="seconds between progress lines")
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop (cleanly) if the parent process dies"
    )
    from diloco.chaos import CORRUPT_HOWS
    from diloco.syncer.cli import add_security_arguments

    add_security_arguments(p, server=False)
    p.add_argument(
        "--corrupt",
        choices=CORRUPT_HOWS,
        help="chaos: damage every uploaded delta (emulated silent data corruption)",
    )
    p.add_argument(
        "--corrupt-start", type=float, default=0.0, help="epoch seconds the corruption starts"
    )
    p.add_argument(
        "--corrupt-end", type=float, default=0.0, help="epoch seconds it ends (0: never)"
    )
    p.set_defaults(func=run)

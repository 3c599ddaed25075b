"""``diloco learner``: one learner process training a recipe with the ``Learner`` library.

This is an ordinary training loop plus the ``Learner`` lines; the supervisor starts one
per learner. SIGTERM (a preemption notice) stops the loop at the next step boundary, flushes
every fragment's progress to the syncer and exits 0; so does reaching ``--deadline``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from diloco.config.worker import WorkerConfig
from diloco.runtime.cadence import CheckpointCadence
from diloco.runtime.checkpoint_writer import CheckpointWriter


def run(config: WorkerConfig) -> int:
    """Train until the budget, SIGTERM or the deadline; returns the exit status."""
    import torch

    if not config.syncer and not config.no_sync:
        print("diloco learner: --syncer HOST:PORT is required (or --no-sync)", file=sys.stderr)
        return 2

    from diloco.learner.learner import Learner, LearnerConfig
    from diloco.learner.shards import parse_syncer_addresses
    from diloco.recipes import get_recipe

    if config.syncer and not config.no_sync:
        try:
            parse_syncer_addresses(config.syncer)
        except ValueError as exc:
            print(f"diloco learner: --syncer: {exc}", file=sys.stderr)
            return 2

    torch.set_num_threads(config.threads)
    rank, world = island_rank()
    if world > 1 and config.wait_for_merge >= 0:
        print("diloco learner: --wait-for-merge is not supported in an island", file=sys.stderr)
        return 2  # (0, 1) unless started by torchrun with several ranks
    recipe = get_recipe(config.recipe.recipe, data_path=config.recipe.data)
    model = recipe.build_model(config.recipe.seed)
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model)
    optimizer = recipe.build_optimizer(model)
    # Every rank of every island reads its own stream of the data.
    stream = recipe.stream(
        learner_id=config.index * world + rank,
        seed=config.recipe.seed,
        batch_size=config.batch_size,
    )
    workdir = Path(config.workdir) if config.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    leader = rank == 0  # the rank that reports progress and writes the learner's files
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if config.exit_with_parent:
        from diloco.runtime.procs import exit_with_parent

        exit_with_parent(stop)

    from diloco.wire.auth import AuthConfigError, load_token

    try:
        token = None if config.no_sync else load_token(config.security.token_file)
    except AuthConfigError as exc:
        print(f"diloco learner: {exc}", file=sys.stderr)
        return 2
    learner_config = LearnerConfig(
        fragments=config.protocol.fragments,
        sync_every=config.protocol.sync_every,
        rebase_own=not config.overwrite_own,
        learner_id=config.id,
        # what one step of this island holds: the syncer refuses claims above it
        tokens_per_step=(config.batch_size or recipe.batch_size) * recipe.model.seq_len * world,
        cpu_threads=config.threads,
        token=token,
        tls_ca=config.security.tls_ca,
        tls_cert=config.security.tls_cert,
        tls_key=config.security.tls_key,
        # beside the checkpoint: what was delivered after it is not sent again on restore
        delivery_file=str(workdir / DELIVERY_LOG)
        if workdir and leader and not config.no_sync
        else None,
    )
    link_options = {}
    if config.corrupt:
        from diloco.learner.corrupt import Corruptor

        end = config.corrupt_end if config.corrupt_end > 0 else float("inf")
        link_options["corruptor"] = Corruptor(config.corrupt, config.corrupt_start, end)
        print(f"learner {config.id}: chaos: corrupting uploads ({config.corrupt})", flush=True)
    name = CHECKPOINT if leader else f"checkpoint.rank{rank}.pt"
    checkpoint = workdir / name if workdir and not config.no_sync else None
    saved = load_checkpoint(checkpoint) if checkpoint else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        stream.load_state_dict(saved["stream"])
        if leader:
            step = saved["learner"]["local_step"]
            print(f"learner {config.id}: resumed from {checkpoint} at step {step}")
    if config.no_sync:
        learner = LocalOnly()
    elif world > 1:
        from diloco.learner.island import IslandLearner

        learner = IslandLearner(
            train_model,
            optimizer,
            syncer=config.syncer,
            config=learner_config,
            state=saved["learner"] if saved and leader else None,
            link_options=link_options,
        )
    else:
        learner = Learner(
            model,
            optimizer,
            syncer=config.syncer,
            config=learner_config,
            state=saved["learner"] if saved else None,
            link_options=link_options,
        )
    dropped = getattr(learner, "dropped_on_restore", [])  # (none without a syncer)
    if dropped:
        print(
            f"learner {config.id}: {len(dropped)} fragments' checkpointed progress was delivered "
            "after the checkpoint; not sending it again"
        )
    if not learner.wait_for_global(timeout=config.join_timeout):
        print(
            f"learner {config.id}: no global model from {config.syncer} within {config.join_timeout}s; training from the local init"
        )
    progress = (workdir / "progress.jsonl").open("a") if workdir and leader else None
    last_report = time.time()
    started = time.time()
    cadence = CheckpointCadence(every=config.checkpoint_every, start=started)
    writer = CheckpointWriter() if checkpoint else None
    run_started = config.run_started or started
    first_step = learner.local_step  # > 0 when resumed from a checkpoint
    busy_s = 0.0  # seconds computing steps in this incarnation (goodput's busy rate)
    jitter = random.Random(f"{config.recipe.seed}/{config.index}/{learner.local_step}")
    while not config.total_steps or learner.local_step < config.total_steps:
        step = learner.local_step
        now = time.time()
        length = schedule_length(config, step, now - run_started)
        # a save is due when the cadence says so and the previous one has reached the disk
        save = writer is not None and cadence.due(now) and not writer.busy
        should_stop = stop.is_set() or bool(config.deadline and now >= config.deadline)
        if world > 1:  # the ranks of an island agree on stopping, the lr and checkpoints
            should_stop, length, save = island_agree(should_stop, length, save, writer)
        if save and writer:  # the training thread pays the copy; a background thread writes it
            saving = time.perf_counter()
            writer.submit(checkpoint, checkpoint_state(model, optimizer, learner, stream))
            cadence.saved(time.time(), time.perf_counter() - saving)
        if should_stop:
            break
        waited = config.wait_for_merge < 0 or learner.wait_for_merges(
            config.wait_for_merge, config.merge_timeout, stop
        )
        if not waited and not stop.is_set():
            print(f"learner {config.id}: no merge within {config.merge_timeout}s; going on")
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
        stretch = config.slow * (1.0 + config.jitter * jitter.uniform(-1.0, 1.0))
        if stretch > 1.0:
            time.sleep((stretch - 1.0) * (time.perf_counter() - t0))
        learner.step(tokens=x.numel())
        busy_s += time.perf_counter() - t0
        now = time.time()
        if progress and now - last_report >= config.report_every:
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
    if workdir and not config.no_sync and leader:
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


def schedule_length(config, step: int, elapsed: float) -> int:
    """Length of the lr schedule in steps: given, or estimated from a time budget.

    With ``--schedule-seconds`` the schedule ends when the time budget does: the length is
    re-estimated every step as ``step × budget / elapsed`` (0 = unknown, constant lr).
    """
    if config.schedule_steps or config.total_steps:
        return config.schedule_steps or config.total_steps
    if config.schedule_seconds and step > 0 and elapsed > 0:
        return max(step + 1, int(step * config.schedule_seconds / elapsed))
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

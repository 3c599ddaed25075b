"""``diloco learner``: one learner process training a recipe with the ``Learner`` library.

This is an ordinary training loop plus the ``Learner`` lines; the supervisor starts one
per learner. SIGTERM (a preemption notice) stops the loop at the next step boundary, flushes
every fragment's progress to the syncer and exits 0; so does reaching ``--deadline``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from diloco.config.worker import WorkerConfig
from diloco.learner.workdir import (  # noqa: F401 (this worker's files, named there)
    CHECKPOINT,
    DELIVERY_LOG,
    GENERATION_FILE,
    UPLOAD_JOURNAL,
    load_checkpoint,
    write_final_state,
)
from diloco.runtime.cadence import CheckpointCadence
from diloco.runtime.checkpoint_writer import CheckpointWriter
from diloco.runtime.training import (
    ClipCounter,
    ProgressLog,
    SlowHardware,
    inner_step,
    schedule_length,
    set_lr,
    stop_on_signals,
)


class CheckpointMismatch(ValueError):
    """The local checkpoint cannot be loaded into this learner (saved with another inner
    optimizer); the worker says so in one line and exits 2."""


def run(config: WorkerConfig) -> int:
    """Train until the budget, SIGTERM or the deadline; returns the exit status (2: bad input,
    said on stderr)."""
    import torch

    from diloco.recipes import recipe_of

    problem = check(config)
    if problem:
        print(f"diloco learner: {problem}", file=sys.stderr)
        return 2
    device, problem = training_device(config.device.device)
    if problem:
        print(f"diloco learner: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    rank, world = island_rank("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1 and config.wait_for_merge >= 0:  # (0, 1) unless torchrun started several
        print("diloco learner: --wait-for-merge is not supported in an island", file=sys.stderr)
        return 2
    if world > 1 and config.island == "fsdp" and config.recipe.inner_optimizer == "muon":
        print(
            "diloco learner: --inner-optimizer muon is not supported with --island fsdp "
            "(Muon orthogonalises whole matrices, FSDP holds row shards); use --island ddp",
            file=sys.stderr,
        )
        return 2
    recipe = recipe_of(config.recipe)
    model = recipe.build_model(config.recipe.seed).to(device)
    if world > 1 and config.island == "fsdp":
        from diloco.runtime.sharding import shard_model

        shard_model(model)  # before the optimizer exists: it must hold the shards
    try:
        optimizer = recipe.build_optimizer(model)
    except ValueError as exc:  # e.g. Muon for a model without hidden matrices
        print(f"diloco learner: {exc}", file=sys.stderr)
        return 2
    # Every rank of every island reads its own stream of the data.
    stream = recipe.stream(
        learner_id=config.index * world + rank,
        seed=config.recipe.seed,
        batch_size=config.batch_size,
    )
    workdir = Path(config.workdir) if config.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    stop = stop_on_signals(exit_with_parent=config.exit_with_parent)
    from diloco.learner.waiting import SyncerUnreachable
    from diloco.wire.auth import AuthConfigError

    try:
        proc = LearnerProcess(config, recipe, model, optimizer, stream, workdir, rank, world)
    except (AuthConfigError, CheckpointMismatch) as exc:
        print(f"diloco learner: {exc}", file=sys.stderr)
        return 2
    try:
        proc.train(stop)
    except SyncerUnreachable as exc:  # it would train alone: one line, exit non-zero
        print(f"diloco learner {config.id}: {exc}", file=sys.stderr)
        proc.learner.close(flush=False)
        return 1
    except RuntimeError as exc:
        link = getattr(getattr(proc.learner, "leader", None) or proc.learner, "link", None)
        if getattr(link, "error", None) is None:  # (an island's ranks, --no-sync: no link)
            raise
        # the syncer cannot be trained with (refused join, wrong shards, over --comms):
        # one line, nothing to flush to it, exit non-zero
        print(f"diloco learner {config.id}: {exc}", file=sys.stderr)
        proc.learner.close(flush=False)
        return 1
    proc.finish()
    if world > 1:  # every file is closed; a rank's teardown can abort (see exit_now)
        from diloco.runtime.exit import exit_now

        exit_now(0)
    return 0


def training_device(name: str):
    """``(torch.device, None)`` for ``--device NAME``, or ``(None, problem)``."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        return None, "--device cuda: this machine has no CUDA device torch can use"
    return torch.device(name), None


def check(config: WorkerConfig) -> str | None:
    """What is wrong with the syncer address, if anything (None: nothing)."""
    from diloco.learner.shards import parse_syncer_addresses

    if config.no_sync:
        return None
    if not config.syncer:
        return "--syncer HOST:PORT is required (or --no-sync)"
    try:
        parse_syncer_addresses(config.syncer)
    except ValueError as exc:
        return f"--syncer: {exc}"
    return None


class LearnerProcess:
    """One learner process: the model, its ``Learner`` (or ``LocalOnly``), its checkpoint and
    progress file; ``train`` is the training loop, ``finish`` what happens at exit."""

    def __init__(self, config, recipe, model, optimizer, stream, workdir, rank, world) -> None:
        self.config, self.recipe, self.model = config, recipe, model
        self.optimizer, self.stream, self.workdir = optimizer, stream, workdir
        self.rank, self.world = rank, world
        self.device = next(model.parameters()).device
        self.leader = rank == 0  # the rank that reports progress and writes the learner's files
        self.train_model = model
        self.sharded = world > 1 and config.island == "fsdp"  # (sharded by run())
        if world > 1 and not self.sharded:
            from torch.nn.parallel import DistributedDataParallel

            self.train_model = DistributedDataParallel(model)
        name = CHECKPOINT if self.leader else f"checkpoint.rank{rank}.pt"
        self.checkpoint = workdir / name if workdir and not config.no_sync else None
        saved = self.restore()
        self.restored = saved is not None
        """Whether this process resumed from its checkpoint (it reached the syncer before)."""
        self.learner = self.make_learner(saved)
        dropped = getattr(self.learner, "dropped_on_restore", [])  # (none without a syncer)
        if dropped:
            print(
                f"learner {config.id}: {len(dropped)} fragments' checkpointed progress was "
                "delivered after the checkpoint; not sending it again"
            )

    def skip_delivered_steps(self) -> None:
        """A previous life that trained and delivered steps past its checkpoint (killed
        before the next one): draw those steps' batches and drop them, so their data does
        not reach the global model twice (``Learner.skip``). One process only: the ranks of
        an island would have to agree on the skip (not done: an island trains them again)."""
        ahead = getattr(self.learner, "ahead_on_restore", 0)
        if not ahead or self.world > 1:
            return
        tokens = sum(self.recipe.tokens(self.stream.next_batch()) for _ in range(ahead))
        self.learner.skip(ahead, tokens)
        print(
            f"learner {self.config.id}: its previous life delivered steps past the checkpoint: "
            f"skipping {ahead} steps to step {self.learner.local_step}"
        )

    def restore(self) -> dict | None:
        """Load the local checkpoint into the model, optimizer and stream, if there is one."""
        saved = load_checkpoint(self.checkpoint) if self.checkpoint else None
        if saved is not None and self.sharded:  # this rank's own shards
            from diloco.runtime.sharding import load_local_model_state, load_local_optimizer_state

            load_local_model_state(self.model, saved["model"])
            load_local_optimizer_state(self.optimizer, saved["optimizer"])
        elif saved is not None:
            self.model.load_state_dict(saved["model"])
            try:
                self.optimizer.load_state_dict(saved["optimizer"])
            except (KeyError, ValueError) as exc:
                raise CheckpointMismatch(
                    f"{self.checkpoint}: its optimizer state does not fit this learner's "
                    f"--inner-optimizer {self.config.recipe.inner_optimizer} ({exc}); use the "
                    "optimizer it was saved with, or remove the checkpoint to start afresh"
                ) from None
        if saved is not None:
            self.stream.load_state_dict(saved["stream"])
            if self.leader:
                step = saved["learner"]["local_step"]
                print(f"learner {self.config.id}: resumed from {self.checkpoint} at step {step}")
        return saved

    def learner_config(self):
        """The ``Learner`` library's configuration for this process."""
        from diloco.learner.config import LearnerConfig
        from diloco.wire.auth import load_token

        config, recipe, workdir = self.config, self.recipe, self.workdir
        return LearnerConfig(
            num_fragments=config.protocol.num_fragments,
            comms=config.protocol.comms,
            rebase_own=not config.overwrite_own,
            max_stretch=config.max_stretch,
            flush_timeout_s=config.flush_timeout_s,
            drain_timeout_s=config.drain_timeout_s,
            learner_id=config.id,
            # what one step of this island holds: the syncer refuses claims above it
            tokens_per_step=(config.batch_size or recipe.batch_size)
            * recipe.tokens_per_sample
            * self.world,
            cpu_threads=config.threads,
            malloc_arenas=1,  # this process is ours: keep the link's freed buffers shared
            token=load_token(config.security.token_file),
            tls_ca=config.security.tls_ca,
            tls_cert=config.security.tls_cert,
            tls_key=config.security.tls_key,
            # beside the checkpoint: what was delivered after it is not sent again on restore
            delivery_file=str(workdir / DELIVERY_LOG) if workdir and self.leader else None,
            journal_file=str(workdir / UPLOAD_JOURNAL) if workdir and self.leader else None,
            generation_file=str(workdir / GENERATION_FILE) if workdir and self.leader else None,
        )

    def make_learner(self, saved: dict | None):
        config = self.config
        if config.no_sync:
            return LocalOnly()
        link_options = {}
        if config.corrupt:
            from diloco.learner.corrupt import CorruptingEncoder, Corruptor

            end = config.corrupt_end if config.corrupt_end > 0 else float("inf")
            corruptor = Corruptor(config.corrupt, config.corrupt_start, end)
            link_options["encoder"] = CorruptingEncoder(corruptor)
            print(f"learner {config.id}: chaos: corrupting uploads ({config.corrupt})", flush=True)
        if self.world > 1:
            from diloco.learner.island import IslandLearner

            return IslandLearner(
                self.train_model,
                self.optimizer,
                syncer=config.syncer,
                config=self.learner_config(),
                state=saved["learner"] if saved and self.leader else None,
                link_options=link_options,
            )
        from diloco.learner.learner import Learner

        return Learner(
            self.model,
            self.optimizer,
            syncer=config.syncer,
            config=self.learner_config(),
            state=saved["learner"] if saved else None,
            link_options=link_options,
        )

    def train(self, stop) -> None:
        """The training loop: until the step budget, ``stop`` or the deadline."""
        config, learner = self.config, self.learner
        joined = self.join()
        self.skip_delivered_steps()  # after the join: the syncer's commits say what was
        if not joined:
            print(
                f"learner {config.id}: no global model from {config.syncer} within "
                f"{config.join_timeout_s}s; training on from "
                f"{'its checkpoint' if self.restored else 'the local init'}",
                file=sys.stderr,
            )
        progress = self.workdir / "progress.jsonl" if self.workdir and self.leader else None
        self.log = ProgressLog(
            progress,
            config.report_every_s,
            first_step=learner.local_step,
            echo=f"learner {config.id}" if self.leader else None,
        )
        if self.leader:
            print(
                f"learner {config.id}: training from step {learner.local_step} "
                f"(syncer {config.syncer}, batch {config.batch_size or self.recipe.batch_size}, "
                f"{sum(p.numel() for p in self.model.parameters()):,} parameters, on "
                f"{self.device.type}{', bf16 autocast' if config.device.bf16 else ''})",
                flush=True,
            )
        started = self.log.started
        cadence = CheckpointCadence(every=config.checkpoint_every_s, start=started)
        self.writer = CheckpointWriter() if self.checkpoint else None
        run_started_epoch_s = config.run_started_epoch_s or started
        self.busy_s = 0.0  # seconds computing steps in this incarnation (goodput's busy rate)
        self.clipped = ClipCounter()  # steps of this incarnation whose gradient was clipped
        seed = f"{config.recipe.seed}/{config.index}/{learner.local_step}"
        slow = SlowHardware(config.slow, config.jitter, seed)
        while not config.total_steps or learner.local_step < config.total_steps:
            step, now = learner.local_step, time.time()
            length = schedule_length(config, step, now - run_started_epoch_s)
            # a save is due when the cadence says so and the previous one has reached the disk
            save = self.writer is not None and cadence.due(now) and not self.writer.busy
            should_stop = stop.is_set() or bool(
                config.deadline_epoch_s and now >= config.deadline_epoch_s
            )
            if self.world > 1:  # the ranks of an island agree on stopping, lr and checkpoints
                should_stop, length, save = island_agree(should_stop, length, save, self.writer)
            if save:  # the training thread pays the copy; a background thread writes it
                saving = time.perf_counter()
                self.writer.submit(self.checkpoint, self.state())
                cadence.saved(time.time(), time.perf_counter() - saving)
            if should_stop:
                break
            self.wait_for_merges(stop)
            set_lr(self.optimizer, self.recipe.lr_at(step, length))
            t0 = time.perf_counter()
            batch = on_device(self.stream.next_batch(), self.device)
            loss = inner_step(
                self.train_model,
                self.optimizer,
                batch,
                params=self.model.parameters(),
                loss_fn=self.recipe.loss,
                clipped=self.clipped,
                bf16=self.config.device.bf16,
            )
            slow.stretch(t0)
            learner.step(tokens=self.recipe.tokens(batch))
            self.busy_s += time.perf_counter() - t0
            stats = learner.stats
            self.log.step(
                learner.local_step,
                tokens=learner.total_tokens,
                loss=loss,
                busy_s=round(self.busy_s, 4),
                bytes_up=stats.get("bytes_up", 0),
                bytes_down=stats.get("bytes_down", 0),
                deferred=stats.get("deferred", 0),
                down_lag=stats.get("down_lag", 0),
                clipped=lambda: self.clipped.count,
            )
        self.train_s = time.time() - started

    def join(self) -> bool:
        """Wait for the global model; whether it came within ``--join-timeout``. A fresh
        learner that never reached its syncer raises ``SyncerUnreachable`` (it would train
        alone from its own initialization; ``--no-sync`` is how to ask for that); one that
        joined while the model was still arriving, or resumed from its checkpoint (it was with
        the syncer before, which may be restarting), trains on and takes the model later."""
        from diloco.learner.waiting import SyncerUnreachable

        try:
            return self.learner.wait_for_global(timeout=self.config.join_timeout_s)
        except SyncerUnreachable:
            if not self.restored:
                raise
            return False
        except TimeoutError:
            return False

    def wait_for_merges(self, stop) -> None:
        """Synchronous mode: wait for the merges of the fragments sent LAG steps ago."""
        config = self.config
        if config.wait_for_merge < 0:
            return
        waited = self.learner.wait_for_merges(config.wait_for_merge, config.merge_timeout_s, stop)
        if not waited and not stop.is_set():
            print(
                f"learner {config.id}: no merge within {config.merge_timeout_s}s; going on",
                file=sys.stderr,
            )

    def state(self) -> dict:
        state = checkpoint_state(self.model, self.optimizer, self.learner, self.stream)
        if self.sharded:  # each rank's own shards, as plain tensors
            from diloco.runtime.sharding import local_state

            state["model"] = local_state(state["model"])
            state["optimizer"] = local_state(state["optimizer"])
        return state

    def finish(self) -> None:
        """Flush the progress to the syncer, save the last checkpoint and the final state."""
        learner, workdir = self.learner, self.workdir
        learner.close(flush=True)
        if self.writer:
            self.writer.save_now(self.checkpoint, self.state())
        if workdir and not self.config.no_sync and self.leader:
            write_final_state(workdir, learner)
        if self.world > 1:
            if workdir:  # what every replica holds at exit, to check that they agree
                from safetensors.torch import save_file

                params = {n: t.detach() for n, t in self.model.named_parameters()}
                if self.sharded:  # (a collective: every rank gathers the whole model)
                    params = {n: t.full_tensor() for n, t in params.items()}
                params = {n: t.contiguous() for n, t in params.items()}
                save_file(params, str(workdir / f"replica.rank{self.rank}.safetensors"))
                mirror = getattr(self.learner, "mirror", None)
                if mirror is not None:  # rank 0's Learner's view: it must equal the shards
                    save_file(mirror.tensors, str(workdir / "mirror.safetensors"))
            import torch.distributed as dist

            dist.destroy_process_group()
        steps = learner.local_step - self.log.first_step
        self.log.exit(
            **learner.stats,
            clipped=self.clipped.count,
            steps_per_s=steps / max(self.train_s, 1e-9),
        )


def on_device(batch, device):
    """A recipe's batch (a tuple of tensors) on the training device."""
    if device.type == "cpu":
        return batch
    return tuple(t.to(device, non_blocking=True) for t in batch)


def island_rank(backend: str = "gloo") -> tuple[int, int]:
    """``(rank, world size)``; under torchrun with several ranks, initializes the process
    group (``backend``: gloo on CPU, NCCL on GPUs) so that this process is one rank of an
    island."""
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
            backend,
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


class LocalOnly:
    """Stands in for ``Learner`` with ``--no-sync``: counts steps, talks to nobody (baseline)."""

    def __init__(self) -> None:
        self.local_step = 0
        self.total_tokens = 0

    def wait_for_global(self, timeout: float, *, required: bool = True) -> bool:
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

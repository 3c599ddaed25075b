"""``diloco dp-worker``: one rank of the data-parallel baseline (``diloco run --mode dp``).

Every step, each rank computes the gradient of its own batch and the ranks all-reduce
(gloo, one collective per step) the token-weighted sum of their gradients together with
control values: how many tokens the step trained, whether any rank was asked to stop, rank
0's decisions (lr schedule length, checkpoint now) and how many ranks have finished writing
their part of the checkpoint in progress. So every rank applies the same averaged gradient
with the same lr and stops or checkpoints at the same step. Each rank copies its part at that
step and a background thread writes it (:mod:`diloco.runtime.checkpoint_writer`); once every rank's
part is on disk, rank 0 commits the checkpoint, and only then may the next one start. The
group is static: if a rank dies the others fail too, and the supervisor restarts the whole
group from the last committed checkpoint (:mod:`diloco.baselines.dp.checkpoint`), as ``torchrun``
does.

Rendezvous: the supervisor hosts a ``TCPStore``; the ranks of generation G meet under the
prefix ``generation-G``, so a restarted group never reads a dead group's keys.

Files (``--workdir``, one per rank): ``progress.jsonl`` like a DiLoCo learner's (``start`` and
``exit`` records around each incarnation; ``tokens`` is this rank's share of the surviving
steps, so it goes back after a restart). Rank 0 also keeps ``--snapshot`` (the current
parameters, safetensors, for the evaluator) fresh every ``--snapshot-every`` seconds.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from diloco.config.dp_worker import DpWorkerConfig
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


def ring_bytes_per_step(num_params: int, world: int) -> int:
    """Bytes one rank sends per step in a ring all-reduce of fp32 gradients (it receives as
    many, but those are the same bytes seen from the other end: counted once, at the sender).
    Gloo may pick another algorithm; this is the standard bandwidth-optimal count."""
    return 0 if world <= 1 else 2 * (world - 1) * 4 * num_params // world


def run(config: DpWorkerConfig) -> int:
    """Train this rank until the budget or SIGTERM; returns the exit status."""
    import torch

    from diloco.baselines.dp import checkpoint as ckpt
    from diloco.recipes import recipe_of

    torch.set_num_threads(config.threads)
    if not 0 <= config.rank < config.world:
        print(f"diloco dp-worker: --rank must be in [0, {config.world})", file=sys.stderr)
        return 2
    stop = stop_on_signals(exit_with_parent=config.exit_with_parent)
    recipe = recipe_of(config.recipe)
    model = recipe.build_model(config.recipe.seed)
    try:
        optimizer = recipe.build_optimizer(model)
    except ValueError as exc:  # e.g. Muon for a model without hidden matrices
        print(f"diloco dp-worker: {exc}", file=sys.stderr)
        return 2
    stream = recipe.stream(
        learner_id=config.rank, seed=config.recipe.seed, batch_size=config.batch_size
    )
    rank = Rank(config, recipe, model, optimizer, stream)
    try:
        rank.restore(ckpt.latest_step(rank.ckdir, config.world))
    except ValueError as exc:
        print(f"diloco dp-worker: {exc}", file=sys.stderr)
        return 2
    rank.join_group()
    rank.train(stop)
    rank.finish()
    return 0


class Rank:
    """One rank of the group: its model, checkpoint parts, all-reduce and progress file."""

    def __init__(self, config: DpWorkerConfig, recipe, model, optimizer, stream) -> None:
        self.config, self.recipe, self.model = config, recipe, model
        self.optimizer, self.stream = optimizer, stream
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.leader = config.rank == 0
        self.ckdir = Path(config.checkpoint_dir)
        self.step, self.tokens, self.group_tokens = 0, 0, 0
        self.reduce_s = 0.0  # seconds this incarnation spent in the all-reduce itself

    def restore(self, saved: tuple[int, int] | None) -> None:
        """Continue from the group's last committed checkpoint ``(step, world)``, if any. A
        rank the checkpoint's group did not have (the group grew) takes rank 0's model and
        optimizer and starts its own data stream from the beginning."""
        from diloco.baselines.dp import checkpoint as ckpt

        if saved is None:
            return
        saved_step, written_by = saved
        config = self.config
        shared = ckpt.read_rank_state(self.ckdir, saved_step, 0)
        self.model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.step, self.group_tokens = saved_step, shared["group_tokens"]
        if config.rank < written_by:
            mine = (
                shared if self.leader else ckpt.read_rank_state(self.ckdir, saved_step, config.rank)
            )
            self.stream.load_state_dict(mine["stream"])
            self.tokens = mine["tokens"]

    def join_group(self) -> None:
        """Rendezvous with the other ranks of this generation (gloo)."""
        import torch.distributed as dist

        config = self.config
        host, port = config.store.rsplit(":", 1)
        store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=config.rendezvous_timeout_s)
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"generation-{config.generation}", store),
            rank=config.rank,
            world_size=config.world,
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
        workdir = Path(config.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = ProgressLog(
            workdir / "progress.jsonl",
            config.report_every_s,
            first_step=self.step,
            at_once=True,
            echo=f"rank {config.rank}",
        )
        self.log.write(
            {
                "event": "start",
                "step": self.step,
                "tokens": self.tokens,
                "generation": config.generation,
            }
        )
        print(
            f"dp rank {config.rank}/{config.world}: generation {config.generation} "
            f"from step {self.step}"
        )

    def train(self, stop) -> None:
        """The training loop: every step all-reduces the gradients and a few control values
        (tokens, stop, rank 0's lr schedule and checkpoint decisions)."""
        config = self.config
        num_params = sum(p.numel() for p in self.params)
        self.per_step_bytes = ring_bytes_per_step(num_params, config.world)
        run_started_epoch_s = config.run_started_epoch_s or self.log.started
        cadence = CheckpointCadence(every=config.checkpoint_every_s, start=self.log.started)
        self.writer = CheckpointWriter()
        self.pending: int | None = None  # the step of the checkpoint being written
        self.ckdir.mkdir(parents=True, exist_ok=True)
        last_snapshot, busy_s = 0.0, 0.0  # busy: seconds in steps (all-reduce included)
        self.clipped = ClipCounter()  # steps of this incarnation whose gradient was clipped
        slow = SlowHardware(config.slow)
        while not config.total_steps or self.step < config.total_steps:
            now = time.time()
            self.length = schedule_length(config, self.step, now - run_started_epoch_s)
            # rank 0 decides (the all-reduce tells the others), once the previous is committed
            self.save = self.leader and self.pending is None and cadence.due(now)
            t0 = time.perf_counter()
            batch = self.stream.next_batch()
            n = self.recipe.tokens(batch)

            def reduce(tokens: int, t0: float = t0) -> None:
                slow.stretch(t0)  # emulated slower hardware: the whole group waits for it
                self.all_reduce(tokens, stop)

            loss = inner_step(
                self.model,
                self.optimizer,
                batch,
                params=self.params,
                reduce=reduce,
                loss_fn=self.recipe.loss,
                tokens=n,
                clipped=self.clipped,
            )
            self.step, self.tokens = self.step + 1, self.tokens + n
            busy_s += time.perf_counter() - t0
            now = time.time()
            if self.save:  # this rank pays the copy of its part; the writer thread writes it
                saving = time.perf_counter()
                self.write_part()
                cadence.saved(time.time(), time.perf_counter() - saving)
            if self.leader and config.snapshot and now - last_snapshot >= config.snapshot_every:
                last_snapshot = now
                write_snapshot(Path(config.snapshot), self.model, self.step, self.group_tokens)
            self.log.step(
                self.step,
                tokens=self.tokens,
                loss=loss,
                busy_s=round(busy_s, 4),
                reduce_s=round(self.reduce_s, 4),
                clipped=lambda: self.clipped.count,
                bytes_up=(self.step - self.log.first_step) * self.per_step_bytes,
                bytes_down=0,  # every byte on the wire is counted once, by its sender
            )
            if self.stopping:
                break

    def all_reduce(self, n: int, stop) -> None:
        """Average the gradients over the group (weighted by tokens) and agree on the control
        values; commit a checkpoint every part of which is on disk. Sets the lr."""
        import torch
        import torch.distributed as dist

        from diloco.baselines.dp import checkpoint as ckpt

        world, writer, pending = self.config.world, self.writer, self.pending
        written = pending is not None and not writer.busy  # my part is on disk (or failed)
        control = [n, float(stop.is_set()), self.length if self.leader else 0, float(self.save)]
        control += [float(written), float(written and bool(writer.last_ok))]
        control = torch.tensor(control, dtype=torch.float32)
        flat = torch.cat([p.grad.reshape(-1) * n for p in self.params] + [control])
        reducing = time.perf_counter()
        dist.all_reduce(flat)
        self.reduce_s += time.perf_counter() - reducing
        total, stopping, length, save, done, ok = flat[-len(control) :].tolist()
        if pending is not None and done == world:
            if self.leader and ok == world:
                ckpt.commit(self.ckdir, pending, world)
            self.pending = None  # committed, or a part failed and the previous one stays
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / total)
            offset += p.numel()
        set_lr(self.optimizer, self.recipe.lr_at(self.step, int(length)))
        self.stopping, self.save = bool(stopping), bool(save)
        self.group_tokens += int(total)

    def part(self) -> dict:
        """This rank's part of the group checkpoint of the current step (references to the
        live tensors; rank 0's part holds the model and the optimizer)."""
        from diloco.baselines.dp import checkpoint as ckpt

        state = {"stream": self.stream.state_dict(), "tokens": self.tokens}
        if self.leader:
            state |= {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "group_tokens": self.group_tokens,
            }
        return ckpt.rank_part(self.step, state)

    def write_part(self) -> None:
        """Hand this rank's part to the background writer (committed once all are on disk)."""
        from diloco.baselines.dp import checkpoint as ckpt

        self.writer.submit(ckpt.rank_file(self.ckdir, self.step, self.config.rank), self.part())
        self.pending = self.step

    def save_group_checkpoint(self) -> None:
        """Every rank writes its part now, then (after a barrier) rank 0 commits it."""
        import torch.distributed as dist

        from diloco.baselines.dp import checkpoint as ckpt

        ckpt.write_rank_part(self.ckdir, self.step, self.config.rank, self.part())
        if dist.is_initialized():
            dist.barrier()
        if self.leader:
            ckpt.commit(self.ckdir, self.step, self.config.world)

    def finish(self) -> None:
        """The final checkpoint (it supersedes the one in progress), snapshot and exit record."""
        import torch.distributed as dist

        config = self.config
        self.writer.wait()
        self.save_group_checkpoint()
        if self.leader and config.snapshot:
            write_snapshot(Path(config.snapshot), self.model, self.step, self.group_tokens)
        dist.destroy_process_group()
        steps = self.step - self.log.first_step
        self.log.exit(
            step=self.step,
            tokens=self.tokens,
            steps_per_s=steps / max(time.time() - self.log.started, 1e-9),
            bytes_up=steps * self.per_step_bytes,
            bytes_down=0,
            clipped=self.clipped.count,
        )


def write_snapshot(path: Path, model, step: int, group_tokens: int) -> None:
    """The current parameters for the evaluator (atomic; metadata: step and tokens)."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().contiguous() for n, t in model.named_parameters()}
    path.parent.mkdir(parents=True, exist_ok=True)  # may come before the first checkpoint
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"step": str(step), "tokens": str(group_tokens)})
    os.replace(tmp, path)

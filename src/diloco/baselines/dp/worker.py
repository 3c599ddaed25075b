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

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from diloco.config.dp_worker import DpWorkerConfig
from diloco.runtime.cadence import CheckpointCadence
from diloco.runtime.checkpoint_writer import CheckpointWriter


def ring_bytes_per_step(num_params: int, world: int) -> int:
    """Bytes one rank sends per step in a ring all-reduce of fp32 gradients (it receives as
    many, but those are the same bytes seen from the other end: counted once, at the sender).
    Gloo may pick another algorithm; this is the standard bandwidth-optimal count."""
    return 0 if world <= 1 else 2 * (world - 1) * 4 * num_params // world


def run(config: DpWorkerConfig) -> int:
    """Train this rank until the budget or SIGTERM; returns the exit status."""
    import torch
    import torch.distributed as dist

    from diloco.baselines.dp import checkpoint as ckpt
    from diloco.learner.worker import schedule_length
    from diloco.recipes import get_recipe

    torch.set_num_threads(config.threads)
    if not 0 <= config.rank < config.world:
        print(f"diloco dp-worker: --rank must be in [0, {config.world})", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if config.exit_with_parent:
        from diloco.runtime.procs import exit_with_parent

        exit_with_parent(stop)

    recipe = get_recipe(config.recipe.recipe, data_path=config.recipe.data)
    model = recipe.build_model(config.recipe.seed)
    optimizer = recipe.build_optimizer(model)
    stream = recipe.stream(
        learner_id=config.rank, seed=config.recipe.seed, batch_size=config.batch_size
    )
    params = [p for p in model.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    leader = config.rank == 0
    ckdir = Path(config.checkpoint_dir)
    step, tokens, group_tokens = 0, 0, 0
    try:
        saved_step = ckpt.latest_step(ckdir, config.world)
    except ValueError as exc:
        print(f"diloco dp-worker: {exc}", file=sys.stderr)
        return 2
    if saved_step is not None:
        mine = ckpt.read_rank_state(ckdir, saved_step, config.rank)
        shared = mine if leader else ckpt.read_rank_state(ckdir, saved_step, 0)
        model.load_state_dict(shared["model"])
        optimizer.load_state_dict(shared["optimizer"])
        stream.load_state_dict(mine["stream"])
        step, tokens, group_tokens = saved_step, mine["tokens"], shared["group_tokens"]

    host, port = config.store.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=config.rendezvous_timeout)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"generation-{config.generation}", store),
        rank=config.rank,
        world_size=config.world,
        timeout=timedelta(seconds=config.collective_timeout),
    )
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    progress = (workdir / "progress.jsonl").open("a")

    def report(**fields) -> None:
        progress.write(json.dumps({"t": time.time(), **fields}) + "\n")
        progress.flush()

    report(event="start", step=step, tokens=tokens, generation=config.generation)
    print(f"dp rank {config.rank}/{config.world}: generation {config.generation} from step {step}")
    per_step_bytes = ring_bytes_per_step(num_params, config.world)
    first_step, started = step, time.time()
    run_started = config.run_started or started
    last_report = last_snapshot = 0.0
    cadence = CheckpointCadence(every=config.checkpoint_every, start=started)
    writer = CheckpointWriter()
    pending: int | None = None  # the step of the checkpoint being written, not yet committed
    ckdir.mkdir(parents=True, exist_ok=True)
    loss_value = float("nan")
    busy_s = 0.0  # seconds in steps (the all-reduce included) in this incarnation
    while not config.total_steps or step < config.total_steps:
        now = time.time()
        length = schedule_length(config, step, now - run_started)
        # rank 0 decides (the all-reduce tells the others), once the previous one is committed
        save = leader and pending is None and cadence.due(now)
        t0 = time.perf_counter()
        x, y = stream.next_batch()
        _, loss = model(x, y)
        loss.backward()
        if config.slow > 1.0:  # emulate slower hardware: the whole group waits for this rank
            time.sleep((config.slow - 1.0) * (time.perf_counter() - t0))
        n = x.numel()
        written = pending is not None and not writer.busy  # my part is on disk (or failed)
        control = torch.tensor(
            [
                n,
                float(stop.is_set()),
                length if leader else 0,
                float(save),
                float(written),
                float(written and bool(writer.last_ok)),
            ],
            dtype=torch.float32,
        )
        flat = torch.cat([p.grad.reshape(-1) * n for p in params] + [control])
        dist.all_reduce(flat)
        total, stopping, length, save, done, ok = flat[-len(control) :].tolist()
        if pending is not None and done == config.world:
            if leader and ok == config.world:
                ckpt.commit(ckdir, pending, config.world)
            pending = None  # committed, or a part failed and the previous checkpoint stays
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / total)
            offset += p.numel()
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step, int(length))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens, group_tokens = step + 1, tokens + n, group_tokens + int(total)
        loss_value = loss.item()
        busy_s += time.perf_counter() - t0
        now = time.time()
        if save:  # this rank pays the copy of its part; the writer thread writes it
            saving = time.perf_counter()
            part = rank_part(config, step, model, optimizer, stream, tokens, group_tokens)
            writer.submit(ckpt.rank_file(ckdir, step, config.rank), part)
            pending = step
            cadence.saved(time.time(), time.perf_counter() - saving)
        if leader and config.snapshot and now - last_snapshot >= config.snapshot_every:
            last_snapshot = now
            write_snapshot(Path(config.snapshot), model, step, group_tokens)
        if now - last_report >= config.report_every:
            last_report = now
            sent = (step - first_step) * per_step_bytes
            sps = (step - first_step) / max(now - started, 1e-9)
            report(
                step=step,
                tokens=tokens,
                loss=loss_value,
                steps_per_s=sps,
                busy_s=round(busy_s, 4),
                bytes_up=sent,
                bytes_down=0,  # every byte on the wire is counted once, by its sender
            )
        if stopping:
            break
    writer.wait()  # the final checkpoint supersedes the one in progress
    save_group_checkpoint(ckdir, config, step, model, optimizer, stream, tokens, group_tokens)
    if leader and config.snapshot:
        write_snapshot(Path(config.snapshot), model, step, group_tokens)
    dist.destroy_process_group()
    sent = (step - first_step) * per_step_bytes
    report(
        event="exit",
        step=step,
        tokens=tokens,
        steps_per_s=(step - first_step) / max(time.time() - started, 1e-9),
        bytes_up=sent,
        bytes_down=0,
    )
    progress.close()
    return 0


def rank_part(config, step, model, optimizer, stream, tokens, group_tokens) -> dict:
    """This rank's part of the group checkpoint of ``step`` (references to live tensors)."""
    from diloco.baselines.dp import checkpoint as ckpt

    state = {"stream": stream.state_dict(), "tokens": tokens}
    if config.rank == 0:
        state |= {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "group_tokens": group_tokens,
        }
    return ckpt.rank_part(step, state)


def save_group_checkpoint(ckdir, config, step, model, optimizer, stream, tokens, group_tokens):
    """Every rank writes its part now, then (after a barrier) rank 0 commits the checkpoint."""
    import torch.distributed as dist

    from diloco.baselines.dp import checkpoint as ckpt

    part = rank_part(config, step, model, optimizer, stream, tokens, group_tokens)
    ckpt.write_rank_part(ckdir, step, config.rank, part)
    if dist.is_initialized():
        dist.barrier()
    if config.rank == 0:
        ckpt.commit(ckdir, step, config.world)


def write_snapshot(path: Path, model, step: int, group_tokens: int) -> None:
    """The current parameters for the evaluator (atomic; metadata: step and tokens)."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().contiguous() for n, t in model.named_parameters()}
    path.parent.mkdir(parents=True, exist_ok=True)  # may come before the first checkpoint
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"step": str(step), "tokens": str(group_tokens)})
    os.replace(tmp, path)

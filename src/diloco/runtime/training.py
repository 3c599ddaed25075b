"""The training-loop skeleton shared by the learner process, the data-parallel rank and the
torchft replica: stopping on signals, the lr schedule, one inner step, emulated slow hardware
and the progress file. Each of them adds only what makes it different (the ``Learner`` lines,
the all-reduce, torchft's DiLoCo)."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def stop_on_signals(*, exit_with_parent: bool = False) -> threading.Event:
    """An event set by SIGTERM or SIGINT (a preemption notice: stop at the next step
    boundary) and, with ``exit_with_parent``, when the parent process dies."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if exit_with_parent:
        from diloco.runtime.procs import exit_with_parent as watch_parent

        watch_parent(stop)
    return stop


def schedule_length(config, step: int, elapsed: float) -> int:
    """Length of the lr schedule in steps: given, or estimated from a time budget.

    ``config`` has ``schedule_steps``, ``total_steps`` and ``schedule_seconds``. With
    ``schedule_seconds`` the schedule ends when the time budget does: the length is
    re-estimated every step as ``step × budget / elapsed`` (0 = unknown, constant lr).
    """
    if config.schedule_steps or config.total_steps:
        return config.schedule_steps or config.total_steps
    if config.schedule_seconds and step > 0 and elapsed > 0:
        return max(step + 1, int(step * config.schedule_seconds / elapsed))
    return 0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def inner_step(
    model,
    optimizer: torch.optim.Optimizer,
    batch,
    *,
    params=None,
    reduce: Callable[[int], None] | None = None,
    loss_fn: Callable | None = None,
    tokens: int | None = None,
    clipped: ClipCounter | None = None,
    bf16: bool = False,
) -> float:
    """One inner step on ``batch``: forward and loss (``loss_fn(model, batch)``, a recipe's
    ``loss``; default ``model(x, y)[1]``), backward, ``reduce(tokens)`` (the data-parallel
    all-reduce of the gradients, if any; ``tokens`` default: ``batch[0].numel()``), clip the
    gradient norm to 1, AdamW, zero the gradients. ``model`` may be a wrapper (DDP) of the
    module whose ``params`` are clipped (default: ``model.parameters()``); ``clipped`` counts
    the steps whose gradient norm was above the clip; ``bf16`` runs the forward pass and the
    loss under bf16 autocast on the batch's device. Returns the loss."""
    with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(model, batch) if loss_fn is not None else model(*batch)[1]
    loss.backward()
    if reduce is not None:
        reduce(tokens if tokens is not None else batch[0].numel())
    norm = torch.nn.utils.clip_grad_norm_(
        params if params is not None else model.parameters(), CLIP_NORM
    )
    if clipped is not None:
        clipped.add(norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


CLIP_NORM = 1.0
"""The inner steps' gradient-norm clip."""


class ClipCounter:
    """How many steps had their gradient clipped (norm above ``CLIP_NORM``). Counted on the
    gradient's device; read (one host transfer) only when :attr:`count` is asked for."""

    def __init__(self) -> None:
        self._count = None

    def add(self, norm: torch.Tensor) -> None:
        if hasattr(norm, "full_tensor"):  # a sharded model's norm (a replicated DTensor)
            norm = norm.full_tensor()
        hit = (norm > CLIP_NORM).to(torch.int64)
        self._count = hit if self._count is None else self._count + hit

    @property
    def count(self) -> int:
        return 0 if self._count is None else int(self._count)


class SlowHardware:
    """Emulated slower (and uneven) hardware: a step stretched to ``slow × (1 ± jitter)``
    times what it cost, the jitter drawn from a generator seeded by ``seed``."""

    def __init__(self, slow: float = 1.0, jitter: float = 0.0, seed: str = "") -> None:
        self.slow, self.jitter = slow, jitter
        self.rng = random.Random(seed)

    def stretch(self, started: float) -> None:
        """Sleep so that the step begun at ``started`` (``time.perf_counter``) takes its
        stretched time."""
        factor = self.slow
        if self.jitter:
            factor *= 1.0 + self.jitter * self.rng.uniform(-1.0, 1.0)
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - started))


ECHO_EVERY_S = 30.0
"""Seconds between the human progress lines a process prints to its log."""


class ProgressLog:
    """``progress.jsonl``: a record at most every ``every_s`` seconds and one at exit, each
    with ``t`` (epoch seconds) and ``steps_per_s`` over this incarnation (since
    ``first_step``). ``path=None`` writes nothing (a rank that does not report). The first
    record comes after the first step (``at_once``) or ``every_s`` after the start.

    With ``echo`` (a name, e.g. ``learner site-a``) it also prints a human line to stdout
    (the process's log) with the first record, then at most every ``ECHO_EVERY_S`` seconds,
    and at exit."""

    def __init__(
        self,
        path: Path | None,
        every_s: float,
        *,
        first_step: int = 0,
        at_once: bool = False,
        echo: str | None = None,
    ) -> None:
        self.file = path.open("a") if path is not None else None
        self.every_s = every_s
        self.first_step = first_step
        self.started = time.time()
        self.last = 0.0 if at_once else self.started
        self.echo = echo
        self._echoed = float("-inf")

    def rate(self, step: int, now: float) -> float:
        return (step - self.first_step) / max(now - self.started, 1e-9)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"t": time.time(), **record}) + "\n")
            self.file.flush()

    def step(self, step: int, **fields) -> None:
        """A progress record if one is due (``fields``: tokens, loss, bytes, ...; a callable
        is called only then, for values that cost something to read)."""
        now = time.time()
        if self.file is not None and now - self.last >= self.every_s:
            self.last = now
            fields = {k: v() if callable(v) else v for k, v in fields.items()}
            record = {"step": step, **fields, "steps_per_s": self.rate(step, now)}
            self.write(record)
            if self.echo and now - self._echoed >= ECHO_EVERY_S:
                self._echoed = now
                print(f"{self.echo}: {progress_line(record)}", flush=True)

    def exit(self, **fields) -> None:
        """The exit record (``event: exit`` and ``fields``), and close the file."""
        if self.echo:
            print(f"{self.echo}: stopped; {progress_line(fields)}", flush=True)
        if self.file is not None:
            self.write({"event": "exit", **fields})
            self.file.close()
            self.file = None


def progress_line(record: dict) -> str:
    """A progress record for people: step, tokens, loss, speed, bytes (what it has).

    >>> progress_line({"step": 40, "tokens": 40960, "loss": 2.5, "steps_per_s": 8.0})
    'step 40, 40,960 tokens, loss 2.500, 8.00 steps/s'
    """
    parts = []
    if "step" in record:
        parts.append(f"step {record['step']}")
    if "tokens" in record:
        parts.append(f"{record['tokens']:,} tokens")
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.3f}")
    if record.get("steps_per_s") is not None:
        parts.append(f"{record['steps_per_s']:.2f} steps/s")
    if record.get("bytes_up") or record.get("bytes_down"):
        parts.append(
            f"sent {record.get('bytes_up', 0) / 1e6:.1f} MB, "
            f"received {record.get('bytes_down', 0) / 1e6:.1f} MB"
        )
    if record.get("merged") is not None:
        parts.append(f"{record['merged']} merges applied")
    return ", ".join(parts)

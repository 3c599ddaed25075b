"""A fleet in one process: a real syncer on loopback and learners (threads) training a small
regression at a steady pace, for the tests that count where every trained step went
(``test_accounting``, ``test_pacing``)."""

from __future__ import annotations

import threading
import time

import torch
from kit import local_syncer, tiny_model, wait_until
from torch import nn

from diloco.learner.learner import Learner
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.wire.protocol import ProtocolConfig

P = 4
"""Fragments of the fleet's model."""
STEPS = 200
"""Steps each learner trains."""


def make_model(seed: int) -> nn.Module:
    return tiny_model(seed, (64, 256, 1))


def train(learner: Learner, model: nn.Module, seed: int, pace: float = 0.015) -> None:
    """``STEPS`` steps of a small regression, ``pace`` seconds of sleep after each: a steady
    pace for the syncer's clock."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        x = torch.randn(8, 64, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=8)
        time.sleep(pace)


def merged_steps(rounds: list[dict], learner: str, fragment: int) -> int:
    """Steps of ``learner`` that the tape's round records of ``fragment`` merged."""
    return sum(
        steps
        for r in rounds
        if r["fragment"] == fragment
        for who, steps in zip(r["participants"], r["steps"], strict=True)
        if who == learner
    )


def start_syncer(tmp_path, interceptors=(), **cfg) -> SyncerServer:
    """An in-process syncer of ``make_model(0)`` on the syncer's clock, tape in ``tmp_path``
    (``cfg``: ``SyncerConfig`` fields; ``interceptors``: the gRPC server's)."""
    base = {"protocol": ProtocolConfig(sync_every=4), "lease_s": 5.0, "heartbeat_s": 0.2}
    config = SyncerConfig(**{**base, **cfg})
    return local_syncer(
        make_model(0),
        config,
        num_fragments=P,
        tape_path=tmp_path / "events.jsonl",
        interceptors=list(interceptors),
    )


def start_training(
    addresses: list[str], pace: float = 0.015, prepare=None, **options
) -> tuple[list[Learner], list[threading.Thread]]:
    """One learner per address (``prepare(learner)`` first, if given; ``options``: more
    ``LearnerConfig`` fields), joined, each training ``STEPS`` steps on its own thread."""
    models = [make_model(10 + i) for i in range(len(addresses))]
    learners = [
        Learner(m, syncer=a, num_fragments=P, learner_id=f"l{i}", tokens_per_step=8, **options)
        for i, (m, a) in enumerate(zip(models, addresses, strict=True))
    ]
    for lr in learners:
        if prepare is not None:
            prepare(lr)
        assert lr.wait_for_global(timeout=20)
    threads = [
        threading.Thread(target=train, args=(lr, m, i, pace))
        for i, (lr, m) in enumerate(zip(learners, models, strict=True))
    ]
    for t in threads:
        t.start()
    return learners, threads


def finish_training(server: SyncerServer, learners, threads, timeout: float = 60) -> None:
    """Wait for the training threads (each bounded by ``timeout``), close every learner
    (flushing its progress), then wait until the syncer holds no open contribution."""
    for t in threads:
        t.join(timeout=timeout)
    for lr in learners:
        lr.close(flush=True)
    wait_until(
        lambda: not any(r.contributions for r in server.state.rounds.values()),
        20,
        "the rounds to settle",
    )

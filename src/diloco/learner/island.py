"""``IslandLearner``: a learner that is a whole ``torch.distributed`` group (a torchrun job).

Inside an island the ranks train one model with data parallelism (DDP, NCCL or gloo); to the
syncer the island is one learner. Rank 0 holds the real :class:`~diloco.learner.Learner` and
its link; at every step boundary it tells the other ranks which fragments it has just applied
and broadcasts their new values, so every rank applies the same fragment at the same step and
the replicas stay identical::

    dist.init_process_group("gloo")                      # torchrun set the environment
    ddp = DistributedDataParallel(model)
    learner = diloco.IslandLearner(ddp, optimizer, syncer="10.0.0.5:7000", learner_id="site-a")
    learner.wait_for_global()
    for batch in data:
        loss = ddp(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=batch.numel())               # tokens of this rank
    learner.close()

Every method is a collective: all ranks of the group call it, in the same order. An island
whose rank dies is torn down and restarted by torchrun (``--max-restarts``); rank 0 rejoins the
syncer with the same learner id and, with its checkpoint, resumes where it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from diloco.algorithm.fragments import balanced_fragments
from diloco.learner.config import LearnerConfig
from diloco.learner.learner import Learner


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names the syncer knows (DDP's ``module.`` prefix removed)."""
    return getattr(model, "module", model)


class IslandLearner:
    """One learner for the syncer, made of every rank of ``group`` (default: the world).

    ``tokens`` passed to :meth:`step` are this rank's; the island reports the sum over ranks.
    Only rank 0 talks to the syncer; ``state_dict`` and ``stats`` are rank 0's (empty
    elsewhere).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        syncer: str | Sequence[str],
        group: dist.ProcessGroup | None = None,
        config: LearnerConfig | None = None,
        state: dict | None = None,
        link_options: dict | None = None,
        **overrides,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "IslandLearner needs torch.distributed initialized: launch with torchrun and "
                "call torch.distributed.init_process_group() first (or use diloco.Learner)"
            )
        module = _unwrap(model)
        cfg = config or LearnerConfig(**overrides)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self.params = dict(module.named_parameters())
        # NCCL broadcasts device tensors; gloo (CPU) broadcasts CPU tensors.
        first = next(iter(self.params.values()))
        self._device = first.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.layout = balanced_fragments(module.named_parameters(), cfg.fragments)
        self.leader: Learner | None = None
        if self.rank == 0:
            self.leader = Learner(
                module,
                optimizer,
                syncer=syncer,
                config=cfg,
                layout=self.layout,
                state=state,
                link_options=link_options,
            )
        self.local_step = self.leader.local_step if self.leader else 0
        self.local_step = int(self._broadcast_ints([self.local_step])[0])

    @property
    def dropped_on_restore(self) -> list[int]:
        """Rank 0's: fragments whose checkpointed progress was delivered already."""
        return self.leader.dropped_on_restore if self.leader else []

    # ----------------------------------------------------------------- collectives
    def wait_for_global(self, timeout: float = 60.0) -> bool:
        """Rank 0 waits for the global model (see ``Learner.wait_for_global``), then every rank
        takes rank 0's parameters. Returns rank 0's answer on every rank."""
        ok = self.leader.wait_for_global(timeout) if self.leader else False
        self._share(list(range(self.layout.num_fragments)))
        return bool(self._broadcast_ints([int(ok)])[0])

    def step(self, tokens: int) -> list[int]:
        """Record one inner step on every rank; returns the fragments rank 0 queued."""
        self.local_step += 1
        due: list[int] = []
        if self.leader:
            due = self.leader.step(tokens=tokens * self.world)
        self._share(self.leader.last_applied if self.leader else [])
        return due

    def close(self, *, flush: bool = True) -> None:
        """Rank 0 flushes and leaves the syncer; then every rank takes its final parameters."""
        if self.leader:
            self.leader.close(flush=flush)
        self._share(list(range(self.layout.num_fragments)))

    # ----------------------------------------------------------------- rank 0's view
    @property
    def total_tokens(self) -> int:
        return self.leader.total_tokens if self.leader else 0

    @property
    def stats(self) -> dict:
        return self.leader.stats if self.leader else {}

    @property
    def versions(self) -> list[int]:
        return self.leader.versions if self.leader else []

    @property
    def anchors(self) -> list:
        return self.leader.anchors if self.leader else []

    @property
    def dropped(self) -> list[int]:
        return self.leader.dropped if self.leader else []

    def unsent(self) -> list[int]:
        return self.leader.unsent() if self.leader else []

    def state_dict(self) -> dict:
        return self.leader.state_dict() if self.leader else {}

    # ----------------------------------------------------------------- internals
    def _broadcast_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        dist.broadcast(t, src=self._root, group=self.group)
        return t.cpu().tolist()

    def _share(self, fragments: list[int]) -> None:
        """Broadcast rank 0's values of ``fragments`` (which only rank 0 knows) to every rank."""
        P = self.layout.num_fragments
        wanted = set(fragments)
        marks = [int(p in wanted) for p in range(P)]
        chosen = [p for p, m in enumerate(self._broadcast_ints(marks)) if m]
        if not chosen:
            return
        sizes = [self.layout.fragments[p].numel for p in chosen]
        with torch.no_grad():
            if self.leader:
                flat = torch.cat([self.layout.gather(p, self.params) for p in chosen])
                flat = flat.to(self._device)
            else:
                flat = torch.empty(sum(sizes), dtype=torch.float32, device=self._device)
            dist.broadcast(flat, src=self._root, group=self.group)
            if not self.leader:
                for p, part in zip(chosen, flat.cpu().split(sizes), strict=True):
                    self.layout.scatter(p, part, self.params)

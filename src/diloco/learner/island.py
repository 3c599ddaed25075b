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

**Sharded islands** (FSDP2, ``torch.distributed.fsdp.fully_shard``: the parameters are
``DTensor`` shards and no rank holds the whole model) work the same way. Rank 0's Learner then
keeps a *mirror* of the full parameters (fp32, on the host): whenever it is about to read or
change fragments (to send their progress, to apply a new global value) it tells the other
ranks, and every rank all-gathers those fragments' parameters into the mirror; after the step
every rank writes the new values of the fragments that changed into its own shards. The mirror
costs rank 0 one host copy of the model, and an island one all-gather of about a fragment per
step (P = H), on top of what FSDP itself moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from diloco.algorithm.fragments import FragmentLayout, balanced_fragments
from diloco.learner.config import LearnerConfig
from diloco.learner.learner import Learner
from diloco.learner.waiting import SyncerUnreachable, no_global_model


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names the syncer knows (DDP's ``module.`` prefix removed)."""
    return getattr(model, "module", model)


def is_sharded(params: dict[str, torch.Tensor]) -> bool:
    """Whether the parameters are FSDP2 shards (``DTensor``) rather than whole replicas."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in params.values())


class Mirror:
    """The full parameters of a sharded model as ordinary host tensors (rank 0's Learner
    trains "on" them: it reads and writes fragments here, the island keeps them in step with
    the shards). Looks like a module to the Learner: ``named_parameters()``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())


_DONE, _REFRESH = 0, 1  # rank 0's commands to the other ranks during a Learner call
_JOINED, _INCOMPLETE, _UNREACHED = 1, 0, -1  # how rank 0's wait for the global model ended


def _global_outcome(leader: Learner, timeout: float) -> int:
    """How ``leader.wait_for_global(timeout)`` ended, as one of the three codes above."""
    try:
        leader.wait_for_global(timeout)
    except SyncerUnreachable:
        return _UNREACHED
    except TimeoutError:
        return _INCOMPLETE
    return _JOINED


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
        self.syncer = syncer if isinstance(syncer, str) else ",".join(syncer)
        """The syncer's address (every shard's, comma-separated), as given."""
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self.params = dict(module.named_parameters())
        # NCCL broadcasts device tensors; gloo (CPU) broadcasts CPU tensors.
        first = next(iter(self.params.values()))
        self._device = first.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.layout = balanced_fragments(module.named_parameters(), cfg.num_fragments)
        self.sharded = is_sharded(self.params)
        self.mirror: Mirror | None = None
        if self.sharded:
            full = self._gather_full(range(self.layout.num_fragments))
            self.mirror = Mirror(full) if self.rank == 0 else None
        self.leader: Learner | None = None
        if self.rank == 0:
            self.leader = Learner(
                self.mirror or module,
                optimizer,
                syncer=syncer,
                config=cfg,
                layout=self.layout,
                state=state,
                link_options=link_options,
            )
            if self.sharded:
                self.leader.before_touch = self._refresh
        self.local_step = self.leader.local_step if self.leader else 0
        self.local_step = int(self._broadcast_ints([self.local_step])[0])

    @property
    def dropped_on_restore(self) -> list[int]:
        """Rank 0's: fragments whose checkpointed progress was delivered already."""
        return self.leader.dropped_on_restore if self.leader else []

    # ----------------------------------------------------------------- collectives
    def wait_for_global(self, timeout: float = 60.0, *, required: bool = True) -> bool:
        """Rank 0 waits for the global model (see ``Learner.wait_for_global``), then every rank
        takes rank 0's parameters. Returns rank 0's answer on every rank (with ``required``,
        every rank raises rank 0's ``TimeoutError`` instead of returning False:
        ``SyncerUnreachable`` if rank 0 never joined the syncer)."""
        outcome = self._leading(lambda leader: _global_outcome(leader, timeout), _JOINED)
        self._share(list(range(self.layout.num_fragments)))
        outcome = int(self._broadcast_ints([outcome])[0])
        if required and outcome != _JOINED:
            raise no_global_model(self.syncer, timeout, reached=outcome == _INCOMPLETE)
        return outcome == _JOINED

    def step(self, tokens: int) -> list[int]:
        """Record one inner step on every rank; returns the fragments rank 0 queued."""
        self.local_step += 1
        due = self._leading(lambda leader: leader.step(tokens=tokens * self.world), [])
        self._share(self.leader.last_applied if self.leader else [])
        return due

    def close(self, *, flush: bool = True) -> None:
        """Rank 0 flushes and leaves the syncer; then every rank takes its final parameters."""
        self._leading(lambda leader: leader.close(flush=flush), None)
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
    def _leading(self, call, default):
        """Rank 0 runs ``call(leader)``; in a sharded island the other ranks meanwhile serve
        its refresh commands (``_refresh``) until it says it is done. Returns rank 0's result
        (``default`` elsewhere)."""
        if self.leader is None:
            if self.sharded:
                self._serve_refreshes()
            return default
        if not self.sharded:
            return call(self.leader)
        try:
            return call(self.leader)
        finally:
            self._command(_DONE, [])

    def _refresh(self, fragments) -> None:
        """Rank 0's Learner is about to read or change ``fragments``: bring its mirror of them
        up to date (every rank takes part in the all-gathers)."""
        chosen = sorted(set(fragments))
        if chosen:
            self._command(_REFRESH, chosen)
            self._gather_full(chosen)

    def _command(self, command: int, fragments: list[int]) -> list[int]:
        marks = [0] * self.layout.num_fragments
        for p in fragments:
            marks[p] = 1
        got = self._broadcast_ints([command, *marks])
        return [got[0]] + [p for p, m in enumerate(got[1:]) if m]

    def _serve_refreshes(self) -> None:
        """The other ranks' side of ``_refresh``: all-gather what rank 0 names until done."""
        while True:
            command, *fragments = self._command(_DONE, [])
            if command == _DONE:
                return
            self._gather_full(fragments)

    def _gather_full(self, fragments) -> dict[str, torch.Tensor]:
        """All-gather the whole parameters holding ``fragments`` (a collective); rank 0 copies
        them into its mirror. Returns them as fp32 host tensors."""
        full = {}
        for name in _names_of(self.layout, fragments):
            value = self.params[name].detach().full_tensor().to("cpu", torch.float32)
            full[name] = value
            if self.mirror is not None:
                self.mirror.tensors[name].copy_(value)
        return full

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
                source = self.mirror.tensors if self.mirror is not None else self.params
                flat = torch.cat([self.layout.gather(p, source) for p in chosen])
                flat = flat.to(self._device)
            else:
                flat = torch.empty(sum(sizes), dtype=torch.float32, device=self._device)
            dist.broadcast(flat, src=self._root, group=self.group)
            parts = dict(zip(chosen, flat.cpu().split(sizes), strict=True))
            if self.sharded:
                self._write_shards(parts)
            elif not self.leader:
                for p, part in parts.items():
                    self.layout.scatter(p, part, self.params)

    def _write_shards(self, parts: dict[int, torch.Tensor]) -> None:
        """Every rank writes the new values of the fragments in ``parts`` into its shards: the
        whole parameters are gathered, the fragments' rows replaced, and each rank keeps its
        own slice (``distribute_tensor`` on local data: no data is sent)."""
        from torch.distributed.tensor import distribute_tensor

        full = self._gather_full(parts)  # the rows of other fragments stay as they are
        for p, part in parts.items():
            self.layout.scatter(p, part, full)
        for name, value in full.items():
            param = self.params[name]
            mine = distribute_tensor(
                value.to(param.dtype),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            ).to_local()
            param.to_local().copy_(mine.to(param.to_local().device))
            if self.mirror is not None:
                self.mirror.tensors[name].copy_(value)


def _names_of(layout: FragmentLayout, fragments) -> list[str]:
    """The parameters holding any of ``fragments``, in the layout's order (the same on every
    rank: the order of the collectives)."""
    wanted = {pc.name for p in fragments for pc in layout.fragments[p].pieces}
    return [name for name, _, _ in layout.tensors if name in wanted]

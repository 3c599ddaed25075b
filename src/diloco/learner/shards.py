"""Fan-out to a sharded syncer: one ``SyncerLink`` per shard behind the ``SyncerLink`` interface.

A sharded syncer is ``S`` independent processes (``diloco syncer --shard i/S``), each owning
the fragments ``p mod S == i`` (``diloco.algorithm.shards``). A learner (or the evaluator)
opens one link per shard; :class:`ShardedLink` routes each upload to the link of the shard
that owns its fragment and hands every link's fragment stream to the same ``on_fragment``
callback (the streams carry disjoint fragments, so merging them is just that).

Validation: every link reports at join which shard it reached and which fragments it owns.
A shard whose split does not match the number of addresses given, or a set of shards that
does not cover every fragment exactly once, is a fatal error (``error`` says what to pass
instead); each shard checks the learner's layout hash itself, exactly as a single syncer
does, so shards that accept the learner all have its layout.

Use :func:`open_link`: one address gives a plain ``SyncerLink`` (which insists that its
syncer owns every fragment), several give a ``ShardedLink``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields

from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.shards import ShardError, ShardInfo, check_cover
from diloco.learner.address import check_spec
from diloco.learner.link import LinkStats, SyncerLink, UploadJob, UploadResult
from diloco.learner.listener import LinkListener
from diloco.runtime.clock import monotonic

__all__ = ["ShardedLink", "open_link", "parse_syncer_addresses"]


def parse_syncer_addresses(syncer: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]`` (order kept).

    Raises ``ValueError`` for an empty list, an empty entry, an entry that is neither
    ``HOST:PORT`` (a port from 1 to 65535) nor ``@FILE`` (``diloco.learner.address``) or
    an address given twice.
    """
    items = syncer.split(",") if isinstance(syncer, str) else list(syncer)
    addresses = [str(a).strip() for a in items]
    if not addresses or any(not a for a in addresses):
        raise ValueError(
            f"syncer address list {syncer!r} has an empty entry: expected HOST:PORT or "
            "HOST0:PORT0,HOST1:PORT1,... (one address per shard)"
        )
    for a in addresses:
        check_spec(a)
    twice = sorted({a for a in addresses if addresses.count(a) > 1})
    if twice:
        raise ValueError(f"syncer address(es) given twice: {', '.join(twice)}")
    return addresses


def open_link(
    syncer: str | Sequence[str],
    learner_id: str,
    layout: FragmentLayout,
    listener: LinkListener,
    **kwargs,
) -> SyncerLink | ShardedLink:
    """A started link to ``syncer``: one address (a whole syncer) or one per shard.

    ``kwargs`` are ``SyncerLink``'s options (``observer``, TLS and token options, ...); every
    shard's link gets the same ones and the same ``listener``.
    """
    addresses = parse_syncer_addresses(syncer)
    if len(addresses) == 1:
        return SyncerLink(addresses[0], learner_id, layout, listener, **kwargs).start()
    return ShardedLink(addresses, learner_id, layout, listener, **kwargs).start()


class _AllConnected:
    """``connected`` of a fan-out: set only while every shard's link is connected."""

    def __init__(self, links: Sequence[SyncerLink]) -> None:
        self._links = links

    def is_set(self) -> bool:
        return all(link.connected.is_set() for link in self._links)


class ShardedLink:
    """One learner's (or observer's) links to every shard of a sharded syncer.

    Same interface as ``SyncerLink`` (``start``, ``submit``, ``wait_idle``, ``close``,
    ``error``, ``connected``, ``joined_versions``, ``stats``). ``connected.is_set()`` is true
    only while *every* shard is connected (a learner flushes at close only then; while a shard
    is down, its fragments wait and the other shards carry on). ``joined_versions`` is known
    once every shard has joined: each fragment's version at its owner's join.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        learner_id: str,
        layout: FragmentLayout,
        listener: LinkListener,
        **kwargs,
    ) -> None:
        if len(addresses) < 2:
            raise ValueError("ShardedLink needs at least two addresses (use SyncerLink)")
        self.addresses = list(addresses)
        self.address = ",".join(self.addresses)
        self.layout = layout
        self.clock: Callable[[], float] = kwargs.get("clock", monotonic)
        """Where the deadlines of ``wait_idle`` come from (each shard's link has the same)."""
        self._lock = threading.Lock()
        self.links = [
            SyncerLink(
                address,
                learner_id,
                layout,
                listener,
                check_join=self._check_join,
                **kwargs,
            )
            for address in self.addresses
        ]
        self.connected = _AllConnected(self.links)
        self._resumed: list[UploadJob] = []
        """Jobs to resume on the shard that owns them, once it has said which it owns."""

    # ------------------------------------------------------------------ public
    def start(self) -> ShardedLink:
        for link in self.links:
            link.start()
        return self

    @property
    def error(self) -> BaseException | None:
        """The first fatal error of any shard's link (a refusal, or a wrong set of shards)."""
        return next((link.error for link in self.links if link.error is not None), None)

    @property
    def joined_versions(self) -> list[int] | None:
        """Each fragment's version as its owner reported at its last join; None until every
        shard has joined once."""
        infos = [link.shard_info for link in self.links]
        versions = [link.joined_versions for link in self.links]
        if any(i is None for i in infos) or any(v is None for v in versions):
            return None
        out = [-1] * self.layout.num_fragments
        for info, vs in zip(infos, versions, strict=True):
            for p in info.fragments:
                out[p] = vs[p] if p < len(vs) else -1
        return out

    @property
    def stats(self) -> LinkStats:
        """Transport counters summed over the shards' links."""
        total = LinkStats()
        for link in self.links:
            for f in fields(LinkStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(link.stats, f.name))
        return total

    def owner(self, fragment: int) -> SyncerLink | None:
        """The link of the shard that owns ``fragment`` (None before that shard joined)."""
        for link in self.links:
            info = link.shard_info
            if info is not None and fragment in info.fragments:
                return link
        return None

    @property
    def schedule(self) -> str:
        """Who drives the rounds (every shard runs the same configuration)."""
        return self.links[0].schedule

    @property
    def sync_every(self) -> int:
        return self.links[0].sync_every

    def withdraw(self, fragment: int) -> UploadJob | None:
        """``SyncerLink.withdraw`` on the owner shard's link."""
        link = self.owner(fragment)
        return link.withdraw(fragment) if link is not None else None

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """``SyncerLink.holding`` on every shard's link."""
        with contextlib.ExitStack() as stack:
            for link in self.links:
                stack.enter_context(link.holding())
            yield

    def backlog_s(self, fragment: int) -> float:
        """``SyncerLink.backlog_s`` of the owner shard's link (0 if it is not known)."""
        link = self.owner(fragment)
        return link.backlog_s(fragment) if link is not None else 0.0

    @property
    def up_rate_Bps(self) -> float | None:  # noqa: N802 - bytes, not bits
        """Measured upload rate summed over the shards' links (None before any upload)."""
        rates = [r for r in (link.up_rate_Bps for link in self.links) if r]
        return sum(rates) if rates else None

    def queued_jobs(self) -> set[int]:
        """``SyncerLink.queued_jobs`` of every shard."""
        return set().union(*(link.queued_jobs() for link in self.links))

    def reconnect(self) -> None:
        """Every shard's link joins and subscribes again."""
        for link in self.links:
            link.reconnect()

    def submit(self, job: UploadJob) -> None:
        """Queue an upload on the owner shard's link (never blocks).

        A learner only sends a fragment it has received, and it receives a fragment only
        from its owner, so the owner is known; if it is not (cannot happen through
        ``Learner``), the job is dropped and counted as failed, like an upload lost in a
        disconnect: its progress stays in the learner and goes out when next due.
        """
        link = self.owner(job.fragment)
        if link is None:
            self.links[0].stats.uploads_failed += 1
            self.links[0].answer(job, UploadResult("failed"))
            return
        link.submit(job)

    def resume(self, job: UploadJob) -> None:
        """``SyncerLink.resume`` on the owner shard's link (once it joined, if not yet)."""
        with self._lock:
            link = self.owner(job.fragment)
            if link is None:
                self._resumed.append(job)
                return
        link.resume(job)

    def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded by ``timeout`` in all) until every shard's uploads have gone out."""
        deadline = self.clock() + timeout
        idle = True
        for link in self.links:
            idle = link.wait_idle(max(0.0, deadline - self.clock())) and idle
        return idle

    def close(self, *, leave: bool = True) -> None:
        """Close every shard's link, in parallel (each bounded, see ``SyncerLink.close``)."""
        threads = [
            threading.Thread(target=link.close, kwargs={"leave": leave}, daemon=True)
            for link in self.links
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)

    # --------------------------------------------------------------- internal
    def _check_join(self, link: SyncerLink, info: ShardInfo) -> None:
        """``on_join`` of every shard's link: refuse a shard that does not fit the others."""
        if info.num_shards != len(self.links):
            raise ShardError(
                f"{info.label()} is one of {info.num_shards} shards, but {len(self.links)} "
                f"syncer addresses were given ({self.address}): give exactly one address per shard"
            )
        with self._lock:
            known = [
                info if other is link else other.shard_info
                for other in self.links
                if other is link or other.shard_info is not None
            ]
            if len(known) == len(self.links):
                check_cover(self.layout.num_fragments, known)
            else:  # not everyone joined yet: at least no fragment may be claimed twice
                seen: dict[int, ShardInfo] = {}
                for other in known:
                    for p in other.fragments:
                        if p in seen:
                            check_cover(self.layout.num_fragments, [seen[p], other])
                        seen[p] = other
            mine = [job for job in self._resumed if job.fragment in info.fragments]
            self._resumed = [job for job in self._resumed if job.fragment not in info.fragments]
        for job in mine:
            link.resume(job)

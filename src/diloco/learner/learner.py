"""``Learner``: the three lines a user adds to an ordinary PyTorch training loop.

    learner = diloco.Learner(model, syncer="127.0.0.1:7000")
    for batch in data:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=batch.numel())   # never blocks on the network
    learner.close()

For every fragment p the learner holds the global value ``G_p`` it last received (exactly
what the syncer's wire image holds at that version, so download rounding never leaks into a
delta) and its version, and keeps a **ledger** of the deltas of p that are on their way
(queued, sent, or accepted by the syncer and not yet merged back). Its *undelivered
progress* is ``u_p = (G_p − Σ ledger) − θ_p``, with the steps and tokens it covers. When the
syncer asks for p (its clock, ``schedule="syncer"``) or p is due on the learner's own count
(``schedule="learner"``), the learner queues ``u_p`` and moves it to the ledger. The ledger
settles exactly: an accepted delta stays until the commit that merges it comes back (then
its wire value leaves the ledger and enters ``G_p``); a refused, failed or withdrawn one
leaves the ledger, so its progress is back in ``u_p`` and goes out next time. Applying a new
global value ``G'_p`` keeps ``u_p`` and what is still on its way:
``θ_p ← θ_p + (G'_p − G_p) + Σ merged``. The paper's overwrite (``θ_p ← G'_p − Σ ledger``,
or an α-mix) is an option. See ``apply_arrived``. The inner optimizer's state (AdamW
moments) is left alone. A fragment never received yet is not sent.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from diloco.algorithm.fragments import (
    FragmentLayout,
    balanced_fragments,
    due_fragments,
)
from diloco.learner.callbacks import LearnerListener
from diloco.learner.config import LearnerConfig, default_generation, default_learner_id
from diloco.learner.delivery import DeliveryLog
from diloco.learner.inbox import Inbox, Rejoin, bounded, follow, rebases
from diloco.learner.journal import UploadJournal
from diloco.learner.ledger import Ledger
from diloco.learner.link import UploadJob
from diloco.learner.pacing import Pace
from diloco.learner.restoring import Restoring
from diloco.learner.settling import Settling
from diloco.learner.shards import open_link
from diloco.learner.snapshot import HostCopies, Snapshot
from diloco.learner.stopping import Stopping
from diloco.runtime.modules import plain_module
from diloco.wire.auth import client_link_options

log = logging.getLogger(__name__)
"""What a learner says (join, progress, falling behind): ``logging.INFO`` on
``diloco.learner``, silent unless the program configures logging."""

LOG_EVERY_MERGES = 100
"""A progress line every this many global versions applied."""


class Learner(Settling, Stopping, Restoring):
    """Wraps a model whose parameters are trained by the user's own optimizer.

    ``step`` is called once per inner optimizer step, after ``optimizer.step()``. It never
    waits for the network: it settles what the syncer answered, queues the fragments the
    syncer asked for (or that are due), and applies fragments that have arrived; a background
    thread sends. If the syncer refused this learner (model mismatch, authentication) the
    next ``step`` raises ``RuntimeError`` with the reason.

    ``syncer`` is ``"host:port"``, or for a sharded syncer every shard's address (a list, or
    one comma-separated string): the learner then opens one link per shard, sends each
    fragment to the shard that owns it and checks that the shards cover every fragment
    exactly once (``diloco.learner.shards``); a wrong set of shards is reported like a
    refusal. Constructing the learner validates the address list (``ValueError``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        syncer: str | Sequence[str],
        config: LearnerConfig | None = None,
        layout: FragmentLayout | None = None,
        link_options: dict | None = None,
        state: dict | None = None,
        **overrides,
    ) -> None:
        if "sync_every" in overrides:
            raise TypeError(
                "Learner(sync_every=...): H is the syncer's (diloco syncer --sync-every, "
                "SyncerConfig.protocol); a learner takes it from the syncer when it joins"
            )
        cfg = config or LearnerConfig(**overrides)
        if config is not None and overrides:
            raise ValueError("pass either config= or keyword overrides, not both")
        self.config = cfg
        model = plain_module(model)  # (after torch.compile: the module it wraps)
        self.model = model
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        first = next(iter(self.params.values()), None)
        if first is None:
            raise ValueError("the model has no parameters")
        if cfg.cpu_threads and first.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        self.layout = layout or balanced_fragments(model.named_parameters(), cfg.num_fragments)
        if self.layout.num_fragments != cfg.num_fragments:
            raise ValueError(
                f"layout has {self.layout.num_fragments} fragments, config says {cfg.num_fragments}"
            )
        self.learner_id = cfg.learner_id or default_learner_id()
        if cfg.malloc_arenas is not None:  # asked for: before the link's threads exist
            from diloco.learner.memory import limit_malloc_arenas

            limit_malloc_arenas(cfg.malloc_arenas)
        self._init_progress(self.layout.num_fragments)
        if state is not None:
            self.load_state_dict(state)
            if self.delivery is not None:
                self._drop_delivered(self.delivery.read())
        elif self.delivery is not None:
            self.delivery.clear()
        self.journal = self._open_journal(state)
        self._host_copies = HostCopies(self.layout, self.params)
        self.listener = LearnerListener(self)
        """What the link tells this learner and asks of it (on the link's threads)."""
        self.link = self._open_link(syncer, link_options)
        self._resume_unanswered()
        self.before_touch: Callable[[list[int]], None] | None = None
        """Called with the fragments this learner is about to read or change in the model's
        parameters (a sharded island brings its mirror of them up to date here)."""

    def _touch(self, fragments) -> None:
        if self.before_touch is not None and fragments:
            self.before_touch(sorted(fragments))

    def _init_progress(self, P: int) -> None:
        """The per-fragment progress state (nothing trained, nothing held yet)."""
        self.local_step = 0
        self.total_tokens = 0
        self.anchors: list[torch.Tensor | None] = [None] * P
        """G_p: the global value of each fragment this learner holds (the syncer's wire
        image at ``versions[p]``, bit for bit); ``None`` before the first arrival."""
        self.versions = [-1] * P
        self.steps_since = [0] * P
        """Steps of the undelivered progress of each fragment (not yet in any delta)."""
        self.tokens_since = [0] * P
        self.dropped = [0] * P
        """Per fragment, trained steps thrown away on purpose (a norm-guard reset, the
        paper's overwrite rule): every trained step is merged, in flight, unsent, excluded
        or counted here (``accounting``)."""
        self.merged_steps = [0] * P
        """Per fragment, trained steps in deltas merged back (``accounting``)."""
        self.excluded_steps = [0] * P
        """Per fragment, trained steps in deltas the syncer left out of their merges."""
        self.unknown_steps = [0] * P
        """Per fragment, trained steps in accepted deltas whose fate no syncer can tell."""
        self._merged_recent: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Upload id -> (fragment, steps) of the last merged deltas (``settling``)."""
        self._upload_ids = itertools.count(secrets.randbits(40) << 20)
        """Ids of this learner's uploads (random base: a restarted learner never reuses one)."""
        self.journal: UploadJournal | None = None
        """The upload journal (``LearnerConfig.journal_file``), opened once restored."""
        self.applied = 0
        self.last_applied: list[int] = []  # fragments changed by the last apply_arrived()
        self._inbox = Inbox()  # what the link's threads hand to the training thread
        self._ledger = Ledger()
        self._syncer_ids: dict[str, str] = {}
        """The syncer instance (per address) this learner's ledger was admitted by."""
        self.lineages: dict[str, str] = {}
        """Per syncer (shard) address, the lineage of the versions held (``settling``)."""
        self._rebasing: set[int] = set()
        """Fragments waiting for the first keyframe of another lineage (not sent till then)."""
        self._successors: dict[str, Rejoin] = {}
        """A replaced syncer instance's id -> the rejoin to its successor (what it restored)."""
        self._reset_now: set[int] = set()  # fragments reset by the norm guard since last apply
        self._residual: set[int] = set()
        """Fragments whose undelivered progress holds the quantization residual of an accepted
        delta (decoded other than queued), though maybe no step: a new value is rebased onto
        it, never written over (``_apply``), until it goes out or is dropped."""
        self._copying: dict[int, Snapshot] = {}
        """Fragments queued whose parameters are still on their way to the host (a CUDA
        learner, ``diloco.learner.snapshot``): their delta is made when the copy lands."""
        # Fragments sent and not yet merged back: p -> (local step sent at, base version).
        self._awaited: dict[int, tuple[int, int]] = {}
        self.guard_resets = 0
        """Fragments reset to the global value after a norm-guard refusal (``_reset``)."""
        self.counters = {
            "withdrawn": 0,
            "returned": 0,
            "merged": 0,
            "excluded": 0,
            "unknown": 0,
            "resyncs": 0,
            "deferred": 0,
        }
        """Ledger events: deltas withdrawn before sending (sent again, bigger), returned to
        the undelivered progress (refused, failed, lost with a restarted syncer), merged
        back, left out of their merge by the syncer; fragments resynced because an arrival
        did not fit what this learner holds; requests deferred while the link was behind
        (``diloco.learner.pacing``)."""
        self._pace = Pace(self.config.max_stretch, self.config.pace_lag_steps)
        self._deferred_in_row = [0] * P
        self._behind = False
        self._down_lags: dict[str, int] = {}
        """Per syncer (shard), the versions this learner lacked of its furthest-behind fragment
        at the last heartbeat (``LearnerListener.on_versions``, on the link's thread)."""
        self._step_time: float | None = None
        self._last_step_at: float | None = None
        self._state = "starting"
        self._closed = False
        self._flushed: set[int] = set()
        self.close_report: dict = {}
        """What ``close`` did: fragments flushed, whether the uploads went out and the merges
        holding them came back in time (``drained``), and the fragments that did not."""
        self.delivery = (
            DeliveryLog(self.config.delivery_file) if self.config.delivery_file else None
        )
        self._init_restoring()

    def _open_link(self, syncer: str | Sequence[str], link_options: dict | None):
        """The link to the syncer(s), heard by this learner's ``listener``."""
        cfg = self.config
        options = client_link_options(
            token=cfg.token, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
        )
        options.update(tokens_per_step=cfg.tokens_per_step, comms=cfg.comms, **(link_options or {}))
        options.setdefault("generation", cfg.generation or default_generation())
        return open_link(syncer, self.learner_id, self.layout, self.listener, **options)

    # ----------------------------------------------------------------- public
    def step(self, tokens: int) -> list[int]:
        """Record one inner step of ``tokens`` tokens; returns the fragments queued for upload."""
        if self._closed:
            raise RuntimeError("step() after close()")
        if self.link.error is not None:
            raise RuntimeError(str(self.link.error))
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if self._unconfirmed:
            self._give_up_unconfirmed()
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            d = self.config.step_time_decay
            self._step_time = dt if self._step_time is None else d * self._step_time + (1 - d) * dt
        self._last_step_at = now
        self.local_step += 1
        self.total_tokens += tokens
        self._state = "training"
        for p in range(self.layout.num_fragments):
            self.steps_since[p] += 1
            self.tokens_since[p] += tokens
        self._settle()
        self._send_copied()
        asked = self._inbox.take_requested()
        if self.link.schedule == "learner" and self.link.sync_every > 0:  # (H: the syncer's)
            asked |= set(
                due_fragments(self.local_step, self.link.sync_every, self.layout.num_fragments)
            )
        queued = [p for p in sorted(asked) if self._answer_request(p)]
        self.apply_arrived()
        return queued

    def _answer_request(self, p: int) -> bool:
        """Answer a request for ``p`` (queue its progress), or, on the syncer's clock, defer it
        while the link is behind (``diloco.learner.pacing``: the progress stays and goes out
        next time). On the learners' own schedule (synchronous DiLoCo's lockstep) a due
        fragment is always sent."""
        backlog = self.link.backlog_s(p) if self.link.schedule == "syncer" else 0.0
        if self._pace.defer(backlog, self._step_time, self._deferred_in_row[p]):
            self._deferred_in_row[p] += 1
            self.counters["deferred"] += 1
            if not self._behind:
                log.info(
                    "learner %s: its uploads fall behind (%.1f s waiting); it defers the "
                    "syncer's requests until they catch up",
                    self.learner_id,
                    backlog,
                )
            self._behind = True
            return False
        self._deferred_in_row[p] = 0
        self._behind = False
        return self._queue(p)

    def apply_arrived(self) -> int:
        """Settle the syncer's answers and apply every fragment that has arrived since the
        last call; returns how many fragments changed.

        A fragment with a delta on the wire (sent, no answer yet) waits: the answer says
        whether the new version merged it. For the others: the new value ``G'`` (a keyframe,
        or the chain of deltas on top of the value held) is applied keeping the undelivered
        progress and what is still on its way: ``θ ← θ + (G' − G) + Σ merged``, where
        *merged* are this learner's accepted deltas the new version holds (admitted before
        it). With ``rebase_foreign`` off (a merge without ours) or ``rebase_own`` off (with
        ours) the paper's rule: overwrite, ``θ ← G' − Σ ledger`` (α-mixed by ``alpha``),
        counters 0. The first value of a fragment overwrites the learner's own initial values:
        the steps trained on them are thrown away (counted in ``dropped``, counters 0). An
        arrival that does not fit the value held is dropped and the fragment resynced (a
        keyframe is asked for). A waiting chain longer than ``MAX_WAITING_CHAIN`` is kept as
        the one value it gives (``inbox.bounded``).
        """
        arrived = self._inbox.take_arrived()
        # Taken after the arrivals: a job still queued now was not on the wire when any of
        # them was committed, so none of them holds it.
        queued = self.link.queued_jobs()
        self._settle()
        ready, waiting = {}, {}
        for p, chain in arrived.items():
            if p in self._copying:
                waiting[p] = chain  # its delta is not made yet: it is made against G_p
            elif any(e.job_id not in queued for e in self._ledger.unanswered(p)):
                waiting[p] = chain  # on the wire: its answer says whether these merged it
            else:
                ready[p] = chain
        self._inbox.put_back(
            {p: bounded(chain, self.versions[p], self.anchors[p]) for p, chain in waiting.items()}
        )
        self.last_applied, self._reset_now = sorted(self._reset_now), set()
        self._touch(ready)
        with torch.no_grad():
            for p, chain in sorted(ready.items()):
                followed = self._follow(p, chain)
                if followed is None:
                    self._resync(p)
                    continue
                version, value = followed
                if version <= self.versions[p] and not rebases(chain):
                    continue  # (another lineage's first value: whatever its version)
                self._apply(p, version, value)
                if rebases(chain):
                    self._rebased(p)
                if p not in self.last_applied:
                    self.last_applied.append(p)
                self.applied += 1
                if self.applied % LOG_EVERY_MERGES == 0:
                    log.info(
                        "learner %s: %d global versions applied (step %d, versions %s)",
                        self.learner_id,
                        self.applied,
                        self.local_step,
                        self.versions,
                    )
        return len(self.last_applied)

    def _follow(self, p: int, chain) -> tuple[int, torch.Tensor] | None:
        """The value at the end of ``chain`` on top of what this learner holds (``follow``)."""
        return follow(chain, self.versions[p], self.anchors[p])

    def _apply(self, p: int, version: int, value: torch.Tensor) -> None:
        held = self.anchors[p]
        merged = self._ledger.take_merged(p, version)
        self._count_merged(p, merged, version)
        own = bool(merged)
        rebase = self.config.rebase_own if own else self.config.rebase_foreign
        if held is None:  # over the learner's own initial values: their steps are lost
            self.layout.scatter(p, value, self.params)
            self.dropped[p] += self.steps_since[p]
            self.steps_since[p] = self.tokens_since[p] = 0
        elif rebase and self.steps_since[p] == 0 and p not in self._residual:
            self._overwrite(p, value)  # no undelivered progress: exactly G' − ledger
        elif rebase:
            shift = value - held
            for e in merged:
                shift.add_(e.delta)
            self.layout.add_(p, shift, self.params)
        else:
            self._overwrite(p, value)
        self.anchors[p] = value
        self.versions[p] = version

    def _overwrite(self, p: int, value: torch.Tensor, *, drops: bool = True) -> None:
        """The paper's rule: θ_p ← G'_p − Σ ledger (α = 0) or α-mixed; counters 0. The steps
        of the undelivered progress thrown away are counted in ``dropped`` (unless
        ``drops`` is False: progress known to be delivered already)."""
        target = value.clone()
        on_its_way = self._ledger.on_its_way(p)
        if on_its_way is not None:
            target.sub_(on_its_way)
        alpha = self.config.alpha
        if alpha:
            self._touch([p])
            target = self.layout.gather(p, self.params).mul_(alpha).add_(target, alpha=1 - alpha)
        self.layout.scatter(p, target, self.params)
        if drops:
            self.dropped[p] += self.steps_since[p]
        self.steps_since[p] = 0
        self.tokens_since[p] = 0
        self._residual.discard(p)

    def _reset(self, p: int) -> bool:
        """After the syncer's norm guard refused a delta of ``p``: drop the fragment's
        undelivered progress (back to ``G_p − Σ ledger``, counters 0), and a snapshot of ``p``
        whose copy to the host is still on its way with it (its delta would be made from the θ
        thrown away, and the next delta would carry its reverse). The delta only grows
        while it is refused, so without this an honest learner whose delta once looked too
        large (a fragment not synced for many steps) would never be accepted again; a learner
        with corrupt values is brought back the same way. Returns whether ``p`` changed."""
        if self.anchors[p] is None:
            return False
        snapshot = self._copying.pop(p, None)  # its θ is thrown away too: so is its delta
        if snapshot is not None:
            self.dropped[p] += snapshot.steps
        self._overwrite(p, self.anchors[p])
        self._awaited.pop(p, None)
        self.guard_resets += 1
        return True

    def _resync(self, p: int) -> None:
        """Ask for a keyframe of ``p``: an arrival did not fit the value held."""
        log.warning("fragment %d: arrival does not fit version %d; resyncing", p, self.versions[p])
        self.counters["resyncs"] += 1
        self._inbox.ask_keyframe(p)
        self.link.reconnect()

    def _queue(self, p: int, *, final: bool = False) -> bool:
        """Queue fragment ``p``'s undelivered progress; True if a delta was queued. A delta
        of ``p`` still waiting to be sent is withdrawn first and goes out in this one."""
        if self.anchors[p] is None or p in self._copying or p in self._rebasing:
            return False  # (a copy, or another lineage, on its way: it goes out next time)
        withdrawn = self.link.withdraw(p)
        if withdrawn is not None:
            entry = self._ledger.find(p, withdrawn.job_id)
            if entry is not None:
                self._return(p, entry)
                self.counters["withdrawn"] += 1
        if self.steps_since[p] == 0:
            return False
        self._touch([p])
        snapshot = Snapshot(
            self._host_copies.take(p),
            self.anchors[p],
            self._ledger.on_its_way(p),
            self.steps_since[p],
            self.tokens_since[p],
            self.local_step,
            final,
        )
        self.steps_since[p] = 0
        self.tokens_since[p] = 0
        self._residual.discard(p)  # it goes out in this delta
        self._awaited.setdefault(p, (self.local_step, self.versions[p]))
        if snapshot.copy.ready():
            self._send(p, snapshot)
        else:
            self._copying[p] = snapshot
        return True

    def _send_copied(self, *, wait: bool = False) -> None:
        """Send the fragments whose copy to the host has landed (all of them if ``wait``)."""
        for p, snapshot in list(self._copying.items()):
            if wait or snapshot.copy.ready():
                del self._copying[p]
                self._send(p, snapshot)

    def _send(self, p: int, snapshot: Snapshot) -> None:
        """Make the delta ``G_p − θ_p − (what is on its way)`` as of the snapshot, put it on
        the ledger and hand it to the link."""
        delta = snapshot.copy.owned()
        torch.sub(snapshot.anchor, delta, out=delta)  # G_p − θ_p, in the copy
        if snapshot.on_its_way is not None:
            delta.sub_(snapshot.on_its_way)
        upload_id = next(self._upload_ids)
        entry = self._ledger.add(
            p, delta, snapshot.steps, snapshot.tokens, snapshot.local_step, upload_id
        )
        entry.base_version = self.versions[p]
        if self.journal is not None:  # before it can reach the syncer
            self.journal.queued(upload_id, p, entry.steps, entry.tokens, snapshot.local_step)
        self.link.submit(
            UploadJob(
                p,
                self.versions[p],
                entry.steps,
                entry.tokens,
                delta,
                self._step_time or 0.0,
                snapshot.local_step,
                job_id=entry.job_id,
                final=snapshot.final,
                upload_id=upload_id,
            )
        )

    def unsent(self) -> list[int]:
        """Per fragment, the trained steps the syncer has not accepted: the undelivered
        progress plus deltas without an answer (after ``close``: the unsent tail)."""
        return [
            self.steps_since[p]
            + sum(e.steps for e in self._ledger.unanswered(p))
            + (self._copying[p].steps if p in self._copying else 0)
            for p in range(self.layout.num_fragments)
        ]

    def in_flight(self) -> dict[int, int]:
        """Deltas on their way per fragment (queued, sent, or accepted and not merged back)."""
        return self._ledger.in_flight()

    def wait_for_global(self, timeout: float = 60.0, *, required: bool = True) -> bool:
        """Block until this learner holds every fragment at least at the version the syncer had
        when it joined, and apply them; True if so within ``timeout``. Otherwise
        ``TimeoutError`` (it would train from its own initialization, apart from the fleet),
        or, with ``required=False``, False.

        Call it once before training: a fresh learner then starts from the global model, and
        one restored from a checkpoint catches up before it sends.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.link.error is not None:
                raise RuntimeError(str(self.link.error))
            # the target first: the link sets it after reporting the rejoin, settled below
            target = self.link.joined_versions
            self.apply_arrived()
            if target is not None and all(
                h >= max(t, 0) for h, t in zip(self.versions, target, strict=False)
            ):
                return True
            if time.monotonic() > deadline:
                if required:
                    raise TimeoutError(
                        f"no global model from {self.link.address} within {timeout:g} s "
                        "(is the syncer up, the address and token right?)"
                    )
                return False
            time.sleep(0.02)

    def wait_for_merges(
        self, lag: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Synchronous DiLoCo: block until every fragment sent ``lag`` or more steps ago has
        come back merged (a newer version of it applied), so no learner runs more than ``lag``
        steps ahead of a round. Returns False if ``timeout`` passed or ``stop`` was set first.

        The decoupled default never calls it: a learner there never waits for anyone.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._send_copied()
            self.apply_arrived()
            for p, (_, base) in list(self._awaited.items()):
                if self.versions[p] > base:
                    del self._awaited[p]
            late = [p for p, (at, _) in self._awaited.items() if self.local_step - at >= lag]
            if not late:
                return True
            if self.link.error is not None:
                raise RuntimeError(str(self.link.error))
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                return False
            time.sleep(0.005)

    @property
    def down_lag(self) -> int:
        """Versions this learner lacks of the fragment it is furthest behind on (its downlink's
        lag, as of the last heartbeat; ``DOWNLINK_BEHIND_VERSIONS`` or more: behind)."""
        return max(self._down_lags.values(), default=0)

    @property
    def stats(self) -> dict:
        s = self.link.stats
        return {
            "learner_id": self.learner_id,
            "step": self.local_step,
            "tokens": self.total_tokens,
            "connected": self.link.connected.is_set(),
            "fragments_applied": self.applied,
            "bytes_up": s.bytes_up,
            "bytes_down": s.bytes_down,
            "uploads_sent": s.uploads_sent,
            "uploads_refused": s.uploads_refused,
            "guard_resets": self.guard_resets,
            "dropped_steps": sum(self.dropped),
            "stale_replies": s.stale_replies,
            "uploads_failed": s.uploads_failed,
            "requests": s.requests,
            "keyframes": s.keyframes,
            "up_rate_Bps": self.link.up_rate_Bps,
            "down_lag": self.down_lag,
            **self.counters,
            **({"close": self.close_report} if self.close_report else {}),
        }

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

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
from collections.abc import Callable, Sequence

import torch
from torch import nn

from diloco.algorithm.fragments import (
    FragmentLayout,
    balanced_fragments,
    due_fragments,
)
from diloco.learner.accounting import Accounting
from diloco.learner.callbacks import LearnerListener
from diloco.learner.config import LearnerConfig, default_generation, default_learner_id, renamed
from diloco.learner.delivery import DeliveryLog
from diloco.learner.inbox import Inbox, bounded, follow, rebases
from diloco.learner.ledger import Ledger
from diloco.learner.link import UploadJob
from diloco.learner.pacing import Pace, Pacer
from diloco.learner.progress import HeldBy, Progress
from diloco.learner.restoring import DATA, Restorer
from diloco.learner.settling import Settler
from diloco.learner.shards import open_link
from diloco.learner.snapshot import HostCopies, Snapshot
from diloco.learner.stats import learner_stats
from diloco.learner.stopping import Stopper
from diloco.learner.waiting import Waiter
from diloco.runtime.clock import monotonic
from diloco.runtime.modules import plain_module
from diloco.wire.auth import client_link_options

log = logging.getLogger(__name__)
"""What a learner says (join, progress, lag): INFO, silent unless logging is configured."""

LOG_EVERY_MERGES = 100
"""A progress line every this many global versions applied."""


class Learner:
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

    local_step = HeldBy("progress")
    total_tokens = HeldBy("progress")
    anchors = HeldBy("progress")
    versions = HeldBy("progress")
    steps_since = HeldBy("progress")
    tokens_since = HeldBy("progress")
    dropped = HeldBy("progress")
    merged_steps = HeldBy("progress")
    excluded_steps = HeldBy("progress")
    unknown_steps = HeldBy("progress")
    lineages = HeldBy("progress")
    counters = HeldBy("progress")
    journal = HeldBy("progress")
    dropped_on_restore = HeldBy("restorer")
    ahead_on_restore = HeldBy("restorer")
    close_report = HeldBy("stopper", "report")

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
        clock: Callable[[], float] = monotonic,
        **overrides,
    ) -> None:
        renamed("Learner", overrides)  # the previous release's names: one line naming the new
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
        self.clock = clock
        """Where every ``now`` of this learner and its parts comes from (seconds, monotonic)."""
        self.reporter = None
        """The files a launched learner keeps (``diloco.learner.workdir``; ``from_env``)."""
        self.before_touch: Callable[[list[int]], None] | None = None
        """Called with the fragments this learner is about to read or change in the model's
        parameters (a sharded island brings its mirror of them up to date here)."""
        self._init_parts(self.layout.num_fragments)
        if state is not None:
            self.load_state_dict(state)
            if self.delivery is not None:
                self.restorer.drop_delivered(self.delivery.read())
        elif self.delivery is not None:
            self.delivery.clear()
        self.journal = self.restorer.open_journal(state)
        self._host_copies = HostCopies(self.layout, self.params)
        self.listener = LearnerListener(
            self.learner_id,
            self._inbox,
            self.progress,
            self.layout,
            self.params,
            self.pacer,
            self.delivery,
            reconnect=lambda: self.link.reconnect(),
        )
        """What the link tells this learner and asks of it (on the link's threads)."""
        self.settler.note_unsettled()  # (what the first join reports)
        self.link = self._open_link(syncer, link_options)
        self.stopper = Stopper(
            self.link,
            self._ledger,
            self.progress,
            cfg,
            self.pacer,
            clock=clock,
            settle=self.settler.settle,
            queue=self._queue,
            send_copied=self._send_copied,
            apply_arrived=self.apply_arrived,
        )
        """Flushes, drains and closes (``diloco.learner.stopping``)."""
        give_up = self.restorer.give_up_unconfirmed  # (a timed-out wait: no first join)
        self.waiter = Waiter(
            self.link, self.progress, clock, self._send_copied, self.apply_arrived, give_up
        )
        """Waits for the global model, or for merges (``diloco.learner.waiting``)."""
        self.restorer.resume_unanswered(self.link)

    def _touch(self, fragments) -> None:
        if self.before_touch is not None and fragments:
            self.before_touch(sorted(fragments))

    def _init_parts(self, P: int) -> None:
        """The learner's state and the parts that own the rest (nothing trained yet)."""
        self.progress = Progress(P)
        """Per-fragment values held, versions, step counts and where the steps went."""
        self.applied = 0
        self.last_applied: list[int] = []  # fragments changed by the last apply_arrived()
        self._upload_ids = itertools.count(secrets.randbits(40) << 20)
        """Ids of this learner's uploads (random base: a restarted learner never reuses one)."""
        self._inbox = Inbox()  # what the link's threads hand to the training thread
        self._ledger = Ledger()
        self._copying: dict[int, Snapshot] = {}
        """Fragments queued whose parameters are still on their way to the host (a CUDA
        learner, ``diloco.learner.snapshot``): their delta is made when the copy lands."""
        self.guard_resets = 0
        """Fragments reset to the global value after a norm-guard refusal (``_reset``)."""
        cfg = self.config
        self.pacer = Pacer(Pace(cfg.max_stretch, cfg.pace_lag_steps), cfg.step_time_decay, P)
        """Step time and deferred requests (``diloco.learner.pacing``)."""
        self.delivery = DeliveryLog(cfg.delivery_file) if cfg.delivery_file else None
        self.settler = Settler(
            self._inbox,
            self._ledger,
            self.progress,
            self.layout,
            self.params,
            touch=self._touch,
            reset=self._reset,
            on_join=lambda rejoin: self.restorer.confirm_at_join(rejoin),
        )
        """Settles the syncer's answers and says where steps went (``settling``)."""
        self.restorer = Restorer(
            self.progress,
            self._ledger,
            self._inbox,
            self.layout,
            cfg,
            self.settler,
            overwrite=self._overwrite,
        )
        """Saves and restores the checkpoint state (``diloco.learner.restoring``)."""

    def _open_link(self, syncer: str | Sequence[str], link_options: dict | None):
        """The link to the syncer(s), heard by this learner's ``listener``."""
        cfg = self.config
        options = client_link_options(
            token=cfg.token, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
        )
        options.update(tokens_per_step=cfg.tokens_per_step, comms=cfg.comms, **(link_options or {}))
        options.setdefault("generation", cfg.generation or default_generation(cfg.generation_file))
        options.setdefault("clock", self.clock)
        return open_link(syncer, self.learner_id, self.layout, self.listener, **options)

    # ----------------------------------------------------------------- public
    @classmethod
    def from_env(cls, model: nn.Module, optimizer=None, **overrides) -> Learner:
        """A learner as ``diloco launch`` tells it to be (``diloco.learner.from_env``)."""
        from diloco.learner.from_env import learner_from_env

        return learner_from_env(cls, model, optimizer, **overrides)

    def step(self, tokens: int, loss: float | None = None) -> list[int]:
        """Record one inner step of ``tokens`` tokens (``loss``: its training loss, for the
        run's records); returns the fragments queued for upload. A launched learner asked
        to stop (``from_env``) closes here, flushing, and raises ``SystemExit(0)``."""
        if self.stopper.closed:
            raise RuntimeError("step() after close()")
        if self.link.error is not None:
            raise RuntimeError(str(self.link.error))
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self.restorer.give_up_unconfirmed()  # (training resumes: a join waiting settled first)
        self.pacer.stepped(self.clock())
        self.local_step += 1
        self.total_tokens += tokens
        self.progress.state = "training"
        for p in range(self.layout.num_fragments):
            self.steps_since[p] += 1
            self.tokens_since[p] += tokens
        self.settler.settle()
        self._send_copied()
        asked = self._inbox.take_requested()
        if self.link.schedule == "learner" and self.link.sync_every > 0:  # (H: the syncer's)
            asked |= set(
                due_fragments(self.local_step, self.link.sync_every, self.layout.num_fragments)
            )
        queued = [p for p in sorted(asked) if self._answer_request(p)]
        self.apply_arrived()
        if self.reporter is not None and self.reporter.stepped(self, loss):
            self.close()
            raise SystemExit(0)
        return queued

    def _answer_request(self, p: int) -> bool:
        """Answer a request for ``p`` (queue its progress), or, on the syncer's clock, defer it
        while the link is behind (``diloco.learner.pacing``: the progress stays and goes out
        next time). On the learners' own schedule (synchronous DiLoCo's lockstep) a due
        fragment is always sent."""
        backlog = self.link.backlog_s(p) if self.link.schedule == "syncer" else 0.0
        was_behind = self.pacer.behind
        if self.pacer.defer(p, backlog):
            self.counters["deferred"] += 1
            if not was_behind:
                log.info(
                    "learner %s: its uploads fall behind (%.1f s waiting); it defers the "
                    "syncer's requests until they catch up",
                    self.learner_id,
                    backlog,
                )
            return False
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
        self.settler.settle()
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
        self.last_applied = sorted(self.progress.reset_now)
        self.progress.reset_now = set()
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
                    self.settler.rebased(p)
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
        self.settler.count_merged(p, merged, version)
        own = bool(merged)
        rebase = self.config.rebase_own if own else self.config.rebase_foreign
        if held is None:  # over the learner's own initial values: their steps are lost
            self.layout.scatter(p, value, self.params)
            self.dropped[p] += self.steps_since[p]
            self.steps_since[p] = self.tokens_since[p] = 0
        elif rebase and self.steps_since[p] == 0 and p not in self.progress.residual:
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
        self.progress.residual.discard(p)

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
        self.progress.awaited.pop(p, None)
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
        if self.anchors[p] is None or p in self._copying or p in self.progress.rebasing:
            return False  # (a copy, or another lineage, on its way: it goes out next time)
        withdrawn = self.link.withdraw(p)
        if withdrawn is not None:
            entry = self._ledger.find(p, withdrawn.job_id)
            if entry is not None:
                self.settler.give_back(p, entry)
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
        self.progress.residual.discard(p)  # it goes out in this delta
        self.progress.awaited.setdefault(p, (self.local_step, self.versions[p]))
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
                self.pacer.step_time or 0.0,
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
        """Block until this learner holds the global model (``Waiter.wait_for_global``)."""
        return self.waiter.wait_for_global(timeout, required=required)

    def wait_for_merges(
        self, lag: int, timeout: float, stop: threading.Event | None = None
    ) -> bool:
        """Synchronous DiLoCo: block until no fragment sent ``lag`` or more steps ago is still
        unmerged (``Waiter.wait_for_merges``)."""
        return self.waiter.wait_for_merges(lag, timeout, stop)

    @property
    def down_lag(self) -> int:
        """Versions this learner lacks of the fragment it is furthest behind on (its downlink's
        lag, as of the last heartbeat; ``DOWNLINK_BEHIND_VERSIONS`` or more: behind)."""
        return self.listener.down_lag

    @property
    def stats(self) -> dict:
        """The learner's counters (``diloco.learner.stats.learner_stats``)."""
        return learner_stats(self)

    def accounting(self) -> Accounting:
        """Where every trained step went, per fragment: merged, in flight (accepted, its
        merge not back yet), unsent, dropped (``diloco.learner.accounting``). Call it from
        the training thread (between steps, or after ``close``)."""
        self.settler.settle()
        return self.settler.accounting(self.unsent())

    def delivered_steps(self) -> list[int]:
        """Per fragment, the steps the syncer has (``Settler.delivered_steps``)."""
        return self.settler.delivered_steps()

    def unanswered_uploads(self) -> list[tuple[int, int, int]]:
        """``(upload id, fragment, steps)`` of the deltas sent without an answer yet
        (``Settler.unanswered_uploads``)."""
        return self.settler.unanswered_uploads()

    def state_dict(self) -> dict:
        """What a restarted learner needs to carry on (``Restorer.state``), after settling
        the answers and making the deltas still being copied (a checkpoint holds them), with
        the state of what it ``track``s. Save it with the model and the inner optimizer
        (``torch.save``; load with ``weights_only=True``) and pass it back as
        ``Learner(..., state=...)``: the learner then resubscribes with these versions and
        only receives fragments that moved on."""
        self.settler.settle()
        self._send_copied(wait=True)  # on the ledger: a checkpoint holds it
        return self.restorer.state()

    def load_state_dict(self, state: dict) -> None:
        """Take back a ``state_dict`` (``Restorer.load``; ``ValueError`` for another model)."""
        self.restorer.load(state)

    def skip(self, steps: int, tokens: int) -> None:
        """Count steps the previous life trained as not trained again (``Restorer.skip``)."""
        self.restorer.skip(steps, tokens)

    def track(self, data, name: str = DATA) -> None:
        """Carry ``data``'s position in ``state_dict`` and restore it (``Restorer.track``)."""
        self.restorer.track(data, name)

    def flush(self, timeout: float | None = None) -> bool:
        """Queue every fragment's progress as finals and wait for their answers; True if
        every delta had one within ``timeout`` (``Stopper.flush``)."""
        return self.stopper.flush(timeout)

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until every accepted delta has come back merged (``Stopper.drain``)."""
        return self.stopper.drain(timeout)

    def close(self, *, flush: bool = True) -> None:
        """Optionally flush and drain, leave the syncer and stop the background threads
        (bounded; ``Stopper.close``, what it did in ``close_report``)."""
        self.stopper.close(flush=flush)
        if self.reporter is not None:
            self.reporter.closed_by(self, clean=flush)

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

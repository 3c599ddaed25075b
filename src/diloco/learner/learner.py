"""``Learner``: the three lines a user adds to an ordinary PyTorch training loop.

    learner = diloco.Learner(model, syncer="127.0.0.1:7000")
    for batch in data:
        loss = model(batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=batch.numel())   # never blocks on the network
    learner.close()

For every fragment p the learner keeps the anchor ``A_p`` (the last global value it
received, exactly as decoded, so download rounding never leaks into a delta), its version,
and the counters ``steps_p``, ``tokens_p`` since it last received p. When p is due
(``diloco.algorithm.fragments.due_fragments``) it queues ``Δ = A_p − θ_p`` with the base
version and counters. A merged fragment that arrived is applied at the next ``step`` call: if
it merged only other learners' work, rebase (``θ_p ← Θ_p + (θ_p − A_p)``, keeping the local
progress); if it merged this learner's delta δ, keep only what was trained after δ was queued
(``θ_p ← Θ_p + (θ_p − (A_p − δ))``); the paper's overwrite (``θ_p ← Θ_p``, or
``θ_p ← αθ_p + (1−α)Θ_p``) when both rebases are off. See ``apply_arrived``. The inner
optimizer's state (AdamW moments) is left alone. A fragment never received yet is not sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from diloco.algorithm.fragments import FragmentLayout, balanced_fragments, due_fragments
from diloco.learner.delivery import DeliveryLog, already_delivered
from diloco.learner.link import UploadJob
from diloco.learner.shards import open_link
from diloco.wire.auth import client_link_options

log = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """The latest delta queued for a fragment, not yet seen in a merge."""

    delta: torch.Tensor
    steps: int
    tokens: int
    rebased: bool = False
    """A foreign merge was applied since: the anchor already excludes ``delta`` and the
    counters no longer hold its steps and tokens."""


@dataclass(kw_only=True)
class LearnerConfig:
    fragments: int = 24
    """P: number of fragments the model is cut into (must match the syncer)."""
    sync_every: int = 24
    """H: each fragment is sent every H local steps."""
    rebase_foreign: bool = True
    """When a merged fragment arrives that does not include this learner's latest
    contribution, move the local progress onto it (``θ ← θ + (Θ − A)``, counters kept) instead
    of discarding it."""
    rebase_own: bool = True
    """When the merge that includes this learner's in-flight delta δ arrives, keep the progress
    made since δ was queued (``θ ← Θ + (θ − (A − δ))``, counters less δ's) instead of
    overwriting it: the steps trained while δ travelled and was merged are not thrown away.
    False (or a merge with nothing of ours in flight) applies ``alpha``: the paper's rule."""
    alpha: float = 0.0
    """Mixing on receive: θ_p ← αθ_p + (1−α)Θ_p; 0 overwrites (the paper's rule)."""
    delivery_file: str | None = None
    """Where to keep the delivery log (``diloco.learner.delivery``): per fragment, the step of
    the newest upload the syncer accepted. With it, a learner restored from a checkpoint drops
    the checkpointed progress it had delivered after that checkpoint instead of sending it
    twice. Keep it beside the checkpoint; None: no log (a restore may resend some progress)."""
    learner_id: str | None = None
    """Identity at the syncer; default ``<hostname>-<pid>``. Keep it across restarts to rejoin."""
    cpu_threads: int | None = 1
    """``torch.set_num_threads`` applied when the model is on CPU (None: leave as is)."""
    flush_timeout_s: float = 10.0
    """How long ``close`` waits for queued uploads to go out."""
    drain_timeout_s: float = 3.0
    """After the final flush, how long ``close`` waits for the merged fragments to come back,
    so a learner that stops cleanly ends holding the global values (0: do not wait)."""
    step_time_decay: float = 0.9
    """EMA decay of the measured step time reported to the syncer."""
    token: str | None = field(default=None, repr=False)
    """Shared secret the syncer requires (``diloco.wire.auth.load_token`` reads it from a file
    or ``$DILOCO_TOKEN``); sent as ``authorization: Bearer …`` on every call."""
    tls_ca: str | None = None
    """PEM CA bundle to verify the syncer's certificate; setting it (or ``tls_cert``) turns
    TLS on."""
    tls_cert: str | None = None
    """PEM client certificate for mutual TLS (with ``tls_key``)."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""

    def __post_init__(self) -> None:
        if self.fragments < 1 or self.sync_every < 1:
            raise ValueError(
                f"fragments and sync_every must be >= 1 (got {self.fragments}, {self.sync_every})"
            )
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(
                f"alpha must be in [0, 1) (got {self.alpha}); 0 overwrites with the global value"
            )


class Learner:
    """Wraps a model whose parameters are trained by the user's own optimizer.

    ``step`` is called once per inner optimizer step, after ``optimizer.step()``. It never
    waits for the network: it applies fragments that have arrived, advances the counters and
    queues due fragments for a background thread. If the syncer refused this learner (model
    mismatch, authentication) the next ``step`` raises ``RuntimeError`` with the reason.

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
        cfg = config or LearnerConfig(**overrides)
        if config is not None and overrides:
            raise ValueError("pass either config= or keyword overrides, not both")
        self.config = cfg
        self.model = model
        self.optimizer = optimizer
        self.params = dict(model.named_parameters())
        first = next(iter(self.params.values()), None)
        if first is None:
            raise ValueError("the model has no parameters")
        if cfg.cpu_threads and first.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        self.layout = layout or balanced_fragments(model.named_parameters(), cfg.fragments)
        if self.layout.num_fragments != cfg.fragments:
            raise ValueError(
                f"layout has {self.layout.num_fragments} fragments, config says {cfg.fragments}"
            )
        P = self.layout.num_fragments
        self.learner_id = cfg.learner_id or _default_id()
        self.local_step = 0
        self.total_tokens = 0
        self.anchors: list[torch.Tensor | None] = [None] * P
        self.versions = [-1] * P
        self.steps_since = [0] * P
        self.tokens_since = [0] * P
        self.applied = 0
        self.last_applied: list[int] = []  # fragments changed by the last apply_arrived()
        self._arrived: dict[int, tuple[int, torch.Tensor, frozenset[str]]] = {}
        # Latest delta queued per fragment, the counters it covered and whether a foreign
        # rebase already took it out of the anchor; forgotten once a merge that includes it
        # is applied.
        self._sent: dict[int, InFlight] = {}
        # Fragments sent and not yet merged back: p -> (local step sent at, base version).
        self._awaited: dict[int, tuple[int, int]] = {}
        self._arrived_lock = threading.Lock()
        # Fragments whose upload the syncer's norm guard refused; reset at the next boundary.
        self._guard_refused: set[int] = set()
        self.guard_resets = 0
        """Fragments reset to the global value after a norm-guard refusal (``_reset``)."""
        self._step_time: float | None = None
        self._last_step_at: float | None = None
        self._state = "starting"
        self._closed = False
        self._flushed: dict[int, int] = {}
        self.close_report: dict = {}
        """What ``close`` did: fragments flushed, whether the uploads went out and the merges
        holding them came back in time (``drained``), and the fragments that did not."""
        # fragment -> newest applied version whose merge included this learner
        self._merged_in: dict[int, int] = {}
        self.delivery = DeliveryLog(cfg.delivery_file) if cfg.delivery_file else None
        self.dropped_on_restore: list[int] = []
        """Fragments whose checkpointed progress was found delivered already at restore."""
        if state is not None:
            self.load_state_dict(state)
            if self.delivery is not None:
                self._drop_delivered(self.delivery.read())
        elif self.delivery is not None:
            self.delivery.clear()
        options = client_link_options(
            token=cfg.token, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
        )
        options.update(link_options or {})
        self.link = open_link(
            syncer,
            self.learner_id,
            self.layout,
            on_fragment=self._on_fragment,
            have_versions=self._have_versions,
            heartbeat_info=self._heartbeat_info,
            on_accepted=self._on_accepted if self.delivery is not None else None,
            on_guard_refused=self._on_guard_refused,
            **options,
        )

    # ----------------------------------------------------------------- public
    def step(self, tokens: int) -> list[int]:
        """Record one inner step of ``tokens`` tokens; returns the fragments queued for upload."""
        if self._closed:
            raise RuntimeError("step() after close()")
        if self.link.error is not None:
            raise RuntimeError(str(self.link.error))
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
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
        due = [
            p
            for p in due_fragments(self.local_step, self.config.sync_every, self.config.fragments)
            if self.versions[p] >= 0
        ]
        for p in due:
            self._queue(p)
        self.apply_arrived()
        return due

    def apply_arrived(self) -> int:
        """Apply every fragment that has arrived since the last call; returns how many.

        A merge of other learners' contributions only is a *rebase* (``rebase_foreign``): the
        local progress since the anchor is kept on top of the new value, and so are the
        counters; a delta still in flight is taken out of the next one (its progress is on
        its way to the syncer already). A merge that includes this learner's in-flight delta
        keeps what was trained after that delta was queued (``rebase_own``). Otherwise (or
        with both off) the paper's rule: overwrite (or α-mix), anchor and counters reset.
        A fragment whose upload the syncer's norm guard refused goes back to the global value
        first (``_reset``).
        """
        with self._arrived_lock:
            arrived, self._arrived = self._arrived, {}
            refused, self._guard_refused = self._guard_refused, set()
        self.last_applied = []
        with torch.no_grad():
            for p in sorted(refused):
                if self._reset(p):
                    self.last_applied.append(p)  # an island sends it to its other ranks
            for p, (version, value, contributors) in sorted(arrived.items()):
                if version <= self.versions[p]:
                    continue
                if p not in self.last_applied:
                    self.last_applied.append(p)
                if self.learner_id in contributors:
                    self._merged_in[p] = version
                    self._apply_own(p, value)
                else:
                    self._apply_foreign(p, value)
                self.versions[p] = version
                self.applied += 1
        return len(self.last_applied)

    def _apply_foreign(self, p: int, value: torch.Tensor) -> None:
        anchor = self.anchors[p]
        if anchor is None or not self.config.rebase_foreign:
            self._overwrite(p, value)
            return
        # value + (local − anchor): exactly the new value when there is no local progress
        # (a finished learner ends with the syncer's parameters).
        progress = self.layout.gather(p, self.params).sub_(anchor)
        in_flight = self._sent.get(p)
        if in_flight is not None and in_flight.rebased:
            progress.sub_(in_flight.delta)  # the anchor excludes it: put it back in
        self.layout.scatter(p, progress.add_(value), self.params)
        if in_flight is None:
            self.anchors[p] = value
            return
        self.anchors[p] = value - in_flight.delta
        if not in_flight.rebased:
            self._take_off_counters(p, in_flight)
            self._sent[p] = in_flight._replace(rebased=True)

    def _apply_own(self, p: int, value: torch.Tensor) -> None:
        anchor = self.anchors[p]
        in_flight = self._sent.pop(p, None)
        if anchor is None or in_flight is None or not self.config.rebase_own:
            self._overwrite(p, value)
            return
        if not in_flight.rebased:
            self._take_off_counters(p, in_flight)
        if self.steps_since[p] == 0:  # nothing trained since δ was queued: exactly Θ
            self._overwrite(p, value)
            return
        after = self.layout.gather(p, self.params).sub_(anchor)  # θ − A
        if not in_flight.rebased:
            after.add_(in_flight.delta)  # θ − (A − δ): what came after δ
        self.layout.scatter(p, after.add_(value), self.params)
        self.anchors[p] = value

    def _reset(self, p: int) -> bool:
        """After the syncer's norm guard refused a delta of ``p``: back to the global value
        this learner holds, counters 0. The delta only grows while it is refused (nothing
        merged moves the anchor), so without this an honest learner whose delta once looked
        too large (a fragment not synced for many steps) would never be accepted again; a
        learner with corrupt values is brought back the same way. The fragment's local
        progress since the anchor is lost, once. Returns whether ``p`` changed."""
        if self.anchors[p] is None:
            return False
        value = self.anchors[p].clone()
        in_flight = self._sent.get(p)
        if in_flight is not None and in_flight.rebased:
            value.add_(in_flight.delta)  # a rebased anchor excludes the delta in flight
        self.layout.scatter(p, value, self.params)
        self.anchors[p] = value
        self.steps_since[p] = 0
        self.tokens_since[p] = 0
        self._sent.pop(p, None)
        self._awaited.pop(p, None)
        self.guard_resets += 1
        return True

    def _on_guard_refused(self, job: UploadJob) -> None:
        with self._arrived_lock:
            self._guard_refused.add(job.fragment)

    def _take_off_counters(self, p: int, in_flight: InFlight) -> None:
        self.steps_since[p] = max(0, self.steps_since[p] - in_flight.steps)
        self.tokens_since[p] = max(0, self.tokens_since[p] - in_flight.tokens)

    def _overwrite(self, p: int, value: torch.Tensor) -> None:
        """The paper's rule: θ_p ← Θ_p (α = 0) or αθ_p + (1−α)Θ_p; anchor Θ, counters 0."""
        alpha = self.config.alpha
        if alpha == 0.0 or self.anchors[p] is None:
            self.layout.scatter(p, value, self.params)
        else:
            mixed = self.layout.gather(p, self.params).mul_(alpha).add_(value, alpha=1 - alpha)
            self.layout.scatter(p, mixed, self.params)
        self.anchors[p] = value
        self.steps_since[p] = 0
        self.tokens_since[p] = 0
        self._sent.pop(p, None)

    def wait_for_global(self, timeout: float = 60.0) -> bool:
        """Block until this learner holds every fragment at least at the version the syncer had
        when it joined, and apply them; True if so within ``timeout``.

        Call it once before training: a fresh learner then starts from the global model, and
        one restored from a checkpoint catches up before it sends (instead of sending deltas
        against versions the syncer has moved past, which it would refuse as too stale).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.link.error is not None:
                raise RuntimeError(str(self.link.error))
            target = self.link.joined_versions
            have = self._have_versions()
            if target is not None and all(
                h >= max(t, 0) for h, t in zip(have, target, strict=False)
            ):
                self.apply_arrived()
                return True
            if time.monotonic() > deadline:
                self.apply_arrived()
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

    def flush(self, timeout: float | None = None) -> bool:
        """Queue every fragment with progress since it was received and wait for the uploads.

        Used on a clean stop or a preemption notice (SIGTERM) so no finished work is lost.
        A fragment whose last queued delta already holds all its progress (no step since it
        was queued, typically the one the last step queued) is not sent again: a second copy
        could land in a later round and count that progress twice. Returns True if everything
        went out within ``timeout``.
        """
        self._flushed = {}
        for p in range(self.layout.num_fragments):
            if self.versions[p] < 0 or self.steps_since[p] == 0:
                continue
            queued = self._sent.get(p)
            if queued is None or queued.rebased or queued.steps != self.steps_since[p]:
                self._queue(p)
            self._flushed[p] = self.versions[p]
        return self.link.wait_idle(self.config.flush_timeout_s if timeout is None else timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every fragment sent by the last ``flush`` has come back in the merge that
        holds it, applying what arrives. Returns True if all did within ``timeout`` (bounded,
        never hangs). The merge that holds the flushed delta is the first one that includes
        this learner at a version above the one the syncer had when it admitted the upload:
        a newer version merged from other learners' work only, or one holding this learner's
        *earlier* upload of the fragment, does not count.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.apply_arrived()
            pending = self._undrained()
            if not pending or time.monotonic() >= deadline or not self.link.connected.is_set():
                break
            time.sleep(0.02)
        return not pending

    def _undrained(self) -> list[int]:
        """Flushed fragments whose merge holding the flushed upload has not been applied."""
        admitted = self.link.admitted  # version at admission of each last upload
        return [
            p
            for p in sorted(self._flushed)
            if self._merged_in.get(p, -1) <= admitted.get(p, self._flushed[p] - 1)
        ]

    def close(self, *, flush: bool = True) -> None:
        """Optionally flush, leave the syncer and stop the background threads (bounded)."""
        if self._closed:
            return
        if flush and self.link.connected.is_set():
            t0 = time.monotonic()
            flushed = self.flush()
            t1 = time.monotonic()
            drained = self.config.drain_timeout_s > 0 and self.drain(self.config.drain_timeout_s)
            self.close_report = {
                "flushed": len(self._flushed),
                "flush_ok": flushed,
                "flush_s": round(t1 - t0, 3),
                "drained": drained,
                "drain_s": round(time.monotonic() - t1, 3),
                "undrained": self._undrained(),
            }
        self._state = "closed"
        self._closed = True
        self.link.close()

    def state_dict(self) -> dict:
        """What a restarted learner needs to carry on: anchors, versions, counters, step.

        Save it with the model and the inner optimizer (``torch.save``; load with
        ``weights_only=True``) and pass it back as ``Learner(..., state=...)``: the learner
        then resubscribes with these versions and only receives fragments that moved on.
        """
        return {
            "local_step": self.local_step,
            "total_tokens": self.total_tokens,
            "versions": list(self.versions),
            "steps_since": list(self.steps_since),
            "tokens_since": list(self.tokens_since),
            "anchors": [a.clone() if a is not None else torch.empty(0) for a in self.anchors],
            "layout_hash": self.layout.hash,
        }

    def _drop_delivered(self, accepted_at: dict[int, int]) -> None:
        """Parameters back to the anchor and counters to 0 for every fragment whose
        checkpointed progress an accepted upload carried after the checkpoint."""
        with torch.no_grad():
            for p in already_delivered(accepted_at, self.local_step, self.steps_since):
                if self.anchors[p] is None:
                    continue
                self.layout.scatter(p, self.anchors[p], self.params)
                self.steps_since[p] = 0
                self.tokens_since[p] = 0
                self.dropped_on_restore.append(p)

    def _on_accepted(self, job: UploadJob) -> None:
        try:
            self.delivery.record(job.fragment, job.local_step)
        except OSError as exc:  # a full disk must not stop training; a restore may resend
            log.warning("delivery log %s: %s", self.delivery.path, exc)

    def load_state_dict(self, state: dict) -> None:
        if state.get("layout_hash") != self.layout.hash:
            raise ValueError("this learner state belongs to another model or fragmentation")
        P = self.layout.num_fragments
        if len(state["versions"]) != P or len(state["anchors"]) != P:
            raise ValueError(f"learner state has {len(state['versions'])} fragments, expected {P}")
        self.local_step = int(state["local_step"])
        self.total_tokens = int(state["total_tokens"])
        self.versions = [int(v) for v in state["versions"]]
        self.steps_since = [int(v) for v in state["steps_since"]]
        self.tokens_since = [int(v) for v in state["tokens_since"]]
        self.anchors = [
            a.clone() if v >= 0 and a.numel() == self.layout.fragments[p].numel else None
            for p, (a, v) in enumerate(zip(state["anchors"], self.versions, strict=True))
        ]
        self.versions = [
            v if self.anchors[p] is not None else -1 for p, v in enumerate(self.versions)
        ]

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
            "stale_replies": s.stale_replies,
            "uploads_failed": s.uploads_failed,
            **({"close": self.close_report} if self.close_report else {}),
        }

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    # --------------------------------------------------------------- internal
    def _queue(self, p: int) -> None:
        anchor = self.anchors[p]
        if anchor is None:
            return
        delta = anchor - self.layout.gather(p, self.params)
        self._sent[p] = InFlight(delta, self.steps_since[p], self.tokens_since[p])
        self._awaited.setdefault(p, (self.local_step, self.versions[p]))
        self.link.submit(
            UploadJob(
                p,
                self.versions[p],
                self.steps_since[p],
                self.tokens_since[p],
                delta,
                self._step_time or 0.0,
                self.local_step,
            )
        )

    def _on_fragment(
        self, fragment: int, version: int, value: torch.Tensor, contributors=frozenset()
    ) -> None:
        with self._arrived_lock:
            current = self._arrived.get(fragment)
            if current is not None:  # superseded before it was applied: keep who it merged
                contributors = frozenset(contributors) | current[2]
            if current is None or current[0] < version:
                self._arrived[fragment] = (version, value, frozenset(contributors))

    def _have_versions(self) -> list[int]:
        with self._arrived_lock:
            pending = {p: v for p, (v, _, _) in self._arrived.items()}
        return [max(v, pending.get(p, -1)) for p, v in enumerate(self.versions)]

    def _heartbeat_info(self) -> dict:
        sps = 1.0 / self._step_time if self._step_time else 0.0
        return {
            "step": self.local_step,
            "tokens": self.total_tokens,
            "steps_per_s": sps,
            "state": self._state,
        }


def _default_id() -> str:
    import os
    import socket

    return f"{socket.gethostname()[:40]}-{os.getpid()}"

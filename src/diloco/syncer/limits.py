"""What one caller may hold of the syncer's threads: stream limits and stream deadlines.

Every ``Upload`` and ``Subscribe`` stream holds one of the gRPC pool's threads for as long
as it lasts. Without limits a token holder could open enough of them (or streams that never
send their first chunk) to fill the pool, and honest ``Join`` calls would wait forever. The
syncer therefore

* caps the streams open at once, per kind, overall and per caller (:class:`StreamLimits`): a
  call over a cap is refused at once with ``RESOURCE_EXHAUSTED`` and holds no thread, and the
  pool is sized so that the caps leave room for the short calls (join, heartbeat, status);
* lets a learner's newer subscription take its older one's place: the older one is closed,
  its place given back at once and its call cancelled (a handler blocked in a send on a dead
  connection ends too), so a learner back from a vanished VM is never locked out by its
  own half-open stream;
* cancels an upload whose first chunk has not arrived within ``FIRST_CHUNK_S``, or that is
  still arriving when its size at ``MIN_UPLOAD_BPS`` would have been done
  (``diloco.runtime.watchdog.Watchdog``, one thread for all deadlines).

A caller (:class:`Caller`) is its learner id when it presented its own token
(``diloco.wire.auth``). A call made with the shared token names no one the syncer can trust,
so it counts against its TCP connection and its remote address: one peer cannot hold more
than ``UPLOADS_PER_CONNECTION`` uploads per connection nor ``ADDRESS_SHARE`` of a cap per
address, while several learners behind one address (one host, a NAT) still fit.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

from diloco.wire.protocol import FIRST_CHUNK_S, MIN_UPLOAD_BPS  # noqa: F401 (re-exported)

UPLOADS_PER_LEARNER = 4
"""Uploads one learner (identified by its own token) may have open at once."""
SUBSCRIPTIONS_PER_LEARNER = 1
"""Subscribe streams one learner may have open at once: a newer one takes the older one's
place (the service ends the older one, see the module docstring)."""
UPLOADS_PER_CONNECTION = 8
"""Uploads one TCP connection may have open at once when its calls carry no learner's own
token. A learner sends its uploads one at a time on its control connection (up to
``UPLOADS_PER_LEARNER`` while unanswered ones it sends again are still open here), and the
learners of one process share that connection (gRPC's subchannel pool)."""
SUBSCRIPTIONS_PER_CONNECTION = 2
"""Subscribe streams one such connection may have open: a learner subscribes on a connection
of its own (``SyncerLink._open_channel``), and its newer subscription replaces the older."""
ADDRESS_SHARE = 0.5
"""The share of each overall cap that one remote address may hold when its calls carry no
learner's own token (at least what one connection may): learners behind one address (several
on one host, a site behind a NAT) have one subscription and about one upload open each, so
up to half of ``max_learners`` of them work from one address, and the other half of every
cap stays for everyone else."""
SHORT_CALL_THREADS = 16
"""Pool threads kept for the short calls beyond the stream caps."""
DEFAULT_MAX_LEARNERS = 64
"""Learners a syncer is sized for unless told otherwise (``SyncerServer(max_learners=...)``,
``diloco syncer --max-learners``): its stream caps and thread pool."""


class LimitExceeded(Exception):
    """A stream over its cap; the message says which."""


@dataclass(frozen=True)
class Caller:
    """Whom a stream counts against: ``learner``, the id of the call's own token, else (the
    shared token) its TCP connection ``peer`` (gRPC's ``ipv4:1.2.3.4:5678``) and the
    connection's remote address."""

    peer: str
    learner: str | None = None

    @property
    def address(self) -> str:
        return self.peer.rsplit(":", 1)[0]

    def scopes(self) -> tuple[tuple[str, str], ...]:
        """The ``(scope, key)`` pairs whose caps apply: the learner's own id alone (its
        token isolates it), else its connection and its address."""
        if self.learner:
            return (("learner", self.learner),)
        return (("connection", self.peer), ("address", self.address))


def stream_limits(max_learners: int) -> StreamLimits:
    """The stream caps of a syncer sized for ``max_learners``: that many uploads and that
    many subscriptions (+8 for observers) at once; per learner ``UPLOADS_PER_LEARNER`` and
    ``SUBSCRIPTIONS_PER_LEARNER``; per connection ``UPLOADS_PER_CONNECTION`` and
    ``SUBSCRIPTIONS_PER_CONNECTION``; per address ``ADDRESS_SHARE`` of each cap."""
    caps = {"upload": max_learners, "subscribe": max_learners + 8}
    connection = {"upload": UPLOADS_PER_CONNECTION, "subscribe": SUBSCRIPTIONS_PER_CONNECTION}
    return StreamLimits(
        caps,
        {
            "learner": {"upload": UPLOADS_PER_LEARNER, "subscribe": SUBSCRIPTIONS_PER_LEARNER},
            "connection": connection,
            "address": {k: max(connection[k], int(c * ADDRESS_SHARE)) for k, c in caps.items()},
        },
    )


class StreamSlot:
    """One open stream's place under the caps. ``release`` gives it back; only the first call
    counts, so a newer stream may release an older one's place while the older one's
    handler still runs (it releases nothing more when it ends)."""

    def __init__(self, limits: StreamLimits, kind: str, keys: tuple) -> None:
        self._limits, self.kind, self.keys = limits, kind, keys
        self.held = True

    def release(self) -> None:
        self._limits.release(self)


class StreamLimits:
    """Counts open streams per kind, overall and per caller scope, under its own lock."""

    def __init__(self, caps: dict[str, int], per_scope: dict[str, dict[str, int]]) -> None:
        """``caps``: streams of each kind open at once overall; ``per_scope``: for each scope
        of a :class:`Caller` (``learner``, ``connection``, ``address``), the streams of each
        kind one key of that scope may have open (a kind not named: no cap)."""
        self.caps, self.per_scope = dict(caps), {k: dict(v) for k, v in per_scope.items()}
        self._open: Counter[tuple[str, str, str]] = Counter()
        self._total: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, kind: str, caller: Caller) -> StreamSlot:
        """A place for one ``kind`` stream of ``caller``; raises ``LimitExceeded`` (nothing
        held) when a cap is reached."""
        keys = tuple((kind, scope, key) for scope, key in caller.scopes())
        with self._lock:
            if self._total[kind] >= self.caps[kind]:
                raise LimitExceeded(
                    f"the syncer has {self._total[kind]} {kind} streams open, its cap"
                )
            for _, scope, key in keys:
                cap = self.per_scope.get(scope, {}).get(kind, 0)
                if cap and self._open[(kind, scope, key)] >= cap:
                    raise LimitExceeded(
                        f"{scope} {key!r} already has {cap} {kind} stream(s) open, its cap"
                    )
            self._total[kind] += 1
            for k in keys:
                self._open[k] += 1
        return StreamSlot(self, kind, keys)

    @contextmanager
    def hold(self, kind: str, caller: Caller):
        """Hold a place (``take``) while the block runs."""
        slot = self.take(kind, caller)
        try:
            yield slot
        finally:
            slot.release()

    def release(self, slot: StreamSlot) -> None:
        """Give back ``slot``'s place under the caps; a slot released already gives back
        nothing (``StreamSlot.release`` is the usual way to call it)."""
        with self._lock:
            if not slot.held:
                return
            slot.held = False
            self._total[slot.kind] -= 1
            for k in slot.keys:
                self._open[k] -= 1
                if not self._open[k]:
                    del self._open[k]

    def open(self, kind: str) -> int:
        with self._lock:
            return self._total[kind]

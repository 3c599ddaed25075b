"""One run's live outputs together: its watch, its dashboard server and its scalar sinks
(TensorBoard, Weights & Biases).

The caller's loop (the supervisor of ``diloco run``, or the syncer process) calls
:meth:`LiveOutputs.update` with its learner rows as often as it likes; the snapshot is rebuilt
at most every ``every_s`` seconds and the scalars written every ``scalars_every_s``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from diloco.dashboard.watch import RunWatch


class LiveOutputs:
    """``watch`` (built later with :meth:`begin` when the run's time origin is not known yet),
    an optional ``server`` (``DashboardServer``) and the ``scalars`` sinks (``ScalarLog``,
    ``WandbLog``: each has ``write(snapshot)`` and ``close()``)."""

    def __init__(
        self,
        watch: RunWatch | None = None,
        *,
        server=None,
        scalars: Sequence = (),
        every_s: float = 1.0,
        scalars_every_s: float = 5.0,
    ) -> None:
        self.watch = watch
        self.server = server
        self.scalars = list(scalars)
        self.every_s = every_s
        self.scalars_every_s = scalars_every_s
        self._built_at = float("-inf")
        self._written_at = float("-inf")
        self._rows: Sequence[Mapping] = ()

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def begin(self, watch: RunWatch) -> None:
        """Start following ``watch`` (the page shows 'starting' until then)."""
        self.watch = watch

    def snapshot(self) -> dict:
        """The latest snapshot, or an empty one before :meth:`begin`."""
        if self.watch is None:
            return EMPTY
        return self.watch.snapshot()

    def update(
        self, rows: Sequence[Mapping], *, force: bool = False, now: float | None = None
    ) -> None:
        """Rebuild the snapshot from ``rows`` if ``every_s`` passed (or ``force``) and write
        the scalars if ``scalars_every_s`` passed (or ``force``). ``now``: the time the
        snapshot is of (default: the clock)."""
        self._rows = rows
        now = time.time() if now is None else now
        if self.watch is None or (not force and now - self._built_at < self.every_s):
            return
        self._built_at = now
        snap = self.watch.update(rows, now)
        if self.scalars and (force or now - self._written_at >= self.scalars_every_s):
            self._written_at = now
            for sink in self.scalars:
                sink.write(snap)

    def close(self, rows: Sequence[Mapping] | None = None, *, end: float | None = None) -> None:
        """A last update (from ``rows``, else the rows of the last update; as of ``end``, when
        training stopped, so that its goodput is the summary's), then close the scalars and
        stop serving. Safe to call twice."""
        try:
            if self.watch is not None:
                self.update(self._rows if rows is None else rows, force=True, now=end)
        finally:
            for sink in self.scalars:
                sink.close()
            if self.server is not None:
                self.server.stop()
            self.watch = None


EMPTY = {
    "name": "",
    "mode": "starting",
    "t": 0.0,
    "elapsed_s": 0.0,
    "budget_s": None,
    "tokens": 0,
    "learners": [],
    "rounds": {
        "total": 0,
        "per_s": 0.0,
        "contributors": {"histogram": {}, "mean": None, "at_least_3": None},
    },
    "versions": [],
    "goodput": None,
    "loss": [],
    "loss_unit": "nats/byte",
    "scores": {},
    "timeline": {"bin_s": 5.0, "points": []},
    "markers": [],
    "bytes": {"up": 0, "down": 0},
}
"""The snapshot before the run's processes start."""

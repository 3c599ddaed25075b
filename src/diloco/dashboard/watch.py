"""What a run looks like now: one snapshot, built from its files and its live learner rows.

:class:`RunWatch` follows the event tape, the held-out metrics (``metrics.jsonl``) and the
learners' progress records as they grow (``diloco.report.tally``: the same bookkeeping the
run's summary uses) and, on every :meth:`RunWatch.update`, combines them with the rows the
caller knows live (each learner's state as its supervisor or the syncer sees it) into a
snapshot: a plain JSON-able dict that the dashboard page, the Prometheus metrics and the
TensorBoard scalars are all drawn from.

Snapshot keys (times ``t`` are seconds since ``started``):

- ``name``, ``mode``, ``elapsed_s``, ``budget_s`` (None: no time budget), ``tokens``;
- ``learners``: per learner ``id``, ``state``, ``live``, ``step``, ``tokens``,
  ``tokens_per_s``, ``steps_per_s``, ``contributions`` (committed rounds it was merged in),
  ``last_contribution_s`` (seconds ago, None: never), ``bytes_up``, ``bytes_down``,
  ``restarts``;
- ``rounds``: ``total``, ``per_s`` (over the last ``RATE_WINDOW_S``), ``contributors``
  (histogram, mean, share with at least 3), ``recent_contributors`` (mean over the window);
- ``versions``: each fragment's committed version;
- ``goodput``: ``goodput``, ``down_share``, ``goodput_up`` so far (None before any learner
  joined);
- ``loss``: ``[[t, held-out loss, tokens], ...]`` in ``loss_unit``; ``scores``: the
  evaluator's latest other held-out measures (e.g. ``{"accuracy": 0.95}``); ``timeline``: ``bin_s`` and
  ``points`` ``[[t, commits/s, mean contributors], ...]``; ``markers``: failures, restarts and
  rejoins ``{"t", "kind", "target"}``;
- ``bytes``: ``up``, ``down`` (every learner's transport).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from diloco.report.summary import contributors_summary
from diloco.report.tally import JsonlFollower, ProgressTally, TapeTally

RATE_WINDOW_S = 10.0
"""Rounds per second and recent contributors are measured over this many seconds."""
MAX_POINTS = 600
"""At most this many timeline points and markers in one snapshot (older bins are merged)."""
LIVE_RATE_S = 5.0
"""A learner's tokens/s is measured over windows of at least this many seconds (its token
count arrives with its heartbeats, about once a second: shorter windows jitter)."""


class RunWatch:
    """Follows one run's files and builds its snapshot (module docstring).

    ``tape``: the event tape; ``metrics``: the held-out metrics file (None: no evaluator);
    ``progress``: each learner's progress file (None: progress is sampled from the rows
    given to :meth:`update`, as a standalone syncer must); ``started``: the time origin
    (epoch seconds); ``fragments``: P, for the useful-token measure.

    Thread-safe: one thread calls :meth:`update`, any thread may read :meth:`snapshot`.
    """

    def __init__(
        self,
        *,
        tape: str | Path,
        fragments: int,
        started: float,
        mode: str = "decoupled",
        name: str = "",
        budget_s: float | None = None,
        metrics: str | Path | None = None,
        progress: Mapping[str, str | Path] | None = None,
        loss_unit: str = "nats/byte",
    ) -> None:
        self.mode, self.name, self.started, self.budget_s = mode, name, started, budget_s
        self.loss_unit = loss_unit
        self.scores: dict[str, float] = {}  # the evaluator's latest other measures
        self.tape = TapeTally(fragments)
        self._tape_follower = JsonlFollower(tape)
        self._metrics_follower = JsonlFollower(metrics) if metrics else None
        self._progress_followers = {k: JsonlFollower(v) for k, v in (progress or {}).items()}
        self.progress: dict[str, ProgressTally] = {k: ProgressTally() for k in progress or {}}
        self._sampled = progress is None
        self.loss: list[list[float]] = []
        self._rates: dict[str, tuple[float, int, float]] = {}  # id -> (t0, tokens0, rate)
        self._lock = threading.Lock()
        self._snapshot: dict = self._build([], started)

    def snapshot(self) -> dict:
        """The latest snapshot (do not modify it)."""
        with self._lock:
            return self._snapshot

    def update(self, rows: Sequence[Mapping], now: float | None = None) -> dict:
        """Read what the files gained, merge ``rows`` (per learner at least ``id``, ``step``,
        ``tokens``, ``state``; optionally ``live``, ``steps_per_s``, ``bytes_up``,
        ``bytes_down``) and return the new snapshot."""
        now = time.time() if now is None else now
        for record in self._tape_follower.poll():
            self.tape.add(record)
        if self._metrics_follower is not None:
            for m in self._metrics_follower.poll():
                if m.get("val_loss") is not None:
                    self.loss.append([m["t"], m["val_loss"], m.get("tokens") or 0])
                self.scores.update(
                    {k[4:]: v for k, v in m.items() if k.startswith("val_") and k != "val_loss"}
                )
        for learner, follower in self._progress_followers.items():
            for record in follower.poll():
                self.progress[learner].add(record)
        if self._sampled:
            for row in rows:
                self.progress.setdefault(row["id"], ProgressTally()).add(
                    {"t": now, "step": row["step"], "tokens": row["tokens"]}
                )
        snap = self._build(rows, now)
        with self._lock:
            self._snapshot = snap
        return snap

    # ------------------------------------------------------------------ building
    def _build(self, rows: Sequence[Mapping], now: float) -> dict:
        learners = [self._learner(row, now) for row in rows]
        return {
            "name": self.name,
            "mode": self.mode,
            "t": now,
            "elapsed_s": round(now - self.started, 3),
            "budget_s": self.budget_s,
            "tokens": sum(ln["tokens"] for ln in learners),
            "learners": learners,
            "rounds": self._rounds(now),
            "versions": [self.tape.versions.get(p, 0) for p in range(self.tape.fragments)],
            "goodput": self._goodput(now),
            "loss": self.loss[-MAX_POINTS:],
            "loss_unit": self.loss_unit,
            "scores": dict(self.scores),
            "timeline": self._timeline(),
            "markers": [{**m, "t": round(m["t"] - self.started, 3)} for m in self.tape.markers][
                -MAX_POINTS:
            ],
            "bytes": {
                "up": sum(ln["bytes_up"] for ln in learners),
                "down": sum(ln["bytes_down"] for ln in learners),
            },
        }

    def _learner(self, row: Mapping, now: float) -> dict:
        learner = row["id"]
        tally = self.progress.get(learner)
        latest = tally.latest if tally is not None and not self._sampled else {}
        last = self.tape.last_contribution.get(learner)

        def counter(key: str) -> int:
            if tally is not None and not self._sampled:
                return tally.transport_total(key)
            return int(row.get(key, 0))

        return {
            "id": learner,
            "state": row["state"],
            "live": bool(row.get("live", row["state"] not in ("starting", "finished"))),
            "step": int(row["step"]),
            "tokens": int(row["tokens"]),
            "tokens_per_s": self._rate(learner, now, int(row["tokens"])),
            "steps_per_s": float(row.get("steps_per_s") or latest.get("steps_per_s") or 0.0),
            "contributions": self.tape.contributions.get(learner, 0),
            "last_contribution_s": None if last is None else round(max(0.0, now - last), 2),
            "bytes_up": counter("bytes_up"),
            "bytes_down": counter("bytes_down"),
            "restarts": sum(
                1 for m in self.tape.markers if m["kind"] == "restart" and m["target"] == learner
            ),
        }

    def _rate(self, learner: str, now: float, tokens: int) -> float:
        """Tokens/s over windows of at least ``LIVE_RATE_S`` (0 until the first window)."""
        t0, tok0, rate = self._rates.get(learner, (now, tokens, 0.0))
        if tokens < tok0:  # restarted from an earlier checkpoint
            t0, tok0 = now, tokens
        if now - t0 >= LIVE_RATE_S:
            rate = max(0.0, (tokens - tok0) / (now - t0))
            t0, tok0 = now, tokens
        self._rates[learner] = (t0, tok0, rate)
        return round(rate, 1)

    def _rounds(self, now: float) -> dict:
        times = self.tape.commit_times
        recent = 0
        for t in reversed(times):  # the tape is (nearly) in time order
            if t < now - RATE_WINDOW_S:
                break
            recent += 1
        return {
            "total": self.tape.rounds,
            "per_s": round(recent / RATE_WINDOW_S, 3),
            "contributors": contributors_summary(self.tape.contributors),
        }

    def _goodput(self, now: float) -> dict | None:
        if self.mode == "dp":
            from diloco.report.dp_metrics import dp_goodput

            if not self.progress:
                return None
            g = dp_goodput(self.progress, end=now, chaos=self.tape.chaos)
        else:
            if not self.tape.joins:
                return None
            rates = {m: t.busy_rate or t.speed for m, t in self.progress.items()}
            if not any(rates.values()):  # no speed measured yet: unknown, not zero
                return None
            g = self.tape.goodput(now, rates)
        return {k: g.get(k) for k in ("goodput", "down_share", "goodput_up")}

    def _timeline(self) -> dict:
        """Commits per second and mean learners per round in bins (empty bins are zeros),
        merged so that at most ``MAX_POINTS`` remain."""
        cells = self.tape.timeline
        span = max(cells, default=-1) + 1
        merge = max(1, -(-span // MAX_POINTS))
        groups = [[0, 0] for _ in range(-(-span // merge))]
        for index, (commits, merged) in cells.items():
            groups[index // merge][0] += commits
            groups[index // merge][1] += merged
        width = self.tape.bin_s * merge
        offset = (self.tape.start or self.started) - self.started
        points = [
            [round(offset + (g + 0.5) * width, 2), round(c / width, 3), round(m / c, 3) if c else 0]
            for g, (c, m) in enumerate(groups)
        ]
        return {"bin_s": width, "points": points}

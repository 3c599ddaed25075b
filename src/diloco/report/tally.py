"""Running tallies of a run's files, kept one record at a time.

The summary at the end of a run, the live dashboard, the Prometheus metrics and the
TensorBoard scalars all read the same two kinds of record: the syncer's event tape and each
learner's progress records. :class:`TapeTally` and :class:`ProgressTally` are the one
bookkeeping of both: a reader feeds them records as they appear (:class:`JsonlFollower`
reads only what was appended since it last looked), and every measure is computed from them
(the definitions are in ``diloco.report.goodput``). Memory grows by one float per committed
round (its time, for the commit gaps) and a few bytes per progress record; everything else is
a sum, a counter or a short list (failures, restarts).
"""

from __future__ import annotations

import os
import statistics
from array import array
from collections import Counter, defaultdict

from diloco.report.goodput import commit_gaps, schedule_down, time_goodput, uptime
from diloco.runtime.jsonl import parse_lines


class JsonlFollower:
    """Reads the records appended to a JSON-lines file since the last :meth:`poll`.

    A missing file reads as empty until it appears; a line not yet ended by a newline waits
    for the rest; a line that is not a JSON object (torn by a kill) is skipped; a file that
    shrank (replaced) is read again from the start.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._partial = b""

    def poll(self, max_bytes: int = 64 << 20) -> list[dict]:
        """The complete new records, in order (at most about ``max_bytes`` read per call)."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                data = f.read(max_bytes)
        except OSError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return parse_lines(lines)


COUNTERS = ("bytes_up", "bytes_down", "clipped")
"""Progress-record counters that restart at 0 with every incarnation of a learner."""


class ProgressTally:
    """One learner's progress records (``progress.jsonl``), or samples of its status.

    Consecutive records of one incarnation (neither an ``event`` record) give a speed sample
    (tokens per wall second) and, where both carry ``busy_s``, busy tokens and seconds (and
    of those, where both carry ``reduce_s``, the seconds in data-parallel's all-reduce). The
    transport's byte counters restart at 0 with every incarnation; their totals add up the
    incarnations.
    """

    def __init__(self) -> None:
        self.last: dict | None = None
        self.latest: dict = {}
        """Every key's most recent value (``step``, ``tokens``, ``steps_per_s``, ...)."""
        self.speeds = array("d")
        self.first_start: float | None = None
        """Time of its earliest ``start`` event record (data-parallel ranks write one)."""
        self._busy_tokens = 0.0
        self._busy_s = 0.0
        self._reduce_s = 0.0
        self._reduce_busy_s = 0.0  # the busy seconds of the intervals that carry reduce_s
        # per incarnation counters: [sum of the finished incarnations, the current one]
        self._counters = {key: [0, 0] for key in COUNTERS}

    def add(self, rec: dict) -> None:
        prev, self.last = self.last, rec
        self.latest.update(rec)
        if rec.get("event") == "start" and "t" in rec:
            t = rec["t"]
            self.first_start = t if self.first_start is None else min(self.first_start, t)
        for key, (done, now) in self._counters.items():
            value = int(rec.get(key, 0))  # a record without it: a counter at 0
            self._counters[key] = [done + now, value] if value < now else [done, value]
        if prev is None or "event" in prev or "event" in rec:
            return
        dtok = rec.get("tokens", 0) - prev.get("tokens", 0)
        dt = rec.get("t", 0) - prev.get("t", 0)
        if dt > 0 and dtok > 0:
            self.speeds.append(dtok / dt)
        if "busy_s" in prev and "busy_s" in rec:
            dbusy = rec["busy_s"] - prev["busy_s"]
            if dtok > 0 and dbusy > 0:
                self._busy_tokens += dtok
                self._busy_s += dbusy
                if "reduce_s" in prev and "reduce_s" in rec:
                    self._reduce_s += rec["reduce_s"] - prev["reduce_s"]
                    self._reduce_busy_s += dbusy

    @property
    def speed(self) -> float:
        """Median tokens/s between consecutive records (0.0 without any)."""
        return statistics.median(self.speeds) if self.speeds else 0.0

    @property
    def busy_rate(self) -> float | None:
        """Tokens per busy second (None without ``busy_s`` records)."""
        return self._busy_tokens / self._busy_s if self._busy_s > 0 else None

    @property
    def reduce_share(self) -> float | None:
        """The share of busy time spent in the all-reduce (data-parallel ranks; None without
        ``reduce_s`` records): ``diloco plan``'s inputs come from it (docs/plan.md)."""
        return self._reduce_s / self._reduce_busy_s if self._reduce_busy_s > 0 else None

    def transport_total(self, key: str) -> int:
        """A counter of ``COUNTERS`` (``bytes_up``, ``bytes_down``, ``clipped``) over all
        incarnations."""
        done, now = self._counters[key]
        return done + now


class TapeTally:
    """What the run's measures need from the event tape, added one record at a time.

    ``bin_s``: the width of the timeline's bins (commits and contributors per bin).
    """

    def __init__(self, fragments: int, bin_s: float = 5.0) -> None:
        self.fragments = fragments
        self.bin_s = bin_s
        self.start: float | None = None
        """Time of the tape's first record."""
        self.joins: dict[str, float] = {}
        """First join of every learner (observers excluded)."""
        self.useful: dict[str, float] = defaultdict(float)
        """Useful tokens per learner (``goodput.useful_tokens``)."""
        self.rounds = 0
        self.contributions: Counter[str] = Counter()
        """Committed rounds each learner was merged in."""
        self.last_contribution: dict[str, float] = {}
        """When each learner was last merged in a committed round."""
        self.contributors: Counter[int] = Counter()
        """Committed rounds by how many learners they merged."""
        self.versions: dict[int, int] = {}
        """Newest committed version of each fragment."""
        self.commit_times = array("d")
        self.chaos: list[dict] = []
        self.reintegrations: list[dict] = []
        """One entry per learner restart (``goodput.reintegrations``)."""
        self.markers: list[dict] = []
        """Failures, restarts and rejoins, for a time axis: ``t``, ``kind``, ``target``."""
        self.timeline: dict[int, list[int]] = {}
        """Bin index -> [commits, learners merged] (bin ``i`` covers ``start + i·bin_s``)."""
        self.bytes_up = 0
        """Delta bytes the syncer merged (``bytes_up`` of the round records)."""
        self._waiting: list[dict] = []  # restarts not yet seen in a committed round

    def add(self, r: dict) -> None:
        event, t = r.get("event"), r.get("t")
        if t is not None and self.start is None:
            self.start = t
        if event == "round":
            self._round(r)
        elif event == "join" and not r.get("observer"):
            self.joins.setdefault(r["learner"], t)
            if r.get("rejoin"):
                self.markers.append({"t": t, "kind": "rejoin", "target": r["learner"]})
        elif event == "chaos":
            self.chaos.append(r)
            self.markers.append({"t": t, "kind": r.get("kind"), "target": r.get("target")})
        elif event == "restart":
            self.markers.append({"t": t, "kind": "restart", "target": r.get("target")})
            if not str(r.get("target", "")).startswith("syncer"):
                entry = {"learner": r["target"], "restarted_at": t, "reintegration_s": None}
                self.reintegrations.append(entry)
                self._waiting.append(entry)
        elif event == "added":
            self.markers.append({"t": t, "kind": "added", "target": r.get("target")})
        elif event == "group-stop":
            self.markers.append({"t": t, "kind": "group-stop", "target": r.get("cause")})

    def _round(self, r: dict) -> None:
        t = r["t"]
        participants = r.get("participants", ())
        self.rounds += 1
        self.contributors[len(participants)] += 1
        if "fragment" in r and "version" in r:
            p, v = int(r["fragment"]), int(r["version"])
            self.versions[p] = max(v, self.versions.get(p, 0))
        self.commit_times.append(t)
        self.bytes_up += int(r.get("bytes_up", 0))
        for learner, tokens in r.get("tokens_by_learner", {}).items():
            self.useful[learner] += tokens / self.fragments
        for learner in participants:
            self.contributions[learner] += 1
            self.last_contribution[learner] = max(t, self.last_contribution.get(learner, t))
        if self.start is not None:
            cell = self.timeline.setdefault(int((t - self.start) // self.bin_s), [0, 0])
            cell[0] += 1
            cell[1] += len(participants)
        for entry in list(self._waiting):
            if t >= entry["restarted_at"] and entry["learner"] in participants:
                entry["reintegration_s"] = round(t - entry["restarted_at"], 3)
                self._waiting.remove(entry)

    def provisioned_s(self, end: float, finished: dict[str, float] | None = None) -> dict:
        """Seconds each learner was provisioned: from its first join to ``end`` (or to when
        it finished its work and left)."""
        finished = finished or {}
        return {m: max(0.0, min(end, finished.get(m, end)) - t) for m, t in self.joins.items()}

    def goodput(
        self,
        end: float,
        rates: dict[str, float | None],
        finished: dict[str, float] | None = None,
    ) -> dict:
        """``goodput``, ``down_share`` and ``goodput_up`` up to ``end`` (``rates``: each
        learner's tokens per busy second, or its speed where that is unknown)."""
        provisioned = self.provisioned_s(end, finished)
        down = schedule_down(self.chaos, set(self.joins), end)
        rate = {m: rates.get(m) or 0.0 for m in self.joins}
        return time_goodput(self.useful, provisioned, rate, down)


# Whole-run measures from complete record lists (the summary at the end of a run).


def busy_rate(progress: list[dict]) -> float | None:
    """Tokens per busy second between consecutive progress records of one incarnation (a
    restart restarts ``busy_s`` at 0), or None without ``busy_s`` records."""
    return _progress_tally(progress).busy_rate


def _progress_tally(progress: list[dict]):
    tally = ProgressTally()
    for rec in progress:
        tally.add(rec)
    return tally


def reintegrations(records: list[dict]) -> list[dict]:
    """One entry per learner restart: when, and how long until it was in a committed round."""
    return _tape_tally(records, fragments=1).reintegrations


def _tape_tally(records: list[dict], fragments: int):
    tally = TapeTally(fragments)
    for r in records:
        tally.add(r)
    return tally


def tape_metrics(
    records: list[dict],
    *,
    fragments: int,
    end: float,
    speeds: dict[str, float],
    finished: dict[str, float] | None = None,
    rates: dict[str, float | None] | None = None,
) -> dict:
    """Goodput, uptime, longest commit gap, failures and reintegrations of one run.

    ``speeds`` maps learner id to its median tokens/s; ``rates`` to its tokens per busy
    second (``busy_rate``; missing or None: its speed is used); ``end`` is when training
    stopped; ``finished`` maps a learner that completed its work (``--steps``) and left to
    when it did: it is provisioned until then, not until ``end`` (its machine is released).
    """
    tally = _tape_tally(records, fragments)
    speeds_s = {m: speeds.get(m, 0.0) for m in tally.joins}
    provisioned_s = tally.provisioned_s(end, finished)
    provisioned = {m: speeds_s[m] * s for m, s in provisioned_s.items()}
    total_provisioned = sum(provisioned.values())
    rate = {m: (rates or {}).get(m) or speeds_s[m] for m in tally.joins}
    start = min(tally.joins.values()) if tally.joins else end
    gaps = commit_gaps(tally.commit_times)
    useful = tally.useful
    return {
        **tally.goodput(end, rate, finished),
        "goodput_speed": (sum(useful.values()) / total_provisioned) if total_provisioned else None,
        "useful_tokens": {m: round(v) for m, v in useful.items()},
        "provisioned_tokens": {m: round(v) for m, v in provisioned.items()},
        "uptime": uptime(tally.commit_times, start, end),
        "max_commit_gap_s": max(gaps) if gaps else None,
        "failures_injected": [
            {k: r[k] for k in ("t", "kind", "target", "down_s") if k in r} for r in tally.chaos
        ],
        "reintegrations": tally.reintegrations,
    }


def learner_speed(progress: list[dict]) -> float:
    """Median tokens/s between consecutive progress records of one incarnation."""
    return _progress_tally(progress).speed

"""Goodput, uptime and commit gaps from the event tape (DESIGN §3). Pure functions.

Definitions used here:

* **useful tokens** of learner m: for every fragment p, the tokens carried by m's accepted
  contributions to p (each contribution carries the tokens m trained since it last received
  p); averaged over the P fragments. Work a learner did but never delivered (lost in a crash,
  refused as too stale) is not useful.
* **provisioned time** of learner m: from its first join to the end of the run (or to when
  it finished its steps and left). A learner that is down, hung, restarting, catching up or
  waiting still costs provisioned time.
* **busy rate** of learner m: tokens per second spent computing steps (``busy_s`` in its
  progress records: forward, backward, optimizer, the learner's step; not waiting for merges,
  not saving checkpoints), over consecutive records of one incarnation.
* **useful time** of learner m: its useful tokens ÷ its busy rate: the compute time whose work
  entered the global model.
* **goodput** = Σ useful time / Σ provisioned time. Time, not tokens, because on a shared
  machine (4 learners on 2 cores) the learners left running go faster while one is down; a
  token count against a typical speed credits them with the dead learner's cores, which real
  hardware would not free (the former measure, ``goodput_speed`` = Σ useful tokens / Σ median
  tokens/s × provisioned time, read 2-5 points higher for that reason). A learner without
  ``busy_s`` records is converted at its median speed instead.
* **down_share**: the share of the provisioned time the failure schedule itself takes away
  (the down time it drew for each kill or hang of a learner, cut at the end of the run). No
  system can use that time: goodput ≤ 1 − down_share. **goodput_up** = Σ useful time /
  (Σ provisioned − Σ down time): what restarts, work lost in a crash, stale refusals and
  waiting cost on top of the schedule.
* **uptime**: the fraction of the time between the first join and the end of the run that lies
  within ``window`` seconds after some commit, where ``window = 4 × median gap between
  consecutive distinct commit times``: the global model is "advancing" while commits keep coming at their usual
  pace.
* **max_commit_gap_s**: the longest time between two consecutive commits (any fragment).
* **reintegration**: for every learner restart, the time from the restart to the first
  committed round that includes that learner again.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def useful_tokens(rounds: list[dict], fragments: int) -> dict[str, float]:
    """Useful tokens per learner from the tape's round records."""
    total: dict[str, float] = defaultdict(float)
    for r in rounds:
        for learner, tokens in r.get("tokens_by_learner", {}).items():
            total[learner] += tokens / fragments
    return dict(total)


DOWN_KINDS = ("kill", "hang")  # failures that take a learner's compute away for their down time


def schedule_down(chaos: list[dict], learners, end: float) -> dict[str, float]:
    """Seconds each of ``learners`` is down by the schedule's own decision: for every ``kill``
    or ``hang`` record aimed at it, ``min(down_s, end − t)``."""
    down: dict[str, float] = defaultdict(float)
    for r in chaos:
        if r.get("kind") in DOWN_KINDS and r.get("target") in learners:
            down[r["target"]] += max(0.0, min(float(r.get("down_s", 0.0)), end - r["t"]))
    return dict(down)


def down_accounting(useful_s: float, provisioned_s: float, down_s: float) -> dict:
    """``down_share`` and ``goodput_up`` (module docstring) from the three totals."""
    up = provisioned_s - down_s
    return {
        "down_share": down_s / provisioned_s if provisioned_s else None,
        "goodput_up": useful_s / up if up > 0 else None,
    }


def busy_rate(progress: list[dict]) -> float | None:
    """Tokens per busy second between consecutive progress records of one incarnation (a
    restart restarts ``busy_s`` at 0), or None without ``busy_s`` records."""
    tokens = busy = 0.0
    for a, b in zip(progress, progress[1:], strict=False):
        if "event" in a or "event" in b or "busy_s" not in a or "busy_s" not in b:
            continue
        dtok, dbusy = b["tokens"] - a["tokens"], b["busy_s"] - a["busy_s"]
        if dtok > 0 and dbusy > 0:
            tokens += dtok
            busy += dbusy
    return tokens / busy if busy > 0 else None


def time_goodput(
    useful: dict[str, float],
    provisioned_s: dict[str, float],
    rates: dict[str, float],
    down_s: dict[str, float],
) -> dict:
    """``goodput``, ``down_share`` and ``goodput_up`` from useful tokens, provisioned and down
    seconds and each learner's tokens per busy second (module docstring)."""
    useful_s = sum(useful.get(m, 0.0) / rates[m] for m in provisioned_s if rates.get(m))
    total = sum(provisioned_s.values())
    return {
        "goodput": useful_s / total if total else None,
        **down_accounting(useful_s, total, sum(down_s.values())),
    }


def commit_gaps(times: list[float]) -> list[float]:
    ts = sorted(times)
    return [b - a for a, b in zip(ts, ts[1:], strict=False)]


def uptime(commit_times: list[float], start: float, end: float) -> float:
    """Fraction of ``[start, end]`` within the advancing window after a commit."""
    if end <= start:
        return 0.0
    ts = sorted(t for t in commit_times if start <= t <= end)
    if not ts:
        return 0.0
    gaps = [g for g in commit_gaps(ts) if g > 0]  # commits closed in one poll share a time
    window = 4 * statistics.median(gaps) if gaps else 1.0
    covered = 0.0
    reach = start
    for t in ts:
        lo, hi = max(t, reach), min(t + window, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def reintegrations(records: list[dict]) -> list[dict]:
    """One entry per learner restart: when, and how long until it was in a committed round."""
    out = []
    restarts = [
        r
        for r in records
        if r.get("event") == "restart" and not str(r.get("target", "")).startswith("syncer")
    ]
    rounds = [r for r in records if r.get("event") == "round"]
    for rs in restarts:
        back = next(
            (r["t"] for r in rounds if r["t"] >= rs["t"] and rs["target"] in r["participants"]),
            None,
        )
        out.append(
            {
                "learner": rs["target"],
                "restarted_at": rs["t"],
                "reintegration_s": None if back is None else round(back - rs["t"], 3),
            }
        )
    return out


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
    finished = finished or {}
    rounds = [r for r in records if r.get("event") == "round"]
    joins: dict[str, float] = {}
    for r in records:
        if r.get("event") == "join" and not r.get("observer"):
            joins.setdefault(r["learner"], r["t"])
    useful = useful_tokens(rounds, fragments)
    provisioned_s = {m: max(0.0, min(end, finished.get(m, end)) - t) for m, t in joins.items()}
    provisioned = {m: speeds.get(m, 0.0) * s for m, s in provisioned_s.items()}
    total_provisioned = sum(provisioned.values())
    chaos = [r for r in records if r.get("event") == "chaos"]
    down = schedule_down(chaos, set(joins), end)
    rate = {m: (rates or {}).get(m) or speeds.get(m, 0.0) for m in joins}
    start = min(joins.values()) if joins else end
    commit_times = [r["t"] for r in rounds]
    gaps = commit_gaps(commit_times)
    return {
        **time_goodput(useful, provisioned_s, rate, down),
        "goodput_speed": (sum(useful.values()) / total_provisioned) if total_provisioned else None,
        "useful_tokens": {m: round(v) for m, v in useful.items()},
        "provisioned_tokens": {m: round(v) for m, v in provisioned.items()},
        "uptime": uptime(commit_times, start, end),
        "max_commit_gap_s": max(gaps) if gaps else None,
        "failures_injected": [
            {k: r[k] for k in ("t", "kind", "target", "down_s") if k in r} for r in chaos
        ],
        "reintegrations": reintegrations(records),
    }


def learner_speed(progress: list[dict]) -> float:
    """Median tokens/s between consecutive progress records of one incarnation."""
    rates = []
    for a, b in zip(progress, progress[1:], strict=False):
        if "event" in a or "event" in b:
            continue
        dt, dtok = b["t"] - a["t"], b["tokens"] - a["tokens"]
        if dt > 0 and dtok > 0:
            rates.append(dtok / dt)
    return statistics.median(rates) if rates else 0.0

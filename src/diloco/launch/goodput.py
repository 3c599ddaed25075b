"""Goodput, uptime and commit gaps from the event tape (DESIGN §3). Pure functions.

Definitions used here:

* **useful tokens** of learner m: for every fragment p, the tokens carried by m's accepted
  contributions to p (each contribution carries the tokens m trained since it last received
  p); averaged over the P fragments. Work a learner did but never delivered (lost in a crash,
  refused as too stale) is not useful.
* **provisioned tokens** of learner m: its fault-free speed (median tokens/s while it was
  training, from its progress records) times the time from its first join to the end of the
  run. A learner that is down, hung, restarting or catching up still costs provisioned time.
* **goodput** = Σ useful / Σ provisioned.
* **down_share**: the provisioned tokens the failure schedule itself takes away (each kill or
  hang of a learner: its speed × the down time the schedule drew, cut at the end of the run),
  as a share of Σ provisioned. No system can turn that time into progress: goodput ≤
  1 − down_share. **goodput_up** = Σ useful / (Σ provisioned − Σ down): the share of the time
  the learners were up that became progress, i.e. what restarts, lost tails, stale refusals
  and waiting cost on top of the schedule.
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


def schedule_down(chaos: list[dict], speeds: dict[str, float], end: float) -> dict[str, float]:
    """Provisioned tokens each learner loses to the schedule's own down times: for every
    ``kill`` or ``hang`` record aimed at it, its speed × ``min(down_s, end − t)``."""
    down: dict[str, float] = defaultdict(float)
    for r in chaos:
        if r.get("kind") in DOWN_KINDS and r.get("target") in speeds:
            seconds = max(0.0, min(float(r.get("down_s", 0.0)), end - r["t"]))
            down[r["target"]] += speeds[r["target"]] * seconds
    return dict(down)


def down_accounting(useful: float, provisioned: float, down: float) -> dict:
    """``down_share`` and ``goodput_up`` (module docstring) from the three totals."""
    up = provisioned - down
    return {
        "down_share": down / provisioned if provisioned else None,
        "goodput_up": useful / up if up > 0 else None,
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
) -> dict:
    """Goodput, uptime, longest commit gap, failures and reintegrations of one run.

    ``speeds`` maps learner id to its fault-free tokens/s; ``end`` is when training stopped;
    ``finished`` maps a learner that completed its work (``--steps``) and left to when it did:
    it is provisioned until then, not until ``end`` (its machine is released).
    """
    finished = finished or {}
    rounds = [r for r in records if r.get("event") == "round"]
    joins: dict[str, float] = {}
    for r in records:
        if r.get("event") == "join" and not r.get("observer"):
            joins.setdefault(r["learner"], r["t"])
    useful = useful_tokens(rounds, fragments)
    provisioned = {
        m: speeds.get(m, 0.0) * max(0.0, min(end, finished.get(m, end)) - t)
        for m, t in joins.items()
    }
    total_provisioned = sum(provisioned.values())
    chaos = [r for r in records if r.get("event") == "chaos"]
    down = schedule_down(chaos, {m: speeds.get(m, 0.0) for m in joins}, end)
    start = min(joins.values()) if joins else end
    commit_times = [r["t"] for r in rounds]
    gaps = commit_gaps(commit_times)
    return {
        "goodput": (sum(useful.values()) / total_provisioned) if total_provisioned else None,
        **down_accounting(sum(useful.values()), total_provisioned, sum(down.values())),
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

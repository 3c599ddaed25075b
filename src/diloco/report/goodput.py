"""Goodput, uptime and commit gaps from the event tape (docs/resilience.md). Pure functions.

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
* **goodput** = Σ useful time / Σ provisioned time (None while no learner's speed is
  known: fewer than two progress records). Time, not tokens, because on a shared
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
    if not any(rates.get(m) for m in provisioned_s):  # no speed measured: unknown, not 0
        return {"goodput": None, "down_share": None, "goodput_up": None}
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

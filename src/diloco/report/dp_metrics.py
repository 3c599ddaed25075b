"""Goodput and commit gaps of a data-parallel run, from its ranks' progress records. Pure.

The definitions follow :mod:`diloco.report.goodput` (docs/resilience.md, "Goodput,
uptime and gaps"), read for a static group:

* **useful tokens** of a rank: its share of the steps that survived, i.e. the tokens of its
  last record (a restart rolls the counter back to the checkpoint, so rolled-back steps and
  the time spent restarting are lost).
* **provisioned time** of a rank: from its first start to the end of training; its **busy
  rate**: tokens per second spent in steps (the all-reduce included, so a rank waiting for a
  slower peer is not counted as idle: generous to data-parallel); **goodput** = Σ useful
  tokens ÷ busy rate / Σ provisioned time (``goodput_speed``: the former token measure at the
  median speed). ``down_share`` and ``goodput_up`` as in :mod:`diloco.report.goodput`.
* **commits**: every moment the global model reached a step it had never reached before
  (rank 0's records); ``max_commit_gap_s`` and ``uptime`` are computed from them as for
  DiLoCo, so a rollback shows up as a gap until the group is past its old high-water mark.
* **reintegration**: for every restart of a rank, the time until it reports a trained step.
* **allreduce_share**: the share of a rank's busy time spent in the all-reduce (median over
  ranks), the input ``diloco plan``'s overlap is measured from (docs/plan.md).
"""

from __future__ import annotations

import statistics

from diloco.report.goodput import commit_gaps, schedule_down, time_goodput, uptime
from diloco.report.tally import ProgressTally


def new_ground(records: list[dict]) -> list[float]:
    """Times at which the step count exceeded every earlier step count."""
    best, times = -1, []
    for r in records:
        if "event" in r:
            continue
        if r["step"] > best:
            best = r["step"]
            times.append(r["t"])
    return times


def dp_metrics(
    progress: dict[str, list[dict]],
    restarts: list[dict],
    *,
    end: float,
    chaos: list[dict] = (),
) -> dict:
    """Goodput, uptime, longest commit gap and reintegrations of a data-parallel run.

    ``progress`` maps rank id (rank 0 first) to its progress records; ``restarts`` are the
    tape's ``restart`` records; ``end`` is when training stopped; ``chaos`` the tape's
    ``chaos`` records (for ``down_share``: the killed rank's own down time; the others
    waiting for it is data-parallel's cost, not the schedule's).
    """
    tallies = {name: ProgressTally() for name in progress}
    for name, records in progress.items():
        for rec in records:
            tallies[name].add(rec)
    measures = dp_goodput(tallies, end=end, chaos=chaos)
    leader = next(iter(progress.values()), [])
    commits = new_ground(leader)
    starts = [r["t"] for r in leader if r.get("event") == "start"]
    gaps = commit_gaps(commits)
    return {
        **measures,
        "uptime": uptime(commits, min(starts), end) if starts else 0.0,
        "max_commit_gap_s": max(gaps) if gaps else None,
        "reintegrations": [reintegration(r, progress.get(r["target"], [])) for r in restarts],
        "allreduce_share": _median_or_none([t.reduce_share for t in tallies.values()]),
    }


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def dp_goodput(tallies: dict, *, end: float, chaos=()) -> dict:
    """``goodput`` (and ``down_share``, ``goodput_up``, ``goodput_speed``, useful and
    provisioned tokens) of a data-parallel group up to ``end``, from each rank's
    :class:`~diloco.report.tally.ProgressTally` (module docstring)."""
    useful, provisioned, provisioned_s, rates = {}, {}, {}, {}
    for name, tally in tallies.items():
        useful[name] = int(tally.latest.get("tokens", 0))
        first = tally.first_start if tally.first_start is not None else end
        provisioned_s[name] = max(0.0, end - first)
        provisioned[name] = tally.speed * provisioned_s[name]
        rates[name] = tally.busy_rate or tally.speed
    total = sum(provisioned.values())
    down = schedule_down(list(chaos), set(tallies), end)
    return {
        **time_goodput(useful, provisioned_s, rates, down),
        "goodput_speed": sum(useful.values()) / total if total else None,
        "useful_tokens": useful,
        "provisioned_tokens": {m: round(v) for m, v in provisioned.items()},
    }


def reintegration(restart: dict, records: list[dict]) -> dict:
    back = next(
        (r["t"] for r in records if r["t"] >= restart["t"] and "event" not in r),
        None,
    )
    return {
        "learner": restart["target"],
        "restarted_at": restart["t"],
        "reintegration_s": None if back is None else round(back - restart["t"], 3),
    }

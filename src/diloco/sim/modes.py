"""Goodput and uptime of each training mode for one set of slice outages: pure accounting.

Definitions (docs/simulate.md, docs/resilience.md): **goodput** is the fraction of the provisioned
chip-time (all chips × the simulated duration) that turns into training progress that is
kept; **uptime** is the fraction of wall time in which the global model advances.

**Stops absorb failures.** A chip failure that happens while the job (or, for the elastic
modes, the group) is already stopped or pausing is handled by that same stop: the restart or
reconfiguration in progress takes the new failure into account and is not extended. Failures
therefore interrupt only training time (``first_stops``). This is a modeling choice made on
the data-parallel calibration targets: letting failures during a stop extend it makes goodput
fall exponentially with chip count and misses the published rows by up to 14 points, and
counting rolled-back work as lost progress (rather than re-work inside the stop) drives
goodput to 0 once failures come faster than checkpoints (docs/simulate.md).

``dp`` (data-parallel, no elasticity), first-order checkpoint/restart accounting (the
Young/Daly kind). A failure stops the whole job; the stop lasts ``restart_s`` (detect,
reschedule onto healthy or spare slices, reload the checkpoint; the failed slice is repaired
in the background, so its recovery time does not enter, and since the job always runs on all
its chips every chip failure counts, also one in a slice that is under repair) plus the time to re-train the work
since the last checkpoint (checkpoints every ``checkpoint_s`` seconds of training since the
last restart, so the re-work is ``(up time) mod checkpoint_s``). Failures during the stop,
re-work included, are absorbed by it. Goodput: the new training time (the up time between
stops; what was lost is re-done inside the stop) over the duration. Uptime: the same
fraction (the model advances exactly when the job trains new steps).

``dp-elastic`` and ``decoupled`` share one accounting: the chips are split into ``groups``
(1 for elastic data-parallel, M learners for Decoupled DiLoCo), each owning a contiguous block
of slices. Inside a group a slice outage is handled elastically: the group pauses for
``reconfig_s`` (nothing of it trains), then goes on with its remaining slices (a smaller
batch) until the slice's recovery time has passed; it then pauses for ``readd_s`` to add the
slice again (0: added for free, e.g. at the next reconfiguration). A group with
every slice down is not live. A group is *contributing* while it is live and not pausing.
Other groups are never affected. Whether the global model advances is the syncer's round
decision (:func:`diloco.algorithm.rounds.decide_round`, quorum K, grace window 0) given the
contributing groups and the live ones: with ``c`` contributing of ``l`` live groups, rounds
close iff ``c ≥ K`` or ``0 < c = l``. When they do not, progress stops and the work of
every group in that time counts as lost. Goodput = ∫ [rounds close] · Σ_g (chips of g's
slices that are up, if g contributes) dt ÷ (all chips × duration). With one group and K = 1
this is exactly elastic data-parallel.

A slowest-slice factor models speed variance between slices (``speed_factor``): a
synchronous group steps at the pace of its slowest slice.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from diloco.algorithm.rounds import Estimates, OpenRound, decide_round
from diloco.sim.failures import Outages


@dataclass(frozen=True)
class ModeResult:
    goodput: float
    uptime: float


def first_stops(t: np.ndarray, group: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """Which events start a stop, when events during a stop are absorbed by it.

    ``t`` sorted by (``group``, time). Within a group, event i starts a stop unless it falls
    before the end (start + ``duration``) of the last stop that group started. Returns a
    boolean mask. A greedy chain: a sequential scan over the events, O(n) in plain Python
    on lists (the arrays elsewhere stay vectorized).
    """
    n = int(t.size)
    mask = np.zeros(n, dtype=bool)
    times, groups, durs = t.tolist(), group.tolist(), duration.tolist()
    busy_until, current = -np.inf, None
    for i in range(n):
        if groups[i] != current:
            current, busy_until = groups[i], -np.inf
        if times[i] >= busy_until:
            mask[i] = True
            busy_until = times[i] + durs[i]
    return mask


def dp_accounting(outages: Outages, *, restart_s: float, checkpoint_s: float) -> ModeResult:
    """Data-parallel without elasticity (see the module docstring)."""
    if checkpoint_s <= 0 or restart_s < 0:
        raise ValueError("checkpoint_s must be > 0 and restart_s >= 0")
    horizon = outages.horizon_s
    fails = outages.failure_times().tolist()
    up_total, resume, i = 0.0, 0.0, 0
    # a sequential chain over the stops (each stop's length depends on the stretch before it)
    while True:
        i = bisect.bisect_left(fails, resume, i)
        if i == len(fails):
            break
        stop = fails[i]
        up = stop - resume
        up_total += up
        resume = stop + restart_s + math.fmod(up, checkpoint_s)
        if resume >= horizon:
            break
    up_total += max(0.0, horizon - resume)
    return ModeResult(up_total / horizon, up_total / horizon)


def quorum_table(groups: int, quorum: int) -> np.ndarray:
    """``table[c, l]``: do rounds close with ``c`` contributing of ``l`` live groups?

    Asks :func:`~diloco.algorithm.rounds.decide_round` (grace window 0: the simulator's time
    scale is minutes to hours, a round's grace window is one learner step).
    """
    table = np.zeros((groups + 1, groups + 1), dtype=bool)
    ids = [f"learner-{i}" for i in range(groups)]
    for live in range(groups + 1):
        for contributing in range(live + 1):
            round_ = OpenRound(
                contributors=frozenset(ids[:contributing]),
                opened_at=0.0,
                quorum_at=0.0 if contributing >= quorum else None,
            )
            decision = decide_round(
                0.0, round_, ids[:live], quorum=quorum, gamma=1.0, tau=2.0, estimates=Estimates()
            )
            table[contributing, live] = decision.close
    return table


def group_of_slice(slices: int, groups: int) -> np.ndarray:
    """Contiguous, nearly equal blocks: slice ``s`` belongs to group ``s · groups // slices``."""
    if not 1 <= groups <= slices:
        raise ValueError(f"need 1 <= groups <= slices (got {groups} groups, {slices} slices)")
    return np.arange(slices, dtype=np.int64) * groups // slices


def elastic_accounting(
    outages: Outages,
    *,
    groups: int,
    quorum: int,
    reconfig_s: float,
    readd_s: float,
) -> ModeResult:
    """Elastic groups under a quorum (dp-elastic: ``groups=1``; decoupled: M groups)."""
    if reconfig_s < 0 or readd_s < 0:
        raise ValueError("reconfig_s and readd_s must be >= 0")
    if not 1 <= quorum <= groups:
        raise ValueError(f"quorum must be in [1, {groups}], got {quorum}")
    horizon = outages.horizon_s
    owner = group_of_slice(outages.slices, groups)
    size = np.bincount(owner, minlength=groups).astype(np.float64)  # slices per group
    weight = size / size.sum()
    table = quorum_table(groups, quorum)

    g = owner[outages.slice_id]
    s, e = outages.start, outages.end
    back = e < horizon
    pauses_t, pauses_g, pauses_d = _pauses(g, s, e[back], g[back], reconfig_s, readd_s)
    # events: (time, group, Δ slices down, Δ pauses in progress)
    t = np.concatenate([s, e[back], pauses_t, pauses_t + pauses_d])
    grp = np.concatenate([g, g[back], pauses_g, pauses_g])
    n_back, n_pause = int(back.sum()), int(pauses_t.size)
    d_down = np.concatenate([np.ones(s.size), -np.ones(n_back), np.zeros(2 * n_pause)])
    d_pause = np.concatenate([np.zeros(s.size + n_back), np.ones(n_pause), -np.ones(n_pause)])
    keep = t < horizon
    t, grp, d_down, d_pause = t[keep], grp[keep], d_down[keep], d_pause[keep]
    if t.size == 0:
        ok = bool(table[groups, groups])
        return ModeResult(float(ok), float(ok))

    # state of each group after each of its events (sorted by group, then time)
    order = np.lexsort((t, grp))
    t, grp, d_down, d_pause = t[order], grp[order], d_down[order], d_pause[order]
    down = _cumsum_by_group(d_down, grp)
    paused = _cumsum_by_group(d_pause, grp) > 0
    live = down < size[grp]
    contributing = live & ~paused
    value = np.where(contributing, 1.0 - down / size[grp], 0.0) * weight[grp]
    first = np.r_[True, grp[1:] != grp[:-1]]
    prev_value = np.where(first, weight[grp], np.r_[0.0, value[:-1]])
    prev_contrib = np.where(first, True, np.r_[False, contributing[:-1]])
    prev_live = np.where(first, True, np.r_[False, live[:-1]])

    # global step functions over time
    by_time = np.argsort(t, kind="stable")
    t = t[by_time]
    work = 1.0 + np.cumsum((value - prev_value)[by_time])
    n_contrib = groups + np.cumsum((contributing.astype(np.int64) - prev_contrib)[by_time])
    n_live = groups + np.cumsum((live.astype(np.int64) - prev_live)[by_time])
    advancing = table[n_contrib, n_live]

    dur = np.diff(np.r_[t, horizon])
    first_dur = t[0]
    ok0 = bool(table[groups, groups])
    good = first_dur * ok0 + float(np.sum(dur * advancing * work))
    up = first_dur * ok0 + float(np.sum(dur * advancing))
    return ModeResult(good / horizon, up / horizon)


def _pauses(
    fail_group: np.ndarray,
    fail_t: np.ndarray,
    back_t: np.ndarray,
    back_group: np.ndarray,
    reconfig_s: float,
    readd_s: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pause intervals per group: (start, group, length), failures during a pause absorbed."""
    t = [fail_t]
    grp = [fail_group]
    dur = [np.full(fail_t.size, float(reconfig_s))]
    if readd_s > 0:
        t.append(back_t)
        grp.append(back_group)
        dur.append(np.full(back_t.size, float(readd_s)))
    t, grp, dur = np.concatenate(t), np.concatenate(grp), np.concatenate(dur)
    if reconfig_s <= 0 and readd_s <= 0:
        return t[:0], grp[:0], dur[:0]
    order = np.lexsort((t, grp))
    t, grp, dur = t[order], grp[order], dur[order]
    mask = first_stops(t, grp, dur) & (dur > 0)
    return t[mask], grp[mask], dur[mask]


def _cumsum_by_group(x: np.ndarray, grp: np.ndarray) -> np.ndarray:
    """Running sum of ``x`` restarting at every new group (``grp`` sorted)."""
    c = np.cumsum(x)
    first = np.r_[True, grp[1:] != grp[:-1]]
    base = (c - x)[first]
    return c - base[np.cumsum(first) - 1]


def speed_factor(rng: np.random.Generator, *, slices: int, groups: int, sigma: float) -> float:
    """Fraction of chip speed a synchronous group turns into steps: Σ_g n_g·min_g(v) ÷ Σ v.

    Slice speeds ``v`` are lognormal with mean 1 and log-standard-deviation ``sigma``; a group
    (the whole job for data-parallel, one learner for decoupled) steps at its slowest slice.
    1.0 when ``sigma`` is 0.
    """
    if sigma <= 0:
        return 1.0
    v = rng.lognormal(-0.5 * sigma**2, sigma, slices)
    owner = group_of_slice(slices, groups)
    mins = np.full(groups, np.inf)
    np.minimum.at(mins, owner, v)
    counts = np.bincount(owner, minlength=groups)
    return float(np.sum(counts * mins) / v.sum())

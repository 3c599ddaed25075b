"""Digital twin: predict the goodput of a real ``diloco run --chaos`` run from its spec.

The run is modeled with the simulator's own accounting (:func:`diloco.sim.modes.elastic_accounting`):
each learner is one group of one slice, quorum K from the run's config. The failures are the
run's chaos schedule (:func:`diloco.chaos.schedule`, a pure function of the spec, M, the run
length and the seed), so the prediction for the run's own seed uses exactly the failures it
suffered; other seeds give the spread a user should expect from the same spec.

What the measured ``goodput`` in ``summary.json`` is (``diloco.report.goodput``): tokens
carried by accepted contributions ÷ (each learner's fault-free speed × the time from its
first join to the end). So a learner loses, per failure:

* ``kill``: the tokens it trained but had not delivered yet (on average half a sync period,
  ``H/2`` steps, per fragment), its down time, and the time the restart takes until it
  trains again (process start, imports, join, checkpoint load, catch-up): ``restart_s``;
* ``hang`` and ``partition``: its down time (its uploads from before the hang are stale or
  resent; counted as lost);
* ``syncer-kill``: nothing (learners keep training; queued uploads go out when it is back).

Machine constants (``MachineConstants``) are measured once from a *different* run
(:func:`measure_constants`): learner start-up after launch, restart overhead, step rate and
the ratio of mean to median training speed (the run's provisioning uses the median).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from diloco.chaos import parse_spec, schedule
from diloco.report.run_files import load_run
from diloco.report.tally import learner_speed
from diloco.runtime.jsonl import read_jsonl
from diloco.sim.failures import merge_outages
from diloco.sim.grid import mean_ci
from diloco.sim.modes import elastic_accounting


@dataclass(frozen=True, kw_only=True)
class MachineConstants:
    """Constants of this machine and recipe, measured from a calibration run."""

    startup_s: float
    """Launch of ``diloco run`` → the learners' first join (the provisioned time starts)."""
    restart_s: float
    """Supervisor restarts a killed learner → it trains again."""
    steps_per_s: float
    """A learner's fault-free step rate (turns the undelivered H/2 steps into seconds)."""
    speed_ratio: float = 1.0
    """Mean ÷ median training speed. The measured goodput provisions each learner at its
    *median* speed, while its useful tokens accrue at its actual (mean) speed; on a shared
    machine the two differ, which scales the measured goodput by this ratio."""
    source: str = ""
    """The run directory they were measured from."""


# Measured by ``measure_constants`` on /tmp/simtwin/calib1 (2 learners, 3 min,
# kill:mtbf=30s,down=5-15s, --seed 1), 2026-11-23; see docs/simulate.md.
REFERENCE_CONSTANTS = MachineConstants(
    startup_s=7.88, restart_s=10.33, steps_per_s=3.7, speed_ratio=1.005, source="calib1"
)


@dataclass(frozen=True)
class RunFacts:
    """What the twin needs of a run's configuration (read from its ``config.json``)."""

    learners: int
    minutes: float
    chaos: str | None
    seed: int
    sync_every: int
    quorum: int

    @classmethod
    def from_config(cls, doc: dict) -> RunFacts:
        """From a run's ``config.json`` (``ValueError`` if a key is missing)."""
        try:
            return cls(
                int(doc["learners"]),
                float(doc["minutes"]),
                doc.get("chaos"),
                int(doc["recipe"]["seed"]),
                int(doc["syncer"]["protocol"]["sync_every"]),
                int(doc["syncer"]["quorum"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"config.json lacks {exc}: not a run of this version") from None


def launch_time(config: RunFacts, chaos: list[dict]) -> float | None:
    """The run's launch time on the tape's clock, from its first chaos record (``chaos``: the
    tape's chaos records, in order) and its schedule."""
    if not chaos or not config.chaos:
        return None
    planned = schedule(parse_spec(config.chaos), config.learners, config.minutes * 60, config.seed)
    return float(chaos[0]["t"]) - planned[0].t


def measure_constants(run_dir: str | Path) -> MachineConstants:
    """Measure start-up, restart overhead and step rate from a chaos run's tape and logs."""
    run = load_run(run_dir, finished=False)
    config, tape = RunFacts.from_config(run.config), run.tape
    launch = launch_time(config, tape.chaos)
    if launch is None:
        raise ValueError(f"{run_dir}: needs a run with --chaos (its schedule dates the launch)")
    joins = tape.joins  # each learner's first join (observers excluded)
    startup = statistics.median(t - launch for t in joins.values())
    overheads, rates = [], []
    trained, at_median = 0.0, 0.0
    for learner in joins:
        path = Path(run_dir) / "learners" / learner / "progress.jsonl"
        progress = read_jsonl(path, missing_ok=False)
        steps = [p for p in progress if "event" not in p]
        rates += [p["steps_per_s"] for p in steps if p.get("steps_per_s")]
        median = learner_speed(progress)
        for a, b in zip(steps, steps[1:], strict=False):
            dt, dtok = b["t"] - a["t"], b["tokens"] - a["tokens"]
            if 0 < dt < 4.0 and dtok > 0:  # one incarnation, training (records ~1 s apart)
                trained += dtok
                at_median += median * dt
        for restart in tape.reintegrations:
            if restart["learner"] != learner:
                continue
            t = restart["restarted_at"]
            nxt = next((p["t"] for p in steps if p["t"] > t), None)
            later_kill = next(
                (c["t"] for c in tape.chaos if c.get("target") == learner and c["t"] > t), None
            )
            if nxt is not None and (later_kill is None or nxt < later_kill):
                overheads.append(nxt - t)
    if not overheads:
        raise ValueError(f"{run_dir}: no learner restart that trained again before its next kill")
    return MachineConstants(
        startup_s=round(startup, 2),
        restart_s=round(statistics.median(overheads), 2),
        steps_per_s=round(statistics.median(rates), 2),
        speed_ratio=round(trained / at_median, 3) if at_median else 1.0,
        source=str(run_dir),
    )


def predict(config: RunFacts, constants: MachineConstants, seed: int) -> float:
    """Predicted goodput of a run with ``config`` under chaos seed ``seed``."""
    m = config.learners
    horizon = config.minutes * 60
    sync_every = config.sync_every
    quorum = min(config.quorum, m)
    events = schedule(parse_spec(config.chaos or ""), m, horizon, seed)
    lost_s = 0.5 * sync_every / constants.steps_per_s
    sid, start, end = [], [], []
    for ev in events:
        if not ev.target.startswith("learner-"):
            continue  # syncer-kill: learners keep training, queued work is delivered later
        t = ev.t - constants.startup_s  # provisioned time starts at the first join
        if ev.kind == "kill":
            a, b = t - lost_s, t + ev.down_s + constants.restart_s
        else:  # hang, partition
            a, b = t, t + ev.down_s
        sid.append(int(ev.target.split("-")[1]))
        start.append(max(a, 0.0))
        end.append(max(b, 0.0))
    span = horizon - constants.startup_s
    outages = merge_outages(
        np.array(sid, dtype=np.int64), np.array(start), np.array(end), slices=m, horizon_s=span
    )
    accounted = elastic_accounting(outages, groups=m, quorum=quorum, reconfig_s=0.0, readd_s=0.0)
    return accounted.goodput * constants.speed_ratio


def twin_report(run_dir: str | Path, constants: MachineConstants, seeds: int = 200) -> dict:
    """Predicted (the run's own seed; and mean ± 95% CI over ``seeds`` other seeds) vs measured."""
    run = load_run(run_dir, finished=False)
    config, summary = RunFacts.from_config(run.config), run.summary or None
    if not config.chaos:
        raise ValueError(f"{run_dir}: the run has no --chaos spec to predict from")
    own_seed = config.seed
    own = predict(config, constants, own_seed)
    others = np.array([predict(config, constants, own_seed + 1 + k) for k in range(seeds)])
    mean, ci = mean_ci(others)
    # the twin models the speed-based measure (tokens at the median speed)
    measured = None if summary is None else summary.get("goodput_speed", summary.get("goodput"))
    return {
        "run_dir": str(run_dir),
        "spec": config.chaos,
        "learners": config.learners,
        "minutes": config.minutes,
        "seed": own_seed,
        "constants": asdict(constants),
        "predicted_goodput": own,
        "predicted_goodput_other_seeds": {
            "mean": mean,
            "ci95": ci,
            "sd": float(others.std(ddof=1)),
            "seeds": seeds,
        },
        "measured_goodput": measured,
        "error_points": None if measured is None else 100 * (own - measured),
        "measured_uptime": None if summary is None else summary.get("uptime"),
    }

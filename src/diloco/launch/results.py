"""What a ``diloco run`` leaves behind, read back: progress files and the run summary."""

from __future__ import annotations

import time
from pathlib import Path

from diloco.launch.syncers import is_syncer
from diloco.runtime.jsonl import read_jsonl
from diloco.wire.comms import DEFAULT_COMMS


def summarize(config, run_dir, plans, sup, facts: dict) -> dict:
    """``summary.json`` from the event tape and the learners' progress files.

    ``facts`` holds ``started``, ``train_end``, ``val_initial``, ``val_final``, ``num_params``,
    ``tokens_per_sample``, ``stopped_by`` and ``codes`` (last exit code per learner).
    """
    from diloco.report.summary import add_scores, build_summary, contributors_per_round
    from diloco.report.tally import busy_rate, learner_speed, tape_metrics
    from diloco.syncer.store import read_tape

    records = read_tape(run_dir / "syncer" / "events.jsonl")
    rounds = [r for r in records if r.get("event") == "round"]
    per_learner, speeds, rates, finished = [], {}, {}, {}
    for plan in plans:
        progress = read_progress(run_dir / "learners" / plan.id / "progress.jsonl")
        speeds[plan.id] = learner_speed(progress)
        rates[plan.id] = busy_rate(progress)
        if sup.slots[plan.id].finished and progress and progress[-1].get("event") == "exit":
            finished[plan.id] = progress[-1]["t"]
        contributions = sum(1 for r in rounds if plan.id in r["participants"])
        per_learner.append(learner_row(plan, progress, sup.slots[plan.id], facts, contributions))
    summary = build_summary(
        mode=config.mode,
        run_dir=str(run_dir),
        wall_s=time.time() - facts["started"],
        val_initial=facts["val_initial"],
        val_final=facts["val_final"],
        rounds=len(rounds),
        learners=per_learner,
        num_params=facts["num_params"],
        tokens_per_sample=facts["tokens_per_sample"],
        stopped_by=facts["stopped_by"],
    )
    add_scores(summary, facts)
    summary["started_at"] = facts["started"]
    summary["train_s"] = round(facts["train_end"] - facts["started"], 2)
    summary["contributors_per_round"] = contributors_per_round(rounds)
    summary.update(
        tape_metrics(
            records,
            fragments=config.syncer.protocol.num_fragments,
            end=facts["train_end"],
            speeds=speeds,
            finished=finished,
            rates=rates,
        )
    )
    summary["syncer_restarts"] = sum(
        slot.restarts for name, slot in sup.slots.items() if is_syncer(name)
    )
    summary["shards"] = config.shards
    syncer = config.syncer
    summary["exchange"] = {  # what sized the bytes above (--comms and what overrode it)
        "comms": syncer.protocol.comms or DEFAULT_COMMS,
        "sync_every": syncer.protocol.sync_every,
        "up_codec": syncer.up_codec,
        "down_codec": syncer.down_codec,
        "down_feedback": syncer.down_feedback,
        **(
            {"early_sync_every": syncer.early_sync_every, "early_cycles": syncer.early_cycles}
            if syncer.early_sync_every
            else {}
        ),
    }
    return summary


def read_progress(path: Path) -> list[dict]:
    """A learner's progress records (``[]`` if it wrote none)."""
    return read_jsonl(path)


def transport_total(progress: list[dict], key: str) -> int:
    """A counter (bytes, clipped steps) over all incarnations: each restart starts it at 0."""
    from diloco.report.tally import ProgressTally

    tally = ProgressTally()
    for rec in progress:
        tally.add(rec)
    return tally.transport_total(key)


def learner_row(plan, progress: list[dict], slot, facts: dict, contributions: int) -> dict:
    """One learner's entry of the summary, from its progress records and its slot."""
    last = {k: v for rec in progress for k, v in rec.items()}
    return {
        "id": plan.id,
        "steps": int(last.get("step", 0)),
        "tokens": int(last.get("tokens", 0)),
        "steps_per_s": float(last.get("steps_per_s", 0.0)),
        "batch_size": plan.batch_size,
        "slow": plan.slow,
        "exit_code": facts["codes"].get(plan.id),
        "restarts": slot.restarts,
        "contributions": contributions,
        "bytes_up": transport_total(progress, "bytes_up"),
        "bytes_down": transport_total(progress, "bytes_down"),
        "clipped_steps": transport_total(progress, "clipped"),
    }

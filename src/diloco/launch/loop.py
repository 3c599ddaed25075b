"""The supervisor loop of ``diloco run``: failures and restarts, the view, evaluation, when to stop."""

from __future__ import annotations

import time
from pathlib import Path

from diloco.launch.supervisor import MAX_UNPLANNED_RESTARTS
from diloco.launch.syncers import syncer_names
from diloco.launch.view import clock
from diloco.runtime.metrics import append_metric


def record_metric(
    run_dir: Path, started: float, status, loss: float, versions: list[int], scores=None
) -> None:
    """One line of ``metrics.jsonl`` (``diloco.runtime.metrics``): the global model's
    held-out loss now, the versions it holds and the syncer's counts (``status``: its last
    answer, None when it did not answer)."""
    append_metric(
        run_dir,
        started=started,
        val_loss=loss,
        scores=scores,
        versions=sum(max(v, 0) for v in versions),
        tokens=sum(ls.tokens for ls in status.learners) if status is not None else None,
        rounds=status.rounds if status is not None else None,
    )


def check_crashes(sup, limit: int = MAX_UNPLANNED_RESTARTS) -> None:
    """``RuntimeError`` if a process exited on its own more than ``limit`` times."""
    for slot in sup.slots.values():
        crashes = sum(1 for c in slot.exit_codes if c != 0) - slot.planned_deaths
        if crashes > limit:
            tail = slot.child.tail() if slot.child else ""
            raise RuntimeError(f"{slot.name} keeps crashing ({crashes} times):\n{tail}")


def learner_state(slot, status, elapsed: float) -> str:
    """What the view says a learner is doing."""
    if slot.finished:
        return "finished"
    if slot.resume_at is not None:
        return "hung (chaos)"
    if slot.restart_at is not None:
        return f"down, restart in {max(0.0, slot.restart_at - elapsed):.0f}s"
    if status is None:
        return "starting"
    return status.state if status.live else "not live"


class Rates:
    """Tokens per second per learner, over windows of at least 2 s."""

    def __init__(self) -> None:
        self.prev: dict[str, tuple[float, int]] = {}
        self.rate: dict[str, float] = {}

    def update(self, learner: str, now: float, tokens: int) -> float:
        t0, tok0 = self.prev.setdefault(learner, (now, tokens))
        if now - t0 >= 2.0:
            self.rate[learner] = max(0.0, (tokens - tok0) / (now - t0))
            self.prev[learner] = (now, tokens)
        return self.rate.get(learner, 0.0)


def view_rows(plans, sup, by_id: dict, rates: Rates, now: float, elapsed: float) -> list[dict]:
    """One row per learner for the live view and the dashboard."""
    rows = []
    for plan in plans:
        st = by_id.get(plan.id)
        step, tok = (int(st.step), int(st.tokens)) if st else (0, 0)
        slot = sup.slots.get(plan.id)
        rows.append(
            {
                "id": plan.id,
                "step": step,
                "tokens": tok,
                "tokens_per_s": rates.update(plan.id, now, tok),
                "steps_per_s": float(st.steps_per_s) if st else 0.0,
                "live": bool(st and st.live),
                "state": learner_state(slot, st, elapsed)
                if slot is not None
                else f"joins at {clock(plan.start_at)}",
            }
        )
    return rows


def view_frame(config, elapsed: float, rows: list[dict], **totals) -> dict:
    """What the live view draws: ``totals`` (``val_loss``, ``rounds``, ``bytes_up``,
    ``bytes_down``), the learner rows and the progress towards the run's budget."""
    from diloco.launch.view import progress

    done, left = progress(
        elapsed,
        budget_s=config.minutes * 60 if config.minutes else None,
        tokens=sum(r["tokens"] for r in rows),
        token_budget=config.tokens,
        steps=min((r["step"] for r in rows), default=0),
        step_budget=config.steps,
    )
    return {"elapsed": elapsed, "learners": rows, "done": done, "left": left, **totals}


def finished_rows(summary: dict) -> list[dict]:
    """The dashboard's learner rows at the end of a run, from its summary."""
    return [
        {
            "id": learner,
            "step": row["steps"],
            "tokens": row["tokens"],
            "steps_per_s": row["steps_per_s"],
            "live": False,
            "state": {0: "finished", None: "down at the end"}.get(
                row["exit_code"], f"exited {row['exit_code']}"
            ),
        }
        for learner, row in summary["per_learner"].items()
    ]


def supervise(
    config,
    stop,
    started,
    sup,
    plans,
    evaluator,
    status_client,
    run_dir,
    out=None,
    outputs=None,
    on_tick=None,
    max_restarts: int = MAX_UNPLANNED_RESTARTS,
) -> str:
    """Poll the processes, draw the view, evaluate every ``eval_every`` seconds, start the
    chaos schedule once every learner trains; return why the run stops (``"time"``,
    ``"tokens"``, ``"learners finished"``, ``"interrupt"``). Raises RuntimeError if a process
    keeps crashing on its own. ``outputs`` (``diloco.dashboard.live.LiveOutputs``) gets the
    learner rows of every poll, for the dashboard and the TensorBoard scalars; ``on_tick``
    (elapsed seconds) is called every poll (it starts the learners ``--add-learners`` adds);
    a process that fails on its own more than ``max_restarts`` times fails the run."""
    from diloco.launch.view import LiveView

    view = LiveView(enabled=not config.json and not config.no_view, stream=out)
    last_eval, last_loss, last_status, rates = 0.0, None, None, Rates()
    try:
        while True:
            if stop.wait(0.25):
                return "interrupt"
            sup.poll()
            check_crashes(sup, max_restarts)
            now = time.time()
            elapsed = now - started
            up = all(sup.running(name) for name in syncer_names(config.shards))
            status = status_client.fetch() if up else None
            last_status = status or last_status
            learners = list(last_status.learners) if last_status else []
            tokens = sum(ls.tokens for ls in learners)
            if config.eval_every and now - last_eval >= config.eval_every:
                last_eval = now
                last_loss, versions = evaluator.evaluate()
                record_metric(run_dir, started, status, last_loss, versions, evaluator.scores)
            by_id = {ls.learner_id: ls for ls in learners}
            if on_tick is not None:
                on_tick(elapsed)
            started_plans = [p for p in plans if p.id in sup.slots]
            everyone_trains = all(by_id.get(p.id) and by_id[p.id].step > 0 for p in started_plans)
            if everyone_trains or elapsed > config.start_timeout_s:
                sup.start_chaos()
            rows = view_rows(plans, sup, by_id, rates, now, elapsed)
            view.update(
                view_frame(
                    config,
                    elapsed,
                    rows,
                    val_loss=last_loss,
                    rounds=last_status.rounds if last_status else 0,
                    bytes_up=sum(ls.bytes_up for ls in learners),
                    bytes_down=sum(ls.bytes_down for ls in learners),
                )
            )
            if outputs is not None:
                outputs.update(rows)
            reason = stop_reason(
                config, elapsed, tokens, sup, waiting=len(plans) - len(started_plans)
            )
            if reason:
                return reason
    finally:
        view.close()


def stop_reason(config, elapsed: float, tokens: int, sup, waiting: int = 0) -> str | None:
    """Why the run stops now (``"time"``, ``"tokens"``, ``"learners finished"``: every started
    learner finished and none is ``waiting`` to start), or None."""
    if config.minutes and elapsed >= config.minutes * 60:
        return "time"
    if config.tokens and tokens >= config.tokens:
        return "tokens"
    if not waiting and all(s.finished for s in sup.learners()):
        return "learners finished"
    return None

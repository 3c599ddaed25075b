"""``diloco run --mode dp``: the data-parallel baseline under the same supervisor and summary.

The supervisor hosts the group's rendezvous store (a ``TCPStore`` on a free port), starts one
``diloco dp-worker`` per learner plan as a supervised *group* (one failure stops and restarts
all, :class:`diloco.launch.supervisor.Supervisor`), evaluates rank 0's parameter snapshot on
the held-out text every ``--eval-every`` seconds, and stops at ``--minutes`` / ``--tokens`` /
``--steps`` / Ctrl+C like the DiLoCo modes. The run directory has the same layout, with
``dp/`` (checkpoints and the snapshot) in place of ``syncer/`` state; the event tape
(``syncer/events.jsonl``) holds the chaos, group-stop and restart records.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

from diloco.config.dp_worker import DpWorkerConfig
from diloco.runtime.metrics import append_metric

#: Chaos kinds that mean something for a static group without a syncer.
DP_CHAOS_KINDS = ("kill", "hang")


def check_chaos(clauses) -> None:
    """Raise ValueError for chaos kinds the data-parallel baseline cannot carry out."""
    bad = sorted({c.kind for c in clauses} - set(DP_CHAOS_KINDS))
    if bad:
        raise ValueError(
            f"--mode dp supports chaos kinds {', '.join(DP_CHAOS_KINDS)} only, not "
            f"{', '.join(bad)} (there is no syncer and no relay in data-parallel training)"
        )


class SnapshotEvaluator:
    """Scores the newest snapshot rank 0 wrote (safetensors; never pickle)."""

    def __init__(self, recipe, path: Path, *, seed: int) -> None:
        self.recipe = recipe
        self.path = Path(path)
        self.model = recipe.build_model(seed)
        self.step, self.tokens = 0, 0
        self.scores: dict[str, float] = {}

    def evaluate(self) -> float:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except (OSError, RuntimeError):  # none yet: the initial parameters
            return self.recipe.evaluate(self.model)
        self.model.load_state_dict(tensors, strict=False)
        self.step, self.tokens = int(meta.get("step", 0)), int(meta.get("tokens", 0))
        self.scores = self.recipe.scores(self.model)
        return self.recipe.evaluate(self.model)


def run_dp(config, *, recipe, plans, chaos, run_dir: Path, tape, fabric=None, outputs=None) -> int:
    """Run the data-parallel baseline; returns the process exit code (0 clean). With
    ``fabric`` (``--wan``) rank i runs in learner i's namespace and all-reduces over its link
    (every pair of ranks meets through the hub, over both their links). ``outputs``
    (``diloco.dashboard.live.LiveOutputs``): the dashboard and TensorBoard scalars."""
    import sys

    import torch.distributed as dist

    from diloco.dashboard.live import LiveOutputs
    from diloco.launch.outputs import run_watch
    from diloco.launch.supervisor import Supervisor
    from diloco.runtime.spare import spare_count

    stop = threading.Event()
    interrupts = []

    def on_signal(signum, _frame) -> None:
        interrupts.append(signum)
        stop.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    started = time.time()
    outputs = outputs or LiveOutputs()
    outputs.begin(run_watch(config, run_dir, plans, started))
    first = [p for p in plans if p.start_at <= 0]  # the rest join by growing the group
    names = [p.id for p in first]
    sup = Supervisor(
        tape=tape.append,
        clock=lambda: time.time() - started,
        chaos=chaos,
        group=names,
        spares=0  # a spare waits in the hub namespace, not on a rank's link
        if fabric
        else spare_count(config.spares, chaos, restart_together=len(names), learners=len(names)),
    )
    snapshot = run_dir / "dp" / "global.safetensors"
    try:
        model0 = recipe.build_model(config.recipe.seed)
        facts = {
            "started": started,
            "num_params": sum(p.numel() for p in model0.parameters()),
            "val_initial": recipe.evaluate(model0),
            "scores_initial": recipe.scores(model0),
            "loss_unit": recipe.loss_unit,
            "tokens_per_sample": recipe.tokens_per_sample,
        }
        evaluator = SnapshotEvaluator(recipe, snapshot, seed=config.recipe.seed)
        start_ranks(config, sup, first, run_dir, store=store.port, started=started, fabric=fabric)
        growth = Growth(config, sup, first, run_dir, store=store.port, started=started)
        stopped_by = supervise_group(
            config, stop, started, sup, plans, evaluator, run_dir, outputs, growth
        )
        facts["stopped_by"] = "interrupt" if interrupts else stopped_by
        return finish(config, sup, plans, evaluator, run_dir, facts, fabric, outputs)
    except (RuntimeError, TimeoutError) as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 1
    finally:
        leftovers = [n for n, s in sup.slots.items() if s.child is not None and s.child.running]
        if leftovers:
            sup.stop(leftovers, timeout=5.0)
        sup.kill_everything()
        tape.close()
        del store
        for s, h in old_handlers.items():
            signal.signal(s, h)


def rank_config(
    config, plan, run_dir: Path, *, store: str, started: float, world: int
) -> DpWorkerConfig:
    """One rank's configuration (``diloco dp-worker --config``) in a group of ``world``; rank
    0 keeps the snapshot the evaluator reads."""
    return DpWorkerConfig(
        recipe=config.recipe,
        store=store,
        rank=plan.index,
        world=world,
        batch_size=plan.batch_size,
        slow=plan.slow,
        total_steps=config.steps,
        schedule_seconds=config.minutes * 60 if config.minutes else 0.0,
        run_started_epoch_s=started,
        checkpoint_dir=str(run_dir / "dp"),
        checkpoint_every_s=config.checkpoint_every_s,
        workdir=str(run_dir / "learners" / plan.id),
        snapshot=str(run_dir / "dp" / "global.safetensors") if plan.index == 0 else None,
        snapshot_every=config.eval_every or 5.0,
        exit_with_parent=True,
    )


def start_ranks(
    config, sup, plans, run_dir: Path, *, store: int, started: float, fabric=None
) -> None:
    """Write each rank's configuration and start it at generation 0 (the supervisor bumps
    ``--generation`` when it restarts the group). ``store``: the store's port on this host,
    or on the hub's address of each rank's link with ``fabric``."""
    for plan in plans:
        argv = rank_command(
            config, plan, run_dir, store=store, started=started, world=len(plans), fabric=fabric
        )
        sup.add(plan.id, argv, run_dir / "logs" / f"{plan.id}.log")


def rank_command(
    config,
    plan,
    run_dir: Path,
    *,
    store: int,
    started: float,
    world: int,
    generation=0,
    fabric=None,
) -> list[str]:
    """Write ``plan``'s rank configuration for a group of ``world`` and return its command."""
    from diloco.launch.children import write_config
    from diloco.runtime.procs import diloco_command

    host, prefix = "127.0.0.1", []
    if fabric is not None:  # gloo must use the rank's link, not a name that resolves
        from diloco.wan.fabric import LEARNER_IFACE

        host = fabric.hub_address(plan.index)
        prefix = [*fabric.exec_prefix(plan.index), "env", f"GLOO_SOCKET_IFNAME={LEARNER_IFACE}"]
    rank = rank_config(config, plan, run_dir, store=f"{host}:{store}", started=started, world=world)
    path = write_config(run_dir / "config" / f"{plan.id}.json", rank)
    return [*prefix, *diloco_command("dp-worker", f"--config={path}", f"--generation={generation}")]


class Growth:
    """``--add-learners`` for data-parallel: a static group grows the only way it can, by
    stopping and starting again at the new size. At each addition's time every rank stops at
    the same step and writes the final group checkpoint; then the group starts again with the
    added ranks (a new rendezvous generation): the old ranks resume from the checkpoint, the
    new ones take rank 0's model and optimizer (``dp.worker.Rank.restore``). The tape gets a
    ``resize`` record."""

    def __init__(self, config, sup, members, run_dir: Path, *, store: int, started: float):
        self.config, self.sup, self.members = config, sup, list(members)
        self.run_dir, self.store, self.started = run_dir, store, started

    def due(self, plans, elapsed: float) -> list:
        """The plans not in the group whose time to join has come."""
        inside = {p.id for p in self.members}
        return [p for p in plans if p.id not in inside and p.start_at <= elapsed]

    def waiting(self, plans) -> int:
        return sum(1 for p in plans if p.id not in {m.id for m in self.members})

    def grow(self, added) -> None:
        sup = self.sup
        names = [p.id for p in self.members]
        world = len(self.members) + len(added)
        sup.tape(
            {"event": "resize", "t": time.time(), "world": world, "added": [p.id for p in added]}
        )
        sup.stop(names, timeout=self.config.stop_after_s)  # SIGTERM: final group checkpoint
        sup.generation += 1
        self.members += added
        sup.group = [p.id for p in self.members]
        for plan in self.members:
            argv = rank_command(
                self.config,
                plan,
                self.run_dir,
                store=self.store,
                started=self.started,
                world=world,
                generation=sup.generation,
            )
            if plan.id in sup.slots:
                sup.relaunch(plan.id, argv)
            else:
                sup.add(plan.id, argv, self.run_dir / "logs" / f"{plan.id}.log")


def finish(
    config, sup, plans, evaluator, run_dir: Path, facts: dict, fabric=None, outputs=None
) -> int:
    """Stop the group, score the last snapshot, write and print the summary."""
    from diloco.launch.loop import finished_rows
    from diloco.report.summary import format_summary

    facts["train_end"] = time.time()
    plans = [p for p in plans if p.id in sup.slots]  # (not those still waiting to join)
    facts["codes"] = codes = sup.stop([p.id for p in plans], timeout=config.stop_after_s)
    counters = fabric.counters() if fabric is not None else None
    facts["val_final"] = evaluator.evaluate()
    facts["scores"] = (facts.pop("scores_initial"), evaluator.scores)
    record_metric(run_dir, facts["started"], evaluator, facts["val_final"])
    summary = summarize_dp(config, run_dir, plans, sup, facts)
    if fabric is not None:
        from diloco.launch.wan import wan_section

        summary["wan"] = wan_section(fabric, counters, summary, plans)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if outputs is not None:
        outputs.close(finished_rows(summary), end=facts["train_end"])
    print(json.dumps(summary, indent=1) if config.json else format_summary(summary))
    return 0 if all(c in (0, None) for c in codes.values()) else 1


def supervise_group(
    config, stop, started, sup, plans, evaluator, run_dir, outputs=None, growth=None
) -> str:
    """The supervisor loop for the group: failures, growth (``--add-learners``), view,
    evaluation, stop conditions, and the learner rows for ``outputs`` (the dashboard)."""
    from diloco.launch.loop import check_crashes, stop_reason, view_frame
    from diloco.launch.view import LiveView

    view = LiveView(enabled=not config.json and not config.no_view)
    tails = {p.id: ProgressTail(run_dir / "learners" / p.id / "progress.jsonl") for p in plans}
    last_eval, last_loss = 0.0, None
    try:
        while True:
            if stop.wait(0.25):
                return "interrupt"
            added = growth.due(plans, time.time() - started) if growth else []
            if added:
                growth.grow(added)
            sup.poll()
            check_crashes(sup)
            latest = {name: tail.latest() for name, tail in tails.items()}
            now = time.time()
            if config.eval_every and now - last_eval >= config.eval_every:
                last_eval = now
                last_loss = evaluator.evaluate()
                record_metric(run_dir, started, evaluator, last_loss)
            training = all(latest[n] is not None and "event" not in latest[n] for n in sup.group)
            if training or now - started > config.start_timeout_s:
                sup.start_chaos()
            tokens = sum(r.get("tokens", 0) for r in latest.values() if r)
            rows = [row(p, sup.slots.get(p.id), latest[p.id]) for p in plans]
            view.update(
                view_frame(
                    config,
                    now - started,
                    rows,
                    val_loss=last_loss,
                    rounds=(latest[plans[0].id] or {}).get("step", 0),
                    bytes_up=sum(r.get("bytes_up", 0) for r in latest.values() if r),
                    bytes_down=sum(r.get("bytes_down", 0) for r in latest.values() if r),
                )
            )
            if outputs is not None:
                outputs.update(rows)
            waiting = growth.waiting(plans) if growth else 0
            reason = stop_reason(config, now - started, tokens, sup, waiting)
            if reason:
                return reason
    finally:
        view.close()


def row(plan, slot, record: dict | None) -> dict:
    name = plan.id
    if slot is None:
        from diloco.launch.loop import clock

        state = f"joins at {clock(plan.start_at)}"
    elif slot.finished:
        state = "finished"
    elif slot.resume_at is not None:
        state = "hung (chaos)"
    elif slot.restart_at is not None or slot.child is None or not slot.child.running:
        state = "down (group restarts)"
    elif record is None or "event" in record:
        state = "starting"
    else:
        state = "training"
    record = record or {}
    return {
        "id": name,
        "step": record.get("step", 0),
        "tokens": record.get("tokens", 0),
        "tokens_per_s": 0.0,
        "steps_per_s": record.get("steps_per_s", 0.0),
        "live": state == "training",
        "state": state,
    }


class ProgressTail:
    """The newest record of a growing JSONL file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.last: dict | None = None

    def latest(self) -> dict | None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.last
        end = data.rfind(b"\n") + 1  # only whole lines
        for line in data[:end].splitlines():
            try:
                self.last = json.loads(line)
            except json.JSONDecodeError:
                continue
        self.offset += end
        return self.last


def record_metric(run_dir: Path, started: float, evaluator: SnapshotEvaluator, loss: float):
    """One line of ``metrics.jsonl`` (``diloco.runtime.metrics``): the held-out loss of the
    newest snapshot; a data-parallel step is its version and its round."""
    append_metric(
        run_dir,
        started=started,
        val_loss=loss,
        scores=evaluator.scores,
        versions=evaluator.step,
        tokens=evaluator.tokens,
        rounds=evaluator.step,
    )


def summarize_dp(config, run_dir: Path, plans, sup, facts: dict) -> dict:
    """``summary.json`` of a data-parallel run: the same fields as the DiLoCo modes'."""
    from diloco.launch.results import learner_row, read_progress
    from diloco.report.dp_metrics import dp_metrics
    from diloco.report.summary import add_scores, build_summary
    from diloco.syncer.store import read_tape

    records = read_tape(run_dir / "syncer" / "events.jsonl")
    progress = {p.id: read_progress(run_dir / "learners" / p.id / "progress.jsonl") for p in plans}
    per_learner = []
    for plan in plans:
        mine = progress[plan.id]
        surviving_steps = int(mine[-1].get("step", 0)) if mine else 0  # a step is a round
        row = learner_row(plan, mine, sup.slots[plan.id], facts, surviving_steps)
        per_learner.append(row)
    summary = build_summary(
        mode="dp",
        run_dir=str(run_dir),
        wall_s=time.time() - facts["started"],
        val_initial=facts["val_initial"],
        val_final=facts["val_final"],
        rounds=per_learner[0]["steps"],
        learners=per_learner,
        num_params=facts["num_params"],
        tokens_per_sample=facts["tokens_per_sample"],
        stopped_by=facts["stopped_by"],
    )
    summary["started_at"] = facts["started"]
    summary["train_s"] = round(facts["train_end"] - facts["started"], 2)
    add_scores(summary, facts)
    restarts = [r for r in records if r.get("event") == "restart"]
    chaos = [r for r in records if r.get("event") == "chaos"]
    summary.update(dp_metrics(progress, restarts, end=facts["train_end"], chaos=chaos))
    summary["failures_injected"] = [
        {k: r[k] for k in ("t", "kind", "target", "down_s") if k in r} for r in chaos
    ]
    summary["group_restarts"] = sum(1 for r in records if r.get("event") == "group-stop")
    summary["syncer_restarts"] = 0
    return summary

"""``diloco launch``: a syncer for the user's model and N copies of the user's own script.

``diloco launch --learners N --model MODULE:CALLABLE train.py ARGS`` checks its inputs (the
script is a file, ``--model`` builds a model, ``--eval`` is callable: else one line, exit 2,
nothing left behind), then composes what ``diloco run`` has: the syncer process
(``diloco syncer --model ... --stop-when-learners-leave``), the supervisor's process slots
and restarts (``diloco.launch.supervisor``), the live view, dashboard and TensorBoard
(``diloco.launch.outputs``), the evaluator (with ``--eval``) and the run's summary
(``diloco.launch.results``). Each copy runs ``python train.py ARGS`` in this working directory
with the environment ``diloco.Learner.from_env`` reads (``diloco.learner.from_env``: the
syncer's address, its learner id, index, N, its own token and work directory).

A copy that fails is restarted with the same id and work directory, so it resumes from its
checkpoint, at most ``--max-restarts`` times. The run ends when every copy has ended (exit 0):
the syncer then stops by itself (every learner has left) and the summary is written; on
Ctrl+C or SIGTERM the copies get SIGTERM (each flushes its progress and exits), then the
syncer is stopped. The run directory is ``diloco run``'s:

    runs/<name>/config.json       the launch's configuration (``LaunchConfig``)
    runs/<name>/config/syncer.json
    runs/<name>/syncer/           the syncer's durable state and event tape (events.jsonl)
    runs/<name>/learners/<id>/    each copy's work directory: checkpoint, journal,
                                  progress.jsonl (with the script's training loss), final.json
    runs/<name>/logs/             one log per process (a copy's output: logs/<id>.log)
    runs/<name>/metrics.jsonl     with --eval: the global model's held-out loss over time
    runs/<name>/summary.json      the summary; ``diloco report`` and ``diloco export`` read it
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from pathlib import Path

from diloco.config.launch import LaunchConfig
from diloco.launch.children import LearnerPlan, write_config
from diloco.launch.loop import finished_rows, record_metric, supervise
from diloco.launch.run import abandon, close_run_parts, wait_for_settled
from diloco.launch.syncers import StatusClient, syncer_commands

LOOPBACK = "127.0.0.1"
"""Where the syncer binds with the local backend."""
SYNCER = "syncer"
"""The syncer's slot (one process: ``diloco launch`` does not shard)."""
TRAINING_LOSS_POINTS = 200
"""At most this many training-loss points per learner in ``summary.json``."""


class UserEval:
    """``--eval``: the user's callable as the evaluator's recipe (``diloco.launch.evaluator``):
    the model from ``--model``, its held-out loss from ``CALLABLE(model)``."""

    loss_unit = "loss"

    def __init__(self, model_ref: str, eval_ref: str) -> None:
        from diloco.runtime.model_ref import load_model

        self.model_ref = model_ref
        self.score = load_callable(eval_ref, "--eval")
        self.load_model = load_model

    def build_model(self, _seed: int):
        return self.load_model(self.model_ref)

    def evaluate(self, model) -> float:
        import torch

        with torch.no_grad():
            return float(self.score(model))

    def scores(self, _model) -> dict:
        return {}


def load_callable(ref: str, flag: str):
    """The callable ``MODULE:CALLABLE`` names (imported from the working directory);
    ``ValueError`` naming ``flag`` if there is none."""
    import importlib
    import os

    module_name, _, attribute = ref.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{flag} {ref}: {exc}") from None
    if not callable(target):
        raise ValueError(f"{flag} {ref}: {attribute} is not callable")
    return target


def check_inputs(config: LaunchConfig):
    """The user's model (``--model`` built once here), or ``ValueError`` with one line: the
    script is not a file, the model cannot be built, ``--eval`` is not callable, the Ray
    options cannot be used (``ray_backend.check_config``: Ray not installed, a Ray option
    without ``--backend ray``; ``--ray-max-restarts``, which ``--max-restarts`` is here)."""
    from diloco.launch.ray_backend import check_config
    from diloco.runtime.model_ref import load_model

    if config.ray.ray_max_restarts is not None:
        raise ValueError(
            "--ray-max-restarts: diloco launch restarts a copy at most --max-restarts times"
        )
    check_config(config, set())  # (fills in the Ray defaults)
    if not config.script:
        raise ValueError("give the training script: diloco launch [options] train.py [ARGS]")
    if not Path(config.script).is_file():
        raise ValueError(f"{config.script}: no such file (the training script)")
    model = load_model(config.model)  # ModelRefError is a ValueError
    if config.eval:
        load_callable(config.eval, "--eval")
    return model


def launch(config: LaunchConfig) -> int:
    """Run to the end; returns the exit status (0 clean, 1 a process failed, 2 bad input)."""
    import torch

    from diloco.launch.outputs import open_outputs
    from diloco.launch.secrets import with_token
    from diloco.syncer.store import EventTape
    from diloco.wire.auth import AuthConfigError, load_token

    torch.set_num_threads(1)
    try:
        model = check_inputs(config)
    except ValueError as exc:
        print(f"diloco launch: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(config.runs_dir) / (config.name or time.strftime("%Y%m%d-%H%M%S"))
    if run_dir.exists():
        print(f"diloco launch: {run_dir} already exists; pick another --name", file=sys.stderr)
        return 2
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # removed on a refusal
    (run_dir / "logs").mkdir(parents=True)
    config = with_token(config, run_dir)
    try:
        token = load_token(config.token_file)
        outputs = open_outputs(config, run_dir, token)
    except (OSError, ValueError, AuthConfigError) as exc:
        print(f"diloco launch: {exc}", file=sys.stderr)
        return abandon(made)
    if outputs.url:
        print(f"dashboard: {outputs.url}", file=sys.stderr, flush=True)
    write_config(run_dir / "config.json", config)
    tape = EventTape(run_dir / "syncer" / "events.jsonl")
    try:
        return ScriptLaunch(config, run_dir, tape, outputs, model, token).run()
    finally:
        outputs.close()


class ScriptLaunch:
    """One launch: start the syncer, the evaluator (``--eval``) and the copies, supervise,
    then stop in order and write the summary."""

    def __init__(self, config: LaunchConfig, run_dir: Path, tape, outputs, model, token) -> None:
        self.config, self.run_dir, self.tape, self.outputs = config, run_dir, tape, outputs
        self.token = token
        self.num_params = sum(p.numel() for p in model.parameters())
        self.plans = [LearnerPlan(f"learner-{i}", i, 1, 1.0) for i in range(config.learners)]
        self.stop = threading.Event()
        self.interrupts: list[int] = []
        self.started = time.time()
        self.out = sys.stdout  # (the Ray backend diverts sys.stdout to stderr while it runs)
        self.sup = self.evaluator = self.status_client = None
        self.val_initial = None

    def _on_signal(self, signum, _frame) -> None:
        self.interrupts.append(signum)
        self.stop.set()

    def run(self) -> int:
        from diloco.dashboard.watch import RunWatch
        from diloco.launch.ray_script import make_launch_supervisor
        from diloco.wire.auth import AuthConfigError

        config = self.config
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.sup = make_launch_supervisor(
                config, tape=self.tape.append, clock=lambda: time.time() - self.started
            )
            self.outputs.begin(
                RunWatch(
                    tape=self.run_dir / "syncer" / "events.jsonl",
                    fragments=config.syncer.protocol.num_fragments,
                    started=self.started,
                    name=self.run_dir.name,
                    budget_s=config.minutes * 60 if config.minutes else None,
                    metrics=self.run_dir / "metrics.jsonl",
                    progress={p.id: self.workdir(p) / "progress.jsonl" for p in self.plans},
                    loss_unit=UserEval.loss_unit,
                )
            )
            address = self.start_syncer()
            if config.eval:
                self.start_evaluator(address)
            for plan in self.plans:
                self.start_copy(plan, address)
            stopped_by = supervise(
                config if config.eval else dataclasses.replace(config, eval_every=0.0),
                self.stop,
                self.started,
                self.sup,
                self.plans,
                self.evaluator,
                self.status_client,
                self.run_dir,
                out=self.out,
                outputs=self.outputs,
                max_restarts=config.max_restarts,
            )
            return self.finish("interrupt" if self.interrupts else stopped_by)
        except (RuntimeError, TimeoutError, ConnectionError, AuthConfigError) as exc:
            print(f"diloco launch: {exc}", file=sys.stderr)
            return 1
        finally:
            close_run_parts(self.evaluator, self.status_client, self.sup)
            self.tape.close()
            for s, h in old.items():
                signal.signal(s, h)

    def workdir(self, plan: LearnerPlan) -> Path:
        return self.run_dir / "learners" / plan.id

    def start_syncer(self) -> str:
        """Start the syncer for ``--model``; returns the address the copies are given once it
        serves (``@PORT_FILE`` for a syncer Ray may restart on another node)."""
        from diloco.config.common import ServerSecurityConfig
        from diloco.config.service import ServiceConfig
        from diloco.runtime.procs import diloco_command, wait_for_file
        from diloco.wire.auth import check_bind

        config, run_dir = self.config, self.run_dir
        service = ServiceConfig(
            model=config.model,
            syncer=config.syncer,
            security=ServerSecurityConfig(
                token_file=config.token_file, learner_tokens=config.token_file is not None
            ),
            stop_when_learners_leave=True,
        )
        path = write_config(run_dir / "config" / "syncer.json", service)
        host = getattr(self.sup, "syncer_host", LOOPBACK)  # (Ray's: --ray-syncer-host)
        check_bind(f"{host}:0", self.token)
        ((name, argv),) = syncer_commands(run_dir, 1, [f"--config={path}"], host=host)
        slot = self.sup.add(name, diloco_command("syncer", *argv), run_dir / "logs" / "syncer.log")
        port_file = run_dir / f"{name}.addr"
        address = wait_for_file(port_file, config.start_timeout_s, alive=slot.child)
        if getattr(self.sup, "syncer_moves", False):  # the copies follow it where it restarts
            address = f"@{port_file.resolve()}"
        else:  # a restarted syncer comes back on the same address: the copies reconnect
            slot.argv = [f"--bind={address}" if a.startswith("--bind=") else a for a in slot.argv]
        self.status_client = StatusClient([address], self.token)
        return address

    def start_evaluator(self, address: str) -> None:
        """``--eval``: score the initial model, then follow the global one as an observer."""
        from diloco.launch.evaluator import Evaluator
        from diloco.wire.auth import client_link_options, learner_token

        user_eval = UserEval(self.config.model, self.config.eval)
        self.val_initial = user_eval.evaluate(user_eval.build_model(0))
        self.evaluator = Evaluator(
            user_eval,
            address,
            seed=0,
            num_fragments=self.config.syncer.protocol.num_fragments,
            link_options=client_link_options(
                token=learner_token(self.token, "evaluator") if self.token else None
            ),
        )

    def start_copy(self, plan: LearnerPlan, address: str) -> None:
        """Start one copy of the script with the environment ``Learner.from_env`` reads."""
        from diloco.launch.secrets import learner_token_file
        from diloco.learner.from_env import LaunchEnv

        config = self.config
        env = LaunchEnv(
            syncer=address,
            learner_id=plan.id,
            index=plan.index,
            learners=config.learners,
            workdir=self.workdir(plan).resolve(),
            token_file=learner_token_file(self.run_dir, self.token, plan.id)
            if self.token
            else None,
            num_fragments=config.syncer.protocol.num_fragments,
            checkpoint_every=config.checkpoint_every_s,
        )
        argv = [sys.executable, config.script, *config.args]
        self.sup.add(plan.id, argv, self.run_dir / "logs" / f"{plan.id}.log", env=env.variables())

    def stop_syncer(self, by_itself: bool) -> int | None:
        """The syncer's exit status: waited for (``by_itself``: every copy has left, so it
        stops on its own within its lease; stopped if it has not within the start timeout),
        or stopped now."""
        slot = self.sup.slots[SYNCER]
        if by_itself and slot.child is not None:
            deadline = time.monotonic() + self.config.syncer.lease_s + self.config.start_timeout_s
            while slot.child.running and time.monotonic() < deadline:
                time.sleep(0.1)
            if not slot.child.running:
                code = slot.child.poll()
                slot.exit_codes.append(code)
                slot.child.close_log()
                slot.finished = True
                return code
            print("diloco launch: the syncer did not stop by itself; stopping it", file=sys.stderr)
        return self.sup.stop([SYNCER], timeout=10.0).get(SYNCER)

    def finish(self, stopped_by: str) -> int:
        """Stop the copies (they flush), score the final model (``--eval``), let the syncer
        stop, write and print the summary; returns the exit status."""
        from diloco.launch.results import summarize
        from diloco.report.summary import format_summary

        config, sup = self.config, self.sup
        train_end = time.time()
        codes = sup.stop([p.id for p in self.plans], timeout=config.stop_after_s)
        val_final = None
        if self.evaluator is not None:
            status = wait_for_settled(self.status_client, timeout=config.start_timeout_s)
            if status is not None:
                self.evaluator.wait_for_versions(list(status.versions), timeout=5.0)
            val_final, versions = self.evaluator.evaluate()
            record_metric(self.run_dir, self.started, status, val_final, versions)
            self.evaluator.close()
            self.evaluator = None
        syncer_code = self.stop_syncer(by_itself=stopped_by == "learners finished")
        for plan in self.plans:  # what one step of the copy held (for the bytes per token)
            plan.batch_size = tokens_per_step(self.workdir(plan) / "progress.jsonl")
        facts = {
            "started": self.started,
            "train_end": train_end,
            "val_initial": self.val_initial,
            "val_final": val_final,
            "num_params": self.num_params,
            "tokens_per_sample": 1,
            "stopped_by": stopped_by,
            "codes": codes,
            "loss_unit": UserEval.loss_unit if config.eval else None,
        }
        summary = summarize(config, self.run_dir, self.plans, sup, facts)
        summary["script"] = [config.script, *config.args]
        summary["model"] = config.model
        summary["training_loss"] = {
            p.id: training_loss(self.workdir(p) / "progress.jsonl", self.started)
            for p in self.plans
        }
        summary["syncer_exit_code"] = syncer_code
        summary["backend"] = config.backend
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.outputs.close(finished_rows(summary), end=train_end)
        text = json.dumps(summary, indent=1) if config.json else format_summary(summary)
        print(text, file=self.out)
        clean = syncer_code == 0 and all(c == 0 for c in codes.values())
        return 0 if clean else 1


def tokens_per_step(progress: Path) -> int:
    """Tokens per step of a copy, from its progress records (1 when it recorded none)."""
    from diloco.runtime.jsonl import read_jsonl

    last = {k: v for rec in read_jsonl(progress) for k, v in rec.items()}
    steps, tokens = int(last.get("step", 0)), int(last.get("tokens", 0))
    return max(1, round(tokens / steps)) if steps else 1


def training_loss(progress: Path, started: float) -> list[list[float]]:
    """``[[t, step, loss], ...]`` (``t``: seconds since ``started``) from a copy's progress
    records over all its lives, thinned to at most ``TRAINING_LOSS_POINTS``."""
    from diloco.runtime.jsonl import read_jsonl

    points = [
        [round(r["t"] - started, 3), r["step"], r["loss"]]
        for r in read_jsonl(progress)
        if r.get("loss") is not None and "step" in r and "event" not in r
    ]
    stride = max(1, -(-len(points) // TRAINING_LOSS_POINTS))
    return points[::stride]

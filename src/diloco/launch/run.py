"""``diloco run``: the embedded default. A syncer, M learners and an evaluator on this machine.

The supervisor (this process) starts the syncer and the learners as separate processes, joins
the syncer as an evaluator, draws the live view, and stops everything at ``--minutes``,
``--tokens``, when every learner has finished, or on Ctrl+C. Shutdown is ordered and bounded:
learners get SIGTERM (each flushes its progress and exits), then the evaluator scores the final
global model, then the syncer stops. The run directory holds everything:

    runs/<name>/config.json        the run's configuration (``diloco.config.run.RunConfig``)
    runs/<name>/config/            each child's configuration (syncer.json, <learner id>.json)
    runs/<name>/syncer/            durable syncer state and the event tape (events.jsonl)
    runs/<name>/syncer-<i>/        with --shards S: shard i's durable state (one shared tape)
    runs/<name>/learners/<id>/     progress.jsonl, final.json, final.safetensors
    runs/<name>/logs/              one log per process
    runs/<name>/token, secrets/    the run's secret and each learner's own token (mode 0600)
    runs/<name>/metrics.jsonl      held-out loss of the global model over time
    runs/<name>/summary.json       the summary (also printed; ``--json`` prints it as JSON)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.config.run import RunConfig
from diloco.launch.children import (
    LearnerPlan,
    corrupt_settings,
    plan_learners,
    service_config,
    worker_config,
    write_config,
)
from diloco.launch.loop import finished_rows, record_metric, supervise
from diloco.launch.modes import registered
from diloco.launch.outputs import open_outputs, run_watch
from diloco.launch.syncers import StatusClient, syncer_commands, syncer_names
from diloco.launch.wan import WAN_BIND_HOST, check_wan, on_link, wan_section
from diloco.runtime.config_files import toml_text
from diloco.runtime.schema import to_dict

__all__ = ["StatusClient", "run"]


@dataclass
class Prepared:
    """A run's inputs, checked before anything starts."""

    recipe: object
    plans: list[LearnerPlan]
    clauses: list
    chaos: list
    corrupt: dict
    token: str | None


def prepare(config: RunConfig) -> Prepared:
    """Validate the data, the learners, the chaos spec, the token, the backend and the
    optional packages asked for; raises ``DataError``, ``ChaosSpecError``, ``ValueError`` or
    ``MissingExtra`` with a message for the user."""
    from diloco.chaos import corruptions, parse_spec, schedule
    from diloco.dashboard.wandb_log import check_wandb
    from diloco.launch import ray_backend
    from diloco.recipes import recipe_of
    from diloco.wire.auth import load_token

    horizon = config.minutes * 60 if config.minutes else 24 * 3600.0
    clauses = parse_spec(config.chaos or "")
    chaos = schedule(clauses, config.learners, horizon, config.recipe.seed)
    corrupt = {w.index: w for w in corruptions(clauses, config.learners)}
    token = load_token(config.token_file)
    check_shards(config, clauses)
    mode = registered(config.mode)
    if mode is not None:
        mode.check_chaos(clauses)
    ray_backend.check_config(config, {c.kind for c in clauses})
    check_wan(config, clauses)
    check_wandb(config.wandb)
    if any(c.kind == "disk-full" for c in clauses) and os.geteuid() != 0:
        raise ValueError("--chaos disk-full needs root: it mounts a small tmpfs for the syncer")
    check_additions(config, plan_learners(config, 1))  # (the batch sizes: once the recipe's)
    # Then what needs the recipe, whose module imports torch (a second or more): the flags'
    # mistakes above are said at once.
    recipe = recipe_of(config.recipe)
    plans = plan_learners(config, recipe.batch_size)
    recipe.load_data()  # validate the data and the model before starting anything
    recipe.build_model(config.recipe.seed)  # (a recipe's missing optional package says so)
    return Prepared(recipe, plans, clauses, chaos, corrupt, token)


def check_additions(config: RunConfig, plans) -> None:
    """Refuse (``ValueError``) ``--add-learners`` where learners cannot join mid-run."""
    late = [p for p in plans if p.start_at > 0]
    if not late:
        return
    if config.mode == "sync":
        raise ValueError(
            "--add-learners needs --mode decoupled or dp (synchronous DiLoCo waits for a fixed M)"
        )
    if config.ray.backend != "local" or config.wan:
        raise ValueError("--add-learners runs on the local backend without --wan (for now)")
    if config.minutes and max(p.start_at for p in late) >= config.minutes * 60:
        raise ValueError("--add-learners: every AT must come before the end of --minutes")


def run(config: RunConfig) -> int:
    """Run to the end; returns the exit status (0 clean, 1 a process failed, 2 bad input)."""
    from diloco.chaos import ChaosSpecError
    from diloco.launch.secrets import with_token
    from diloco.recipes import DataError
    from diloco.runtime.optional import MissingExtra
    from diloco.wire.auth import load_token

    try:
        prep = prepare(config)
    except (DataError, ChaosSpecError, ValueError, MissingExtra) as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    import torch

    from diloco.syncer.store import EventTape

    torch.set_num_threads(1)
    run_dir = Path(config.runs_dir) / (config.name or time.strftime("%Y%m%d-%H%M%S"))
    if config.ray.backend == "ray":  # the actors' processes may run elsewhere: no relative paths
        run_dir = run_dir.resolve()
    if run_dir.exists():
        print(f"diloco run: {run_dir} already exists; pick another --name", file=sys.stderr)
        return 2
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # removed on a refusal
    (run_dir / "logs").mkdir(parents=True)
    config = with_token(config, run_dir)
    prep.token = load_token(config.token_file)
    try:
        outputs = open_outputs(config, run_dir, prep.token)
    except (OSError, ValueError) as exc:  # a busy port; AuthConfigError is a ValueError
        print(
            f"diloco run: cannot serve the dashboard on {config.dashboard}: {exc}", file=sys.stderr
        )
        return abandon(made)
    if outputs.url:
        print(f"dashboard: {outputs.url}", file=sys.stderr, flush=True)
    fabric = None
    if config.wan:
        from diloco.launch.wan import open_fabric
        from diloco.wan.fabric import WanUnavailable

        try:
            fabric = open_fabric(config)
        except WanUnavailable as exc:
            print(f"diloco run: {exc}", file=sys.stderr)
            outputs.close()
            return abandon(made)
    write_config(run_dir / "config.json", config)
    (run_dir / "config.toml").write_text(toml_text(to_dict(config)))  # the same, to edit
    write_command(run_dir / COMMAND_FILE, config)
    tape = EventTape(run_dir / "syncer" / "events.jsonl")
    try:
        mode = registered(config.mode)
        if mode is not None:  # (the data-parallel baseline: diloco.baselines.dp)
            return mode.run(
                config,
                recipe=prep.recipe,
                plans=prep.plans,
                chaos=prep.chaos,
                run_dir=run_dir,
                tape=tape,
                fabric=fabric,
                outputs=outputs,
            )
        return Launch(config, prep, run_dir, tape, fabric, outputs=outputs).run()
    finally:
        outputs.close()
        if fabric is not None:
            fabric.close()


COMMAND_FILE = "command.txt"
"""The run's own command as flags (``diloco report`` shows how to repeat a run with it)."""


def write_command(path: Path, config: RunConfig) -> None:
    """``diloco run`` with the flags that make ``config`` (the paths and secrets left out)."""
    import shlex

    from diloco.runtime.schema import command_flags

    flags = command_flags(config, skip=("name", "runs_dir", "token_file", "json", "no_view"))
    path.write_text(shlex.join(["diloco", "run", *flags]) + "\n")


class Launch:
    """One decoupled or synchronous run: start the syncer(s), the evaluator and the learners,
    supervise, then stop in order and write the summary."""

    def __init__(
        self, config: RunConfig, prep: Prepared, run_dir: Path, tape, fabric=None, outputs=None
    ) -> None:
        from diloco.dashboard.live import LiveOutputs

        self.config, self.prep, self.run_dir, self.tape = config, prep, run_dir, tape
        self.fabric = fabric
        """The wide-area links (``--wan``), or None: everything on this host's loopback."""
        self.outputs = outputs or LiveOutputs()
        """The dashboard and TensorBoard scalars (``diloco.launch.outputs``)."""
        self.out = sys.stdout  # the view and the summary (a launcher may divert sys.stdout)
        self.stop = threading.Event()
        self.interrupts: list[int] = []
        self.started = time.time()
        self.sup = self.evaluator = self.status_client = None

    def _on_signal(self, signum, _frame) -> None:
        self.interrupts.append(signum)
        self.stop.set()

    def run(self) -> int:
        from diloco.runtime.spare import spare_count
        from diloco.wire.auth import AuthConfigError

        old_handlers = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)
        }
        disk = None
        try:
            if any(c.kind == "disk-full" for c in self.prep.clauses):
                disk = mount_syncer_disk(self.run_dir, self.prep.recipe, self.config.recipe.seed)
            self.sup = make_supervisor(
                self.config,
                disk=disk,
                tape=self.tape.append,
                clock=lambda: time.time() - self.started,
                chaos=self.prep.chaos,
                spares=0  # a spare waits in the hub namespace, not on a learner's link
                if self.fabric
                else spare_count(
                    self.config.spares,
                    self.prep.chaos,
                    restart_together=1,
                    learners=self.config.learners,
                ),
            )
            self.outputs.begin(run_watch(self.config, self.run_dir, self.prep.plans, self.started))
            address = self.start_syncers()
            self.start_evaluator(address)
            self.start_learners(address)
            stopped_by = supervise(
                self.config,
                self.stop,
                self.started,
                self.sup,
                self.prep.plans,
                self.evaluator,
                self.status_client,
                self.run_dir,
                out=self.out,
                outputs=self.outputs,
                on_tick=self.start_due,
            )
            return self.finish("interrupt" if self.interrupts else stopped_by)
        except (RuntimeError, TimeoutError, ConnectionError, AuthConfigError) as exc:
            print(f"diloco run: {exc}", file=sys.stderr)
            return 1
        finally:
            close_run_parts(self.evaluator, self.status_client, self.sup)
            if disk is not None:  # (after the syncer stopped: its files stay in the run)
                disk.unmount_keeping_files()
            self.tape.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)

    def start_syncers(self) -> str:
        """Start every syncer shard, wait for its address; returns the learners' address."""
        from diloco.chaos import NETWORK_KINDS
        from diloco.launch.relay import Relay
        from diloco.runtime.procs import diloco_command, wait_for_file
        from diloco.wire.auth import check_bind

        config, sup, run_dir = self.config, self.sup, self.run_dir
        host = WAN_BIND_HOST if self.fabric else getattr(sup, "syncer_host", "127.0.0.1")
        check_bind(f"{host}:0", self.prep.token)
        path = write_config(run_dir / "config" / "syncer.json", service_config(config))
        addresses = []
        for name, argv in syncer_commands(run_dir, config.shards, [f"--config={path}"], host=host):
            slot = sup.add(name, diloco_command("syncer", *argv), run_dir / "logs" / f"{name}.log")
            port_file = run_dir / f"{name}.addr"
            bound = wait_for_file(port_file, config.start_timeout_s, alive=slot.child)
            if getattr(sup, "syncer_moves", False):  # learners follow it wherever it restarts
                addresses.append(f"@{port_file}")
                continue
            addresses.append(bound)
            # A restarted syncer comes back on the same address, so learners just reconnect.
            bind0 = f"--bind={host}:0"
            slot.argv = [f"--bind={addresses[-1]}" if a == bind0 else a for a in slot.argv]
        address = ",".join(addresses)  # one address, or every shard's
        if self.fabric:  # the supervisor's own clients use the hub's loopback
            address = on_link(address, "127.0.0.1")
            addresses = address.split(",")
        self.status_client = StatusClient(addresses, self.prep.token)
        if any(c.kind in NETWORK_KINDS for c in self.prep.clauses):  # learners go via relays
            sup.relays.update({p.id: Relay(address, name=f"relay-{p.id}") for p in self.prep.plans})
        return address

    def start_evaluator(self, address: str) -> None:
        """Score the initial model, then join the syncer as an observer."""
        from diloco.launch.evaluator import Evaluator
        from diloco.wire.auth import client_link_options, learner_token

        recipe, seed = self.prep.recipe, self.config.recipe.seed
        model0 = recipe.build_model(seed)
        self.num_params = sum(p.numel() for p in model0.parameters())
        self.val_initial = recipe.evaluate(model0)
        self.scores_initial = recipe.scores(model0)
        del model0
        self.evaluator = Evaluator(
            recipe,
            address,
            seed=seed,
            num_fragments=self.config.syncer.protocol.num_fragments,
            link_options=client_link_options(
                token=learner_token(self.prep.token, "evaluator") if self.prep.token else None
            ),
        )

    def start_learners(self, address: str) -> None:
        """Start the learners due at the start; ``start_due`` starts the others later."""
        self.address = address
        self.start_due(0.0)

    def start_due(self, elapsed: float) -> None:
        """Start every learner whose ``start_at`` has come and that is not started yet
        (``--add-learners``: an ``added`` record on the tape for each)."""
        for plan in self.prep.plans:
            if plan.id not in self.sup.slots and plan.start_at <= elapsed:
                self.start_learner(plan, self.address)
                if plan.start_at > 0:
                    self.tape.append({"event": "added", "t": time.time(), "target": plan.id})

    def start_learner(self, plan, address: str) -> None:
        """Write a learner's configuration and start it (through its relay, if any)."""
        from diloco.launch.secrets import learner_token_file
        from diloco.runtime.procs import diloco_command

        sup, run_dir = self.sup, self.run_dir
        corrupt = corrupt_settings(self.prep.corrupt.get(plan.index), self.started, self.tape)
        syncer = sup.relays[plan.id].address if plan.id in sup.relays else address
        prefix: list[str] = []
        if self.fabric:  # on its own link, in its own namespace
            syncer = on_link(address, self.fabric.hub_address(plan.index))
            prefix = self.fabric.exec_prefix(plan.index)
        worker = worker_config(
            self.config,
            plan,
            syncer=syncer,
            started=self.started,
            workdir=run_dir / "learners" / plan.id,
            corrupt=corrupt,
            token_file=learner_token_file(run_dir, self.prep.token, plan.id)
            if self.prep.token
            else None,
        )
        path = write_config(run_dir / "config" / f"{plan.id}.json", worker)
        sup.add(
            plan.id,
            [*prefix, *diloco_command("learner", f"--config={path}")],
            run_dir / "logs" / f"{plan.id}.log",
        )

    def finish(self, stopped_by: str) -> int:
        """Stop the learners (they flush), score the final global model, stop the syncer,
        write and print the summary; returns the exit status."""
        from diloco.launch.results import summarize
        from diloco.report.summary import format_summary

        config, sup = self.config, self.sup
        plans = [p for p in self.prep.plans if p.id in sup.slots]  # those that started
        train_end = time.time()
        codes = sup.stop([p.id for p in plans], timeout=config.stop_after_s)
        counters = self.fabric.counters() if self.fabric else None
        names = syncer_names(config.shards)
        for name in names:
            if not sup.running(name):  # it may be down for a chaos restart: bring it back
                sup.slots[name].restart_at = 0.0
        sup.poll()
        status = wait_for_settled(self.status_client, timeout=config.start_timeout_s)
        if status is not None and status.waiting:
            print(
                f"diloco run: {status.waiting} contributions still wait for their commit; "
                "the final score is of the versions committed before them",
                file=sys.stderr,
            )
        if status is not None:
            self.evaluator.wait_for_versions(list(status.versions), timeout=5.0)
        val_final, versions = self.evaluator.evaluate()
        scores_final = self.evaluator.scores
        record_metric(self.run_dir, self.started, status, val_final, versions, scores_final)
        self.evaluator.close()
        self.evaluator = None
        syncer_codes = sup.stop(names, timeout=10.0)
        syncer_code = next((c for c in syncer_codes.values() if c != 0), 0)
        facts = {
            "started": self.started,
            "train_end": train_end,
            "val_initial": self.val_initial,
            "val_final": val_final,
            "scores": (self.scores_initial, scores_final),
            "loss_unit": self.prep.recipe.loss_unit,
            "num_params": self.num_params,
            "tokens_per_sample": self.prep.recipe.tokens_per_sample,
            "stopped_by": stopped_by,
            "codes": codes,
        }
        summary = summarize(config, self.run_dir, plans, sup, facts)
        if self.fabric:
            summary["wan"] = wan_section(self.fabric, counters, summary, plans)
        summary["syncer_exit_code"] = syncer_code
        summary["backend"] = config.ray.backend
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.outputs.close(finished_rows(summary), end=train_end)
        text = json.dumps(summary, indent=1) if config.json else format_summary(summary)
        print(text, file=self.out)
        clean = syncer_code == 0 and all(c in (0, None) for c in codes.values())
        return 0 if clean else 1


def abandon(made: list[Path]) -> int:
    """Remove the run directory (and the parents this run created): a run refused before it
    started leaves nothing behind. Returns 2, the exit status of a refusal."""
    if made:
        shutil.rmtree(made[-1], ignore_errors=True)
    return 2


def check_shards(config: RunConfig, clauses) -> None:
    """Refuse (``ValueError``) a shard count that cannot work, and chaos that targets one
    syncer address (``syncer-kill``, ``syncer-hang``, network faults through relays) with
    several shards."""
    from diloco.algorithm.shards import shard_fragments
    from diloco.chaos import NETWORK_KINDS, SYNCER_KINDS

    shard_fragments(
        config.syncer.protocol.num_fragments, 0, config.shards
    )  # ShardError is a ValueError
    unsupported = sorted(
        {c.kind for c in clauses if c.kind in SYNCER_KINDS or c.kind in NETWORK_KINDS}
    )
    if config.shards > 1 and unsupported:
        raise ValueError(
            f"--chaos {','.join(unsupported)} is not supported with --shards > 1 yet "
            "(kill/hang/corrupt are); run it with one syncer"
        )


SYNCER_DISK_BYTES = 16 << 20
"""``disk-full``: the syncer's small disk holds this much plus ``SYNCER_DISK_BYTES_PER_PARAM``
per parameter (its fragment files hold Θ, momentum and the wire image: 12 bytes each, and a
fragment's temporary file while it is written)."""
SYNCER_DISK_BYTES_PER_PARAM = 40


def mount_syncer_disk(run_dir: Path, recipe, seed: int):
    """``disk-full``: a small tmpfs (``diloco.runtime.disk.SmallDisk``, root only) mounted
    under the syncer's fragment files (``syncer/fragments``), which the supervisor fills and
    frees. Only the fragment files live there: the tape, the receipt log and ``meta.json``
    stay on the run's disk (the launcher's own records go on while the syncer's disk is
    full), and a commit, which writes its fragment file first, fails."""
    from diloco.runtime.disk import SmallDisk

    params = sum(p.numel() for p in recipe.build_model(seed).parameters())
    size = SYNCER_DISK_BYTES + SYNCER_DISK_BYTES_PER_PARAM * params
    return SmallDisk(run_dir / syncer_names(1)[0] / "fragments", size)


def make_supervisor(config: RunConfig, **kwargs):
    """The launcher of ``config.ray.backend``: local processes, or Ray actors."""
    if config.ray.backend == "ray":
        from diloco.launch.ray_backend import RaySupervisor

        kwargs.pop("spares", None)  # Ray starts its own workers
        kwargs.pop("disk", None)  # (disk-full is refused with Ray)
        return RaySupervisor(config, **kwargs)
    from diloco.launch.supervisor import Supervisor

    return Supervisor(**kwargs)


def close_run_parts(evaluator, status_client, sup) -> None:
    """At a launcher's end, whatever ended it: close the evaluator and the status client,
    and shut the supervisor down (``shut_down``); each may be ``None`` (never started)."""
    if evaluator is not None:
        evaluator.close()
    if status_client is not None:
        status_client.close()
    if sup is not None:
        shut_down(sup)


def shut_down(sup) -> None:
    """Stop what is still running (bounded), kill the rest, release the launcher."""
    try:
        leftovers = [n for n, s in sup.slots.items() if s.child is not None and s.child.running]
        if leftovers:
            sup.stop(leftovers, timeout=5.0)
    finally:
        sup.kill_everything()
        for relay in sup.relays.values():
            relay.close()
        sup.close()


SETTLED_STILL_S = 2.0
"""With no learner live, a ``waiting`` count that has not moved for this long will not move:
a round that waits for a learner that ended without leaving (synchronous mode) never
closes."""


def wait_for_settled(client: StatusClient, timeout: float):
    """The syncer's status once every contribution it admitted is settled (``waiting`` 0;
    learners that left without waiting for their final merges, ``--drain-timeout 0``, are
    then in the final score), polled until then, until it has failed, stopped answering
    after an answer or (no learner live) ``waiting`` stood still for ``SETTLED_STILL_S``, or
    until ``timeout`` seconds pass: the last status it answered, or None if it never did."""
    deadline = time.monotonic() + timeout
    status, still_since = None, time.monotonic()
    while time.monotonic() < deadline:
        fetched = client.fetch()
        if fetched is None and status is not None:
            break  # it went away: score what the evaluator has
        if fetched is not None:
            if status is None or fetched.waiting != status.waiting:
                still_since = time.monotonic()
            status = fetched
        if status is not None:
            live = any(ls.live for ls in status.learners)
            stuck = not live and time.monotonic() - still_since >= SETTLED_STILL_S
            if status.waiting == 0 or status.failure or stuck:
                break
        time.sleep(0.2)
    return status

"""``diloco run``: the embedded default. A syncer, M learners and an evaluator on this machine.

The supervisor (this process) starts the syncer and the learners as separate processes, joins
the syncer as an evaluator, draws the live view, and stops everything at ``--minutes``,
``--tokens``, when every learner has finished, or on Ctrl+C. Shutdown is ordered and bounded:
learners get SIGTERM (each flushes its progress and exits), then the evaluator scores the final
global model, then the syncer stops. The run directory holds everything:

    runs/<name>/config.json        the command's settings
    runs/<name>/syncer/            durable syncer state and the event tape (events.jsonl)
    runs/<name>/syncer-<i>/        with --shards S: shard i's durable state (one shared tape)
    runs/<name>/learners/<id>/     progress.jsonl, final.json, final.safetensors
    runs/<name>/logs/              one log per process
    runs/<name>/metrics.jsonl      held-out loss of the global model over time
    runs/<name>/summary.json       the summary (also printed; ``--json`` prints it as JSON)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.cadence import AUTO, parse_every
from diloco.launch.flags import corrupt_flags, recipe_flags, sync_lag, syncer_flags
from diloco.launch.ray_backend import add_ray_arguments
from diloco.launch.syncers import StatusClient, syncer_commands, syncer_names
from diloco.syncer.cli import add_syncer_arguments

__all__ = ["StatusClient", "register", "run"]

DEFAULT_LEARNERS = 2
DEFAULT_MINUTES = 3.0


@dataclass
class LearnerPlan:
    """What one learner process is asked to do."""

    id: str
    index: int
    batch_size: int
    slow: float


def parse_assignments(values: list[str], flag: str, learners: int, cast) -> dict[int, float]:
    """``["1=3", "0=2.5"]`` -> ``{1: 3, 0: 2.5}``; raises ValueError with the flag's name."""
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        try:
            index, parsed = int(key), cast(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: expected INDEX=VALUE, e.g. {flag} 1=3") from None
        if not sep or not 0 <= index < learners:
            raise ValueError(f"{flag} {item!r}: learner index must be in [0, {learners})")
        out[index] = parsed
    return out


def plan_learners(args: argparse.Namespace, default_batch: int) -> list[LearnerPlan]:
    batches = parse_assignments(args.batch, "--batch", args.learners, int)
    slows = parse_assignments(args.slow, "--slow", args.learners, float)
    if not 0.0 <= getattr(args, "jitter", 0.0) < 1.0:
        raise ValueError(f"--jitter must be in [0, 1), got {args.jitter}")
    plans = []
    for i in range(args.learners):
        b = batches.get(i, args.batch_size or default_batch)
        f = slows.get(i, 1.0)
        if b < 1:
            raise ValueError(f"learner {i}: batch size must be >= 1, got {b}")
        if f < 1.0:
            raise ValueError(f"learner {i}: --slow factor must be >= 1, got {f}")
        plans.append(LearnerPlan(f"learner-{i}", i, b, f))
    return plans


def run(args: argparse.Namespace) -> int:
    import torch

    from diloco.chaos import NETWORK_KINDS, ChaosSpecError, corruptions, parse_spec, schedule
    from diloco.launch import ray_backend
    from diloco.launch.evaluator import Evaluator
    from diloco.launch.procs import diloco_command, wait_for_file
    from diloco.launch.relay import Relay
    from diloco.launch.summary import format_summary
    from diloco.recipes import DataError, get_recipe
    from diloco.syncer.store import EventTape
    from diloco.wire.auth import AuthConfigError, check_bind, client_link_options, load_token

    torch.set_num_threads(1)
    out = sys.stdout  # the view and the summary (a launcher may divert sys.stdout: Ray's notices)
    try:
        recipe = get_recipe(args.recipe, data_path=args.data)
        recipe.load_data()  # validate the data before starting anything
        plans = plan_learners(args, recipe.batch_size)
        horizon = args.minutes * 60 if args.minutes else 24 * 3600.0
        clauses = parse_spec(args.chaos or "")
        chaos = schedule(clauses, args.learners, horizon, args.seed)
        corrupt = {w.index: w for w in corruptions(clauses, args.learners)}
        token = load_token(args.token_file)
        check_shards(args, clauses)
        if args.mode == "dp":
            from diloco.dp.run import check_chaos

            check_chaos(clauses)
        ray_backend.check_args(args, {c.kind for c in clauses})
    except (DataError, ChaosSpecError, ValueError) as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    name = args.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.runs_dir) / name
    if args.backend == "ray":  # the actors' processes may run elsewhere: no relative paths
        run_dir = run_dir.resolve()
    if run_dir.exists():
        print(f"diloco run: {run_dir} already exists; pick another --name", file=sys.stderr)
        return 2
    (run_dir / "logs").mkdir(parents=True)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    (run_dir / "config.json").write_text(json.dumps(config, indent=1))
    tape = EventTape(run_dir / "syncer" / "events.jsonl")
    if args.mode == "dp":
        from diloco.dp.run import run_dp

        return run_dp(args, recipe=recipe, plans=plans, chaos=chaos, run_dir=run_dir, tape=tape)

    stop = threading.Event()
    interrupts = []

    def on_signal(signum, _frame) -> None:
        interrupts.append(signum)
        stop.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.time()
    sup = None
    evaluator = None
    status_client = None
    try:
        sup = make_supervisor(
            args,
            tape=tape.append,
            clock=lambda: time.time() - started,
            chaos=chaos,
            spares=spare_count(args.spares, chaos, restart_together=1, learners=args.learners),
        )
        host = getattr(sup, "syncer_host", "127.0.0.1")
        check_bind(f"{host}:0", token)
        addresses = []
        flags = [*recipe_flags(args), *syncer_flags(args)]
        for name, argv in syncer_commands(run_dir, args.shards, flags, host=host):
            slot = sup.add(name, diloco_command("syncer", *argv), run_dir / "logs" / f"{name}.log")
            port_file = run_dir / f"{name}.addr"
            addresses.append(wait_for_file(port_file, args.start_timeout, alive=slot.child))
            # A restarted syncer comes back on the same address, so learners just reconnect.
            bind0 = f"--bind={host}:0"
            slot.argv = [f"--bind={addresses[-1]}" if a == bind0 else a for a in slot.argv]
        address = ",".join(addresses)  # one address, or every shard's
        status_client = StatusClient(addresses, token)
        if any(c.kind in NETWORK_KINDS for c in clauses):  # learners reach the syncer via relays
            sup.relays.update({p.id: Relay(address, name=f"relay-{p.id}") for p in plans})
        model0 = recipe.build_model(args.seed)
        num_params = sum(p.numel() for p in model0.parameters())
        val_initial = recipe.evaluate(model0)
        del model0
        evaluator = Evaluator(
            recipe,
            address,
            seed=args.seed,
            fragments=args.fragments,
            link_options=client_link_options(token=token),
        )
        budget_s = args.minutes * 60 if args.minutes else 0.0
        for plan in plans:
            sup.add(
                plan.id,
                diloco_command(
                    "learner",
                    f"--syncer={sup.relays[plan.id].address if plan.id in sup.relays else address}",
                    f"--id={plan.id}",
                    f"--index={plan.index}",
                    f"--batch-size={plan.batch_size}",
                    f"--slow={plan.slow}",
                    f"--jitter={args.jitter}",
                    f"--sync-every={args.sync_every}",
                    f"--total-steps={args.steps}",
                    f"--schedule-seconds={budget_s}",
                    f"--run-started={started}",
                    *deadline_flags(args, started + budget_s),
                    f"--checkpoint-every={args.checkpoint_every}",
                    f"--workdir={run_dir / 'learners' / plan.id}",
                    f"--join-timeout={args.start_timeout}",
                    f"--wait-for-merge={sync_lag(args)}",
                    *(["--overwrite-own"] if args.overwrite_own else []),
                    "--exit-with-parent",
                    *recipe_flags(args),
                    *([f"--token-file={args.token_file}"] if args.token_file else []),
                    *corrupt_flags(corrupt.get(plan.index), started, tape),
                ),
                run_dir / "logs" / f"{plan.id}.log",
            )
        stopped_by = supervise(
            args, stop, started, sup, plans, evaluator, status_client, run_dir, out=out
        )
        if interrupts:
            stopped_by = "interrupt"
        train_end = time.time()
        codes = sup.stop([p.id for p in plans], timeout=args.stop_timeout)
        names = syncer_names(args.shards)
        for name in names:
            if not sup.running(name):  # it may be down for a chaos restart: bring it back
                sup.slots[name].restart_at = 0.0
        sup.poll()
        status = wait_for_status(status_client, timeout=args.start_timeout)
        if status is not None:
            evaluator.wait_for_versions(list(status.versions), timeout=5.0)
        val_final, versions = evaluator.evaluate()
        _append_metric(run_dir, started, status, val_final, versions)
        evaluator.close()
        evaluator = None
        syncer_codes = sup.stop(names, timeout=10.0)
        syncer_code = next((c for c in syncer_codes.values() if c != 0), 0)
        facts = {
            "started": started,
            "train_end": train_end,
            "val_initial": val_initial,
            "val_final": val_final,
            "num_params": num_params,
            "seq_len": recipe.model.seq_len,
            "stopped_by": stopped_by,
            "codes": codes,
        }
        from diloco.launch.results import summarize

        summary = summarize(args, run_dir, plans, sup, facts)
        summary["syncer_exit_code"] = syncer_code
        summary["backend"] = args.backend
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if args.json:
            print(json.dumps(summary, indent=1), file=out)
        else:
            print(format_summary(summary), file=out)
        clean = syncer_code == 0 and all(c in (0, None) for c in codes.values())
        return 0 if clean else 1
    except (RuntimeError, TimeoutError, ConnectionError, AuthConfigError) as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 1
    finally:
        if evaluator is not None:
            evaluator.close()
        if status_client is not None:
            status_client.close()
        if sup is not None:
            shut_down(sup)
        tape.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)


def check_shards(args: argparse.Namespace, clauses) -> None:
    """Refuse (``ValueError``) a shard count that cannot work, and chaos that targets one
    syncer address (``syncer-kill``, ``syncer-hang``, network faults through relays) with several shards."""
    from diloco.algorithm.shards import shard_fragments
    from diloco.chaos import NETWORK_KINDS, SYNCER_KINDS

    shard_fragments(args.fragments, 0, args.shards)  # raises ShardError (a ValueError)
    unsupported = sorted(
        {c.kind for c in clauses if c.kind in SYNCER_KINDS or c.kind in NETWORK_KINDS}
    )
    if args.shards > 1 and unsupported:
        raise ValueError(
            f"--chaos {','.join(unsupported)} is not supported with --shards > 1 yet "
            "(kill/hang/corrupt are); run it with one syncer"
        )


def spare_count(asked: int, chaos, *, restart_together: int, learners: int) -> int:
    """Warm spares to keep: ``asked`` if given (>= 0). By default (-1), none unless the chaos
    schedule kills learners (a spare costs an idle interpreter's memory); then the whole group
    for data-parallel (``restart_together`` ranks restart at once), and for DiLoCo modes two
    (at most ``learners``): one for a restart and one for a second learner killed while the
    first's replacement spare is still warming up (~9 s), which left 2, 6 and 3 of 8, 16 and
    11 restarts cold with a single spare (benchmarks/RESULTS.md)."""
    if asked >= 0:
        return asked
    if not any(e.kind == "kill" for e in chaos):
        return 0
    return restart_together if restart_together > 1 else min(2, learners)


def make_supervisor(args: argparse.Namespace, **kwargs):
    """The launcher of ``args.backend``: local processes, or Ray actors (``ray_backend``)."""
    if args.backend == "ray":
        from diloco.launch.ray_backend import RaySupervisor

        kwargs.pop("spares", None)  # Ray starts its own workers
        return RaySupervisor(args, **kwargs)
    from diloco.launch.supervisor import Supervisor

    return Supervisor(**kwargs)


def deadline_flags(args: argparse.Namespace, end: float) -> list[str]:
    """``--deadline`` for learners the supervisor may not be able to signal (Ray backend)."""
    if args.backend == "ray" and args.minutes:
        return [f"--deadline={end}"]
    return []


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


def wait_for_status(client: StatusClient, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.fetch()
        if status is not None:
            return status
        time.sleep(0.2)
    return None


def _append_metric(run_dir: Path, started: float, status, loss: float, versions: list[int]):
    rec = {
        "t": round(time.time() - started, 3),
        "val_loss": loss,
        "versions": sum(max(v, 0) for v in versions),
        "tokens": sum(ls.tokens for ls in status.learners) if status is not None else None,
        "rounds": status.rounds if status is not None else None,
    }
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


MAX_UNPLANNED_RESTARTS = 5


def supervise(args, stop, started, sup, plans, evaluator, status_client, run_dir, out=None) -> str:
    """The supervisor loop: failures and restarts, view, evaluation, stop conditions.

    Returns why it stopped. Raises RuntimeError if a process keeps crashing on its own.
    """
    from diloco.launch.view import LiveView

    view = LiveView(enabled=not args.json and not args.no_view, stream=out)
    last_eval = 0.0
    last_loss = None
    last_status = None
    prev_tokens: dict[str, tuple[float, int]] = {}
    rate: dict[str, float] = {}
    while True:
        if stop.wait(0.25):
            return "interrupt"
        sup.poll()
        for slot in sup.slots.values():
            crashes = sum(1 for c in slot.exit_codes if c != 0) - _planned(slot)
            if crashes > MAX_UNPLANNED_RESTARTS:
                tail = slot.child.tail() if slot.child else ""
                raise RuntimeError(f"{slot.name} keeps crashing ({crashes} times):\n{tail}")
        now = time.time()
        elapsed = now - started
        up = all(sup.running(name) for name in syncer_names(args.shards))
        status = status_client.fetch() if up else None
        last_status = status or last_status
        tokens = sum(ls.tokens for ls in last_status.learners) if last_status else 0
        if args.eval_every and now - last_eval >= args.eval_every:
            last_eval = now
            last_loss, versions = evaluator.evaluate()
            _append_metric(run_dir, started, status, last_loss, versions)
        by_id = {ls.learner_id: ls for ls in last_status.learners} if last_status else {}
        everyone_trains = all(by_id.get(p.id) and by_id[p.id].step > 0 for p in plans)
        if everyone_trains or elapsed > args.start_timeout:
            sup.start_chaos()
        rows = []
        for plan in plans:
            slot, st = sup.slots[plan.id], by_id.get(plan.id)
            step, tok = (int(st.step), int(st.tokens)) if st else (0, 0)
            t0, tok0 = prev_tokens.setdefault(plan.id, (now, tok))
            if now - t0 >= 2.0:
                rate[plan.id] = max(0.0, (tok - tok0) / (now - t0))
                prev_tokens[plan.id] = (now, tok)
            if slot.finished:
                state = "finished"
            elif slot.resume_at is not None:
                state = "hung (chaos)"
            elif slot.restart_at is not None:
                state = f"down, restart in {max(0.0, slot.restart_at - elapsed):.0f}s"
            elif st is None:
                state = "starting"
            else:
                state = st.state if st.live else "not live"
            rows.append(
                {
                    "id": plan.id,
                    "step": step,
                    "tokens": tok,
                    "tokens_per_s": rate.get(plan.id, 0.0),
                    "state": state,
                }
            )
        view.update(
            {
                "elapsed": elapsed,
                "val_loss": last_loss,
                "rounds": last_status.rounds if last_status else 0,
                "bytes_up": sum(ls.bytes_up for ls in last_status.learners) if last_status else 0,
                "bytes_down": sum(ls.bytes_down for ls in last_status.learners)
                if last_status
                else 0,
                "learners": rows,
            }
        )
        if args.minutes and elapsed >= args.minutes * 60:
            return "time"
        if args.tokens and tokens >= args.tokens:
            return "tokens"
        if all(s.finished for s in sup.learners()):
            return "learners finished"


def _planned(slot) -> int:
    """Exits that the chaos schedule caused (restarts minus unplanned crashes are planned)."""
    return slot.planned_deaths


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a syncer, M learners and an evaluator on this machine (the embedded default)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--learners", "-m", type=int, default=DEFAULT_LEARNERS, help="M (default 2)")
    p.add_argument(
        "--minutes", type=float, default=DEFAULT_MINUTES, help="wall-clock budget (0: none)"
    )
    p.add_argument("--tokens", type=int, default=0, help="stop after this many tokens in total")
    p.add_argument("--steps", type=int, default=0, help="each learner stops after N steps")
    p.add_argument(
        "--mode",
        choices=["decoupled", "sync", "dp"],
        default="decoupled",
        help="decoupled: asynchronous rounds (quorum + grace); sync: every round waits for all "
        "M; dp: data-parallel baseline (all-reduce every step, group restarts on failure)",
    )
    p.add_argument("--recipe", default="shakespeare", help="shakespeare (default) or tiny")
    p.add_argument("--data", help="train on this UTF-8 text file instead of Shakespeare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=0, help="batch size of every learner")
    p.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="I=N",
        help="batch size of learner I (repeatable)",
    )
    p.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="I=F",
        help="learner I takes F times as long per step (repeatable), e.g. --slow 1=3",
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        metavar="J",
        help="every learner's step time varies by up to +-J of its (slowed) cost, seeded per "
        "learner (default 0; e.g. 0.2 with --slow for a mixed fleet)",
    )
    p.add_argument("--fragments", type=int, default=24, help="P (default 24)")
    p.add_argument("--sync-every", type=int, default=24, help="H in steps (default 24)")
    p.add_argument(
        "--overwrite-own",
        action="store_true",
        help="learners apply a merge holding their own delta by the paper's overwrite, "
        "dropping the steps trained while it was in flight (default: keep them)",
    )
    p.add_argument(
        "--eval-every",
        type=float,
        default=5.0,
        help="seconds between evaluations (default 5; 0: only at the start and the end)",
    )
    p.add_argument(
        "--chaos",
        default="",
        metavar="SPEC",
        help="inject failures, e.g. 'kill:mtbf=60s,down=5-15s;syncer-kill:at=120s' (docs/cli.md)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=-1,
        metavar="N",
        help="warm spare processes (torch imported) that restarted learners run in, for "
        "fast restarts; local backend (default: when --chaos kills learners 2, or the whole "
        "group with --mode dp; else 0)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=parse_every,
        default=AUTO,
        help="seconds between the learners' (or the data-parallel group's) checkpoints, or "
        "'auto' (default: as often as keeps saving under 1%% of the time; diloco.cadence)",
    )
    p.add_argument("--name", help="run name (default: the start time)")
    p.add_argument("--runs-dir", default="runs", help="where run directories go (default runs/)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-view", action="store_true", help="no live view")
    p.add_argument("--start-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--stop-timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="S",
        help="start S syncer processes, each owning the fragments p mod S == i (default 1)",
    )
    add_syncer_arguments(p)
    add_ray_arguments(p)
    p.add_argument(
        "--token-file",
        help="shared token file passed to the syncer, learners and evaluator (loopback needs none)",
    )
    p.set_defaults(func=run)

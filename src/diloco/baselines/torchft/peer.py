"""torchft's DiLoCo as an external peer: the same recipe, model and data as ``diloco run``.

:func:`run_torchft` starts a torchft lighthouse and M replica groups as separate processes
(:mod:`diloco.baselines.torchft.replica`: one process per group, gloo on CPU, each group hosting its
own ``TCPStore``), lets them train with ``torchft.local_sgd.DiLoCo`` until a wall-time, token or
round budget is spent, evaluates the final global model on the recipe's held-out windows and
returns a summary with the core fields of ``diloco run``'s ``summary.json``.

What is measured, and how (nothing is quoted):

* ``tokens``: tokens the replicas trained (inner steps × batch × tokens per sample), as in our summary;
  ``tokens_per_s`` = tokens / ``wall_s`` (wall time from the start of the call, process start-up
  included, like ``diloco run``); ``train_tokens_per_s`` = tokens / ``train_s`` (first replica
  training to last replica stopped).
* ``val_loss``: the recipe's held-out loss of the initial model and of the final global model
  (the last committed value of every fragment, written by replica 0; ``replicas_max_diff``
  checks that every replica holds the same one).
* ``bytes``: TCP payload bytes counted by the kernel on every socket of every replica process
  (:mod:`diloco.baselines.torchft.netbytes`): gloo all-reduces, quorum and heartbeat RPCs, stores.
  ``up`` = sent, ``down`` = received by the replicas. Between replicas every byte is sent by one
  and received by another, so the bytes that cross the network are ``up``; ``per_token`` is
  ``up / tokens`` (our learners' ``up + down`` counts each byte once too, because the syncer
  is not a learner).
* ``goodput`` = useful / provisioned tokens: a replica's tokens are useful when the sync that
  carries them commits (per fragment, averaged over fragments, as in
  :mod:`diloco.report.goodput`); provisioned = the replica's compute-only speed (tokens per
  second spent in forward, backward and AdamW, ``--slow`` included, sync waits excluded) ×
  its training time. Time a fast replica spends waiting for a slow one is therefore not good.

Every process started here is stopped (SIGTERM, bounded wait, SIGKILL) whatever happens; every
wait is bounded; the replicas also exit on their own at a hard deadline or if this process dies.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from diloco.config.torchft import PeerSettings, parse_slow_item

TORCHFT_PACKAGE = "torchft-nightly"
TORCHFT_PIN = "2026.10.26"
"""The torchft nightly this peer was built and measured against (``make setup-peers``)."""


class PeerUnavailable(RuntimeError):
    """torchft is not installed (or cannot be imported) in this environment."""


def torchft_version() -> str | None:
    """The installed torchft version, or None when torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        return None
    for dist in (TORCHFT_PACKAGE, "torchft"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def run_torchft(**settings) -> dict:
    """Train ``recipe`` with torchft's DiLoCo on ``learners`` replica groups; return a summary.

    Keyword arguments (:class:`PeerSettings`):

    Budget: stop when ``minutes`` of wall time (0: none) or ``tokens`` in total (0: none) are
    spent, or after ``rounds`` committed syncs (0: none); at least one is required, and
    ``max_minutes`` bounds the run in any case. All replicas stop after the same commit.

    Algorithm: sync every ``sync_every`` inner steps (H); with ``fragments`` = P > 1, torchft's
    streaming DiLoCo syncs one fragment (whole tensors, balanced by size) every H/P steps, and
    ``sync_delay`` (τ) lets the all-reduce overlap that many inner steps. Outer optimizer: SGD
    with ``outer_lr`` and ``outer_momentum`` (Nesterov when > 0), by default our syncer's
    (``SyncerConfig``'s 0.6 and 0.7).
    ``slow`` maps a learner index to a slowdown factor (``{1: 3.0}``: learner 1 takes 3× as
    long per inner step). ``batch_size`` 0 means the recipe's.

    Lighthouse: ``min_replicas`` (0: all ``learners``, so every quorum waits for everyone, i.e.
    synchronous DiLoCo as torchft runs it without failures), ``join_timeout_ms``,
    ``quorum_tick_ms``, ``heartbeat_timeout_ms`` as torchft's lighthouse flags.

    ``wan``: ``diloco run --wan`` specs; each replica group then runs in its own network
    namespace on a shaped link to the lighthouse's (``diloco.wan``; root only), and the summary
    gets the bytes at every replica's interface.

    ``run_dir`` keeps logs, progress and final models (default: a temporary directory that is
    removed). Raises :class:`PeerUnavailable` without torchft, ``ValueError`` on bad arguments,
    ``RuntimeError`` if a process fails, ``TimeoutError`` if start-up exceeds ``start_timeout_s``.
    """
    version = torchft_version()
    if version is None:
        raise PeerUnavailable(
            f"torchft is not installed: make setup-peers (pip install -e '.[torchft]', "
            f"i.e. {TORCHFT_PACKAGE}=={TORCHFT_PIN}; it keeps the installed torch)"
        )
    s = PeerSettings(**{**settings, "slow": dict(settings.get("slow") or {})})
    from diloco.recipes import get_recipe

    rec = get_recipe(s.recipe, data_path=s.data)
    rec.load_data()
    model0 = rec.build_model(s.seed)
    val_initial = rec.evaluate(model0)
    temporary = s.run_dir is None
    root = Path(tempfile.mkdtemp(prefix="torchft-peer-")) if temporary else Path(s.run_dir)
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"run_dir {root} is not empty; pick a new one")
    root.mkdir(parents=True, exist_ok=True)
    fabric = _open_fabric(s)
    started = time.time()
    try:
        outcome = _train(s, root, started, batch=s.batch_size or rec.batch_size, fabric=fabric)
        val_final, max_diff = _evaluate_final(rec, root, s.learners, model0)
        wall_s = time.time() - started
    finally:
        if fabric is not None:
            fabric.close()
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    summary = _summarize(
        s,
        outcome,
        batch=s.batch_size or rec.batch_size,
        tokens_per_sample=rec.tokens_per_sample,
        num_params=sum(p.numel() for p in model0.parameters()),
        val_loss=(val_initial, val_final),
        max_diff=max_diff,
        started=started,
        wall_s=wall_s,
        run_dir="" if temporary else str(root),
    )
    summary["peer"] = _peer_info(version, s)
    if fabric is not None:
        from diloco.launch.wan import wan_section

        plans = [_Site(i, f"learner-{i}") for i in range(s.learners)]
        summary["wan"] = wan_section(fabric, outcome.counters, summary, plans)
    return summary


class _Site(NamedTuple):
    index: int
    id: str


def _open_fabric(s: PeerSettings):
    """With ``wan``: the links (``diloco.wan``), this process in the hub namespace (where the
    lighthouse then starts), replica i to run in learner i's namespace. Else None."""
    if not s.wan:
        return None
    from diloco.wan.fabric import Fabric

    return Fabric.in_hub(list(s.wan), s.learners)


@dataclass
class _Outcome:
    """What the processes left: progress lines and exit codes by replica, and why they stopped."""

    records: dict[int, list[dict]]
    codes: dict[int, int | None]
    stopped_by: str
    counters: list | None = None
    """Bytes at each replica's interface (``--wan``), read before the links go."""


def _train(s: PeerSettings, root: Path, started: float, *, batch: int, fabric=None) -> _Outcome:
    """Start the lighthouse and the replicas, watch the budget, wait for them; every process
    is stopped on the way out whatever happens."""
    from diloco.launch.children import write_config
    from diloco.runtime.procs import stop_all

    hard_deadline_epoch_s = started + s.budget_s + s.start_timeout_s + s.stop_timeout_s + 30.0
    children = [_start_lighthouse(root, s)]
    try:
        for i in range(s.learners):
            config = _replica_config(s, root, i, batch, started, hard_deadline_epoch_s)
            prefix: list[str] = []
            if fabric is not None:  # on its own link; gloo and the store use it
                from diloco.wan.fabric import LEARNER_IFACE

                config = dataclasses.replace(
                    config,
                    host=fabric.learner_address(i),
                    lighthouse_host=fabric.hub_address(i),
                )
                prefix = [*fabric.exec_prefix(i), "env", f"GLOO_SOCKET_IFNAME={LEARNER_IFACE}"]
            path = write_config(root / "config" / f"replica-{i}.json", config)
            children.append(_start_replica(root, i, path, s.threads, prefix))
        replicas = children[1:]
        stopped_by = _supervise(root, children[0], replicas, started, s)
        # Replicas stop at their next sync: allow for one more sync period on top.
        codes = _wait_replicas(replicas, s.stop_timeout_s + 2 * _longest_gap(root, s.learners))
        records = {
            i: _read_progress(root / f"replica-{i}" / "progress.jsonl") for i in range(s.learners)
        }
        counters = fabric.counters() if fabric is not None else None
        return _Outcome(records, codes, stopped_by, counters)
    finally:
        stop_all(children, timeout=10.0)


def _replica_config(
    s: PeerSettings,
    root: Path,
    index: int,
    batch: int,
    started: float,
    hard_deadline_epoch_s: float,
):
    from diloco.config.common import RecipeConfig
    from diloco.config.torchft import ReplicaConfig

    return ReplicaConfig(
        recipe=RecipeConfig(recipe=s.recipe, data=s.data, seed=s.seed),
        index=index,
        replicas=s.learners,
        lighthouse_file=str(root / "lighthouse.addr"),
        workdir=str(root / f"replica-{index}"),
        batch_size=batch,
        slow=s.slow.get(index, 1.0),
        sync_every=s.sync_every,
        fragments=s.fragments,
        sync_delay=s.sync_delay,
        outer_lr=s.outer_lr,
        outer_momentum=s.outer_momentum,
        rounds=s.rounds,
        schedule_seconds=s.minutes * 60,
        schedule_steps=s.rounds * (s.sync_every // s.fragments),
        run_started_epoch_s=started,
        min_replica_size=s.quorum,
        hard_deadline_epoch_s=hard_deadline_epoch_s,
        threads=s.threads,
    )


def _peer_info(version: str, s: PeerSettings) -> dict:
    """What the summary says about the peer: package, algorithm and its settings."""
    return {
        "name": "torchft",
        "package": TORCHFT_PACKAGE,
        "version": version,
        "algorithm": "torchft.local_sgd.DiLoCo",
        "backend": "gloo (torchft.ProcessGroupGloo), one replica group process per learner",
        "recipe": s.recipe,
        "sync_every": s.sync_every,
        "fragments": s.fragments,
        "sync_delay": s.sync_delay,
        "outer_optimizer": {
            "lr": s.outer_lr,
            "momentum": s.outer_momentum,
            "nesterov": s.outer_momentum > 0,
        },
        "lighthouse": {
            "min_replicas": s.quorum,
            "join_timeout_ms": s.join_timeout_ms,
            "quorum_tick_ms": s.quorum_tick_ms,
            "heartbeat_timeout_ms": s.heartbeat_timeout_ms,
        },
    }


def _replica_command(role: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "diloco.cli.torchft_replica", role, *flags]


def _start_lighthouse(root: Path, s: PeerSettings):
    from diloco.runtime.procs import Child

    return Child(
        "lighthouse",
        _replica_command(
            "lighthouse",
            f"--port-file={root / 'lighthouse.addr'}",
            f"--min-replicas={s.quorum}",
            f"--join-timeout-ms={s.join_timeout_ms}",
            f"--quorum-tick-ms={s.quorum_tick_ms}",
            f"--heartbeat-timeout-ms={s.heartbeat_timeout_ms}",
        ),
        root / "logs" / "lighthouse.log",
    )


def _start_replica(root: Path, index: int, config: Path, threads: int, prefix: list[str]):
    from diloco.runtime.procs import Child

    return Child(
        f"replica-{index}",
        [*prefix, *_replica_command("replica", f"--config={config}")],
        root / "logs" / f"replica-{index}.log",
        threads=threads,
    )


def _supervise(root: Path, lighthouse, replicas, started: float, s: PeerSettings) -> str:
    """Watch the processes and the budget; when it is spent, write the stop step. Returns why
    the run stops. Raises RuntimeError if a process fails, TimeoutError if a replica has not
    completed its first sync within ``start_timeout_s``."""
    from diloco.baselines.torchft.replica import STOP_FILE

    while True:
        time.sleep(0.2)
        if lighthouse.poll() is not None:
            raise RuntimeError(f"the lighthouse exited ({lighthouse.poll()}):\n{lighthouse.tail()}")
        codes = [r.poll() for r in replicas]
        for r, code in zip(replicas, codes, strict=True):
            if code not in (None, 0):
                raise RuntimeError(f"{r.name} exited with code {code}:\n{r.tail()}")
        if all(code == 0 for code in codes):
            return "rounds"
        lasts = [_last_record(root / r.name / "progress.jsonl") for r in replicas]
        elapsed = time.time() - started
        if any(rec is None for rec in lasts) and elapsed > s.start_timeout_s:
            raise TimeoutError(
                f"a replica did not complete its first sync in {s.start_timeout_s:.0f}s"
            )
        reason = _budget_spent(s, elapsed, sum(rec["tokens"] for rec in lasts if rec))
        if reason:
            (root / STOP_FILE).write_text(reason)
            return reason


def _budget_spent(s: PeerSettings, elapsed: float, tokens: int) -> str | None:
    """Which budget is spent after ``elapsed`` s and ``tokens`` trained (None: none). Pure."""
    if s.minutes and elapsed >= s.minutes * 60:
        return "time"
    if s.tokens and tokens >= s.tokens:
        return "tokens"
    if elapsed >= s.budget_s:
        return "max_minutes"
    return None


def _longest_gap(root: Path, learners: int) -> float:
    """The longest time between two progress lines (syncs) of any replica so far."""
    gaps = [0.0]
    for i in range(learners):
        times = [r["t"] for r in _read_progress(root / f"replica-{i}" / "progress.jsonl")]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps)


def _wait_replicas(replicas, timeout: float) -> dict[int, int | None]:
    """Exit codes by replica index after at most ``timeout`` s (None: still running)."""
    deadline = time.monotonic() + timeout
    codes = {}
    for i, r in enumerate(replicas):
        while r.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        codes[i] = r.poll()
    return codes


def _read_progress(path: Path) -> list[dict]:
    from diloco.runtime.jsonl import read_jsonl

    return read_jsonl(path)


def _last_record(path: Path) -> dict | None:
    recs = _read_progress(path)
    return recs[-1] if recs else None


def _evaluate_final(rec, root: Path, learners: int, model) -> tuple[float | None, float | None]:
    """Held-out loss of replica 0's final global model (the first replica that wrote one) and
    the largest difference between the replicas' final models."""
    from safetensors.torch import load_file

    finals = []
    for i in range(learners):
        path = root / f"replica-{i}" / "final.safetensors"
        if path.exists():
            finals.append(load_file(str(path)))
    if not finals:
        return None, None
    model.load_state_dict(finals[0])
    diff = max(
        (float((f[k] - finals[0][k]).abs().max()) for f in finals[1:] for k in finals[0]),
        default=0.0,
    )
    return rec.evaluate(model), diff


def _summarize(
    s: PeerSettings,
    outcome: _Outcome,
    *,
    batch: int,
    tokens_per_sample: int,
    num_params: int,
    val_loss: tuple[float, float | None],
    max_diff: float | None,
    started: float,
    wall_s: float,
    run_dir: str,
) -> dict:
    """``diloco run``'s summary fields, from the replicas' progress lines."""
    from diloco.report.summary import build_summary

    tallies = [
        _tally(i, outcome.records.get(i, []), outcome.codes.get(i), started, batch, s)
        for i in range(s.learners)
    ]
    rounds = max(
        (int(r.get("outer_step", 0)) for recs in outcome.records.values() for r in recs),
        default=0,
    )
    summary = build_summary(
        mode="torchft",
        run_dir=run_dir,
        wall_s=wall_s,
        val_initial=val_loss[0],
        val_final=val_loss[1],
        rounds=rounds,
        learners=[t.row for t in tallies],
        num_params=num_params,
        tokens_per_sample=tokens_per_sample,
        stopped_by=outcome.stopped_by,
    )
    summary["bytes"].update(
        _bytes_fields(summary, num_params, s.learners * batch * tokens_per_sample)
    )
    summary.update(_speed_fields(summary["tokens"], tallies, outcome.records.get(0, []), wall_s))
    summary.update(replicas_max_diff=max_diff, fragments=s.fragments)
    return summary


class _Tally(NamedTuple):
    """One replica's summary line and what goodput and speed need from it."""

    row: dict
    useful: float
    provisioned: float
    span: tuple[float, float] | None  # (first training, last progress) epoch s


def _tally(i: int, recs: list[dict], code, started: float, batch: int, s: PeerSettings) -> _Tally:
    """Replica ``i``'s tally from its progress lines. Provisioned tokens = its compute-only
    speed × its training time (see the module docstring)."""
    last = recs[-1] if recs else {}
    train_s = last.get("train_s") or (last["t"] - started if last else 0.0)
    compute_s = last.get("compute_s", 0.0)
    toks = int(last.get("tokens", 0))
    useful = float(last.get("useful_tokens", 0.0))
    row = {
        "id": f"learner-{i}",
        "steps": int(last.get("step", 0)),
        "tokens": toks,
        "steps_per_s": last.get("step", 0) / train_s if train_s else 0.0,
        "batch_size": batch,
        "slow": s.slow.get(i, 1.0),
        "exit_code": code,
        "restarts": 0,
        "contributions": sum(1 for r in recs if r.get("committed")),
        "bytes_up": int(last.get("bytes_sent", 0)),
        "bytes_down": int(last.get("bytes_received", 0)),
        "useful_tokens": round(useful),
        "compute_s": round(compute_s, 3),
        "sync_s": round(last.get("sync_s", 0.0), 3),
        "train_s": round(train_s, 3),
        "commit_failures": int(last.get("commit_failures", 0)),
    }
    provisioned = toks / compute_s * train_s if compute_s else 0.0
    span = (last["t"] - train_s, last["t"]) if last else None
    return _Tally(row, useful, provisioned, span)


def _bytes_fields(summary: dict, num_params: int, tokens_per_step: int) -> dict:
    from diloco.report.summary import data_parallel_bytes_per_token

    tokens = summary["tokens"]
    per_token = summary["bytes"]["up"] / tokens if tokens else None
    dp = data_parallel_bytes_per_token(num_params, summary["learners"], tokens_per_step)
    return {
        "per_token": per_token,
        "reduction_vs_data_parallel": (dp / per_token) if per_token and dp else None,
        "counted": "TCP payload bytes from the kernel (TCP_INFO) on every socket of every "
        "replica process; per_token = bytes sent / tokens",
    }


def _speed_fields(tokens: int, tallies: list[_Tally], first: list[dict], wall_s: float) -> dict:
    """Speed, goodput and uptime: ``first`` is replica 0's progress (its commits)."""
    from diloco.report.goodput import commit_gaps, uptime

    spans = [t.span for t in tallies if t.span]
    begin = min((a for a, _ in spans), default=0.0)
    end = max((b for _, b in spans), default=0.0)
    train_s = end - begin if spans else 0.0
    commits = [r["t"] for r in first if r.get("committed")]
    gaps = commit_gaps(commits)
    total = sum(t.provisioned for t in tallies)
    return {
        "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "train_s": round(train_s, 2),
        "train_tokens_per_s": tokens / train_s if train_s else 0.0,
        "goodput": sum(t.useful for t in tallies) / total if total else None,
        "useful_tokens": {t.row["id"]: round(t.useful) for t in tallies},
        "provisioned_tokens": {t.row["id"]: round(t.provisioned) for t in tallies},
        "uptime": uptime(commits, begin, end) if spans else 0.0,
        "max_commit_gap_s": max(gaps) if gaps else None,
    }


def format_torchft(summary: dict) -> str:
    """Human lines: ``diloco run``'s summary lines plus speed and goodput."""
    from diloco.report.summary import format_summary

    peer = summary["peer"]
    if summary["val_loss"]["final"] is None:  # no replica wrote a final model
        summary = {**summary, "val_loss": {**summary["val_loss"], "final": float("nan")}}
    head = (
        f"torchft {peer['version']} DiLoCo (H={peer['sync_every']}, P={peer['fragments']}, "
        f"outer lr {peer['outer_optimizer']['lr']} μ {peer['outer_optimizer']['momentum']})"
    )
    good = summary["goodput"]
    tail = (
        f"  {summary['tokens_per_s']:.0f} tokens/s over the wall time "
        f"({summary['train_tokens_per_s']:.0f} while training), goodput "
        + (f"{good:.2f}" if good is not None else "n/a")
    )
    return "\n".join([head, format_summary(summary), tail])


def parse_slow(values: list[str]) -> dict[int, float]:
    """``["1=3", ...]`` -> ``{1: 3.0}`` (``ValueError`` for an item that is not ``I=F``)."""
    return dict(parse_slow_item(v) for v in values)

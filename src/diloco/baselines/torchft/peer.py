"""torchft's DiLoCo as an external peer: the same recipe, model and data as ``diloco run``.

:func:`run_torchft` starts a torchft lighthouse and M replica groups as separate processes
(:mod:`diloco.baselines.torchft.replica`: one process per group, gloo on CPU, each group hosting its
own ``TCPStore``), lets them train with ``torchft.local_sgd.DiLoCo`` until a wall-time, token or
round budget is spent, evaluates the final global model on the recipe's held-out windows and
returns a summary with the core fields of ``diloco run``'s ``summary.json``.

What is measured, and how (nothing is quoted):

* ``tokens``: tokens the replicas trained (inner steps × batch × seq_len), as in our summary;
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

import importlib.metadata
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

from diloco.config.common import ProtocolConfig

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


def run_torchft(
    *,
    learners: int = 2,
    recipe: str = "tiny",
    data: str | None = None,
    seed: int = 0,
    minutes: float = 1.0,
    tokens: int = 0,
    rounds: int = 0,
    sync_every: int = ProtocolConfig.sync_every,
    fragments: int = 1,
    sync_delay: int = 0,
    outer_lr: float = 1.0,
    outer_momentum: float = 0.0,
    slow: dict[int, float] | None = None,
    batch_size: int = 0,
    run_dir: str | Path | None = None,
    threads: int = 1,
    min_replicas: int = 0,
    join_timeout_ms: int = 60000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
    start_timeout: float = 120.0,
    stop_timeout: float = 30.0,
    max_minutes: float = 60.0,
) -> dict:
    """Train ``recipe`` with torchft's DiLoCo on ``learners`` replica groups; return a summary.

    Budget: stop when ``minutes`` of wall time (0: none) or ``tokens`` in total (0: none) are
    spent, or after ``rounds`` committed syncs (0: none); at least one is required, and
    ``max_minutes`` bounds the run in any case. All replicas stop after the same commit.

    Algorithm: sync every ``sync_every`` inner steps (H); with ``fragments`` = P > 1, torchft's
    streaming DiLoCo syncs one fragment (whole tensors, balanced by size) every H/P steps, and
    ``sync_delay`` (τ) lets the all-reduce overlap that many inner steps. Outer optimizer: SGD
    with ``outer_lr`` and ``outer_momentum`` (Nesterov when > 0), defaults like our syncer's.
    ``slow`` maps a learner index to a slowdown factor (``{1: 3.0}``: learner 1 takes 3× as
    long per inner step). ``batch_size`` 0 means the recipe's.

    Lighthouse: ``min_replicas`` (0: all ``learners``, so every quorum waits for everyone, i.e.
    synchronous DiLoCo as torchft runs it without failures), ``join_timeout_ms``,
    ``quorum_tick_ms``, ``heartbeat_timeout_ms`` as torchft's lighthouse flags.

    ``run_dir`` keeps logs, progress and final models (default: a temporary directory that is
    removed). Raises :class:`PeerUnavailable` without torchft, ``ValueError`` on bad arguments,
    ``RuntimeError`` if a process fails, ``TimeoutError`` if start-up exceeds ``start_timeout``.
    """
    version = torchft_version()
    if version is None:
        raise PeerUnavailable(
            f"torchft is not installed: make setup-peers (pip install -e '.[torchft]', "
            f"i.e. {TORCHFT_PACKAGE}=={TORCHFT_PIN}; it keeps the installed torch)"
        )
    slow = dict(slow or {})
    _check_arguments(learners, minutes, tokens, rounds, sync_every, fragments, slow)
    from diloco.recipes import get_recipe

    rec = get_recipe(recipe, data_path=data)
    rec.load_data()
    batch = batch_size or rec.batch_size
    model0 = rec.build_model(seed)
    num_params = sum(p.numel() for p in model0.parameters())
    val_initial = rec.evaluate(model0)

    temporary = run_dir is None
    root = Path(tempfile.mkdtemp(prefix="torchft-peer-")) if temporary else Path(run_dir)
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"run_dir {root} is not empty; pick a new one")
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    budget_s = minutes * 60 if minutes else max_minutes * 60
    hard_deadline = started + budget_s + start_timeout + stop_timeout + 30.0
    children: list = []
    try:
        lighthouse = _start_lighthouse(
            root,
            min_replicas or learners,
            join_timeout_ms,
            quorum_tick_ms,
            heartbeat_timeout_ms,
            children,
        )
        replica = dict(
            recipe=recipe,
            data=data,
            seed=seed,
            batch=batch,
            sync_every=sync_every,
            fragments=fragments,
            sync_delay=sync_delay,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            rounds=rounds,
            schedule_s=minutes * 60,
            schedule_steps=rounds * (sync_every // fragments),
            started=started,
            min_replica_size=min_replicas or learners,
            replicas=learners,
            hard_deadline=hard_deadline,
            threads=threads,
        )
        children += [
            _start_replica(root, i, slow=slow.get(i, 1.0), **replica) for i in range(learners)
        ]
        replicas = children[1:]
        stopped_by = _supervise(
            root, lighthouse, replicas, started, budget_s, minutes, tokens, start_timeout
        )
        # Replicas stop at their next sync: allow for one more sync period on top.
        codes = _wait_replicas(replicas, stop_timeout + 2 * _longest_gap(root, learners))
        records = {
            i: _read_progress(root / f"replica-{i}" / "progress.jsonl") for i in range(learners)
        }
        val_final, max_diff = _evaluate_final(rec, root, learners, model0)
        wall_s = time.time() - started
    finally:
        from diloco.runtime.procs import stop_all

        stop_all(children, timeout=10.0)
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    summary = _summarize(
        records=records,
        codes=codes,
        learners=learners,
        batch=batch,
        slow=slow,
        seq_len=rec.model.seq_len,
        num_params=num_params,
        val_initial=val_initial,
        val_final=val_final,
        max_diff=max_diff,
        started=started,
        wall_s=wall_s,
        stopped_by=stopped_by,
        run_dir="" if temporary else str(root),
        fragments=fragments,
    )
    summary["peer"] = _peer_info(
        version,
        recipe=recipe,
        sync_every=sync_every,
        fragments=fragments,
        sync_delay=sync_delay,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        lighthouse={
            "min_replicas": min_replicas or learners,
            "join_timeout_ms": join_timeout_ms,
            "quorum_tick_ms": quorum_tick_ms,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
        },
    )
    return summary


def _peer_info(
    version: str,
    *,
    recipe,
    sync_every,
    fragments,
    sync_delay,
    outer_lr,
    outer_momentum,
    lighthouse: dict,
) -> dict:
    """What the summary says about the peer: package, algorithm and its settings."""
    return {
        "name": "torchft",
        "package": TORCHFT_PACKAGE,
        "version": version,
        "algorithm": "torchft.local_sgd.DiLoCo",
        "backend": "gloo (torchft.ProcessGroupGloo), one replica group process per learner",
        "recipe": recipe,
        "sync_every": sync_every,
        "fragments": fragments,
        "sync_delay": sync_delay,
        "outer_optimizer": {
            "lr": outer_lr,
            "momentum": outer_momentum,
            "nesterov": outer_momentum > 0,
        },
        "lighthouse": lighthouse,
    }


def _check_arguments(learners, minutes, tokens, rounds, sync_every, fragments, slow) -> None:
    if learners < 1:
        raise ValueError(f"learners must be >= 1 (got {learners})")
    if not (minutes > 0 or tokens > 0 or rounds > 0):
        raise ValueError("give a budget: minutes, tokens or rounds")
    if fragments < 1 or sync_every < fragments or sync_every % fragments:
        raise ValueError(
            f"torchft needs sync_every ({sync_every}) to be a multiple of fragments ({fragments})"
        )
    for i, factor in slow.items():
        if not 0 <= i < learners or not factor >= 1.0:
            raise ValueError(f"slow: learner {i} factor {factor} (index < {learners}, factor >= 1)")


def _replica_command(role: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "diloco.cli.torchft_replica", role, *flags]


def _start_lighthouse(root: Path, min_replicas, join_ms, tick_ms, heartbeat_ms, children: list):
    from diloco.runtime.procs import Child

    child = Child(
        "lighthouse",
        _replica_command(
            "lighthouse",
            f"--port-file={root / 'lighthouse.addr'}",
            f"--min-replicas={min_replicas}",
            f"--join-timeout-ms={join_ms}",
            f"--quorum-tick-ms={tick_ms}",
            f"--heartbeat-timeout-ms={heartbeat_ms}",
        ),
        root / "logs" / "lighthouse.log",
    )
    children.append(child)
    return child


def _start_replica(root: Path, index: int, **o):
    from diloco.runtime.procs import Child

    flags = [
        f"--index={index}",
        f"--replicas={o['replicas']}",
        f"--lighthouse-file={root / 'lighthouse.addr'}",
        f"--workdir={root / f'replica-{index}'}",
        f"--recipe={o['recipe']}",
        f"--seed={o['seed']}",
        f"--batch-size={o['batch']}",
        f"--slow={o['slow']}",
        f"--sync-every={o['sync_every']}",
        f"--fragments={o['fragments']}",
        f"--sync-delay={o['sync_delay']}",
        f"--outer-lr={o['outer_lr']}",
        f"--outer-momentum={o['outer_momentum']}",
        f"--rounds={o['rounds']}",
        f"--schedule-seconds={o['schedule_s']}",
        f"--schedule-steps={o['schedule_steps']}",
        f"--run-started={o['started']}",
        f"--min-replica-size={o['min_replica_size']}",
        f"--hard-deadline={o['hard_deadline']}",
        f"--threads={o['threads']}",
    ]
    if o["data"]:
        flags.append(f"--data={o['data']}")
    return Child(
        f"replica-{index}",
        _replica_command("replica", *flags),
        root / "logs" / f"replica-{index}.log",
        threads=o["threads"],
    )


def _supervise(root, lighthouse, replicas, started, budget_s, minutes, tokens, start_timeout):
    """Watch the processes and the budget; when it is spent, write the stop step. Returns why
    the run stops. Raises RuntimeError if a process fails, TimeoutError if a replica has not
    completed its first sync within ``start_timeout``."""
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
        if any(rec is None for rec in lasts) and elapsed > start_timeout:
            raise TimeoutError(f"a replica did not complete its first sync in {start_timeout:.0f}s")
        total = sum(rec["tokens"] for rec in lasts if rec)
        reason = None
        if minutes and elapsed >= minutes * 60:
            reason = "time"
        elif tokens and total >= tokens:
            reason = "tokens"
        elif elapsed >= budget_s:
            reason = "max_minutes"
        if reason:
            (root / STOP_FILE).write_text(reason)
            return reason


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
    from diloco.report.jsonl import read_jsonl

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
    *,
    records,
    codes,
    learners,
    batch,
    slow,
    seq_len,
    num_params,
    val_initial,
    val_final,
    max_diff,
    started,
    wall_s,
    stopped_by,
    run_dir,
    fragments,
):
    from diloco.report.goodput import commit_gaps, uptime
    from diloco.report.summary import build_summary, data_parallel_bytes_per_token

    per_learner, useful, provisioned, starts, ends = [], {}, {}, [], []
    for i in range(learners):
        recs = records.get(i, [])
        last = recs[-1] if recs else {}
        train_s = last.get("train_s") or (last["t"] - started if last else 0.0)
        compute_s = last.get("compute_s", 0.0)
        toks = int(last.get("tokens", 0))
        name = f"learner-{i}"
        useful[name] = float(last.get("useful_tokens", 0.0))
        provisioned[name] = toks / compute_s * train_s if compute_s else 0.0
        if last:
            starts.append(last["t"] - train_s)
            ends.append(last["t"])
        per_learner.append(
            {
                "id": name,
                "steps": int(last.get("step", 0)),
                "tokens": toks,
                "steps_per_s": last.get("step", 0) / train_s if train_s else 0.0,
                "batch_size": batch,
                "slow": slow.get(i, 1.0),
                "exit_code": codes.get(i),
                "restarts": 0,
                "contributions": sum(1 for r in recs if r.get("committed")),
                "bytes_up": int(last.get("bytes_sent", 0)),
                "bytes_down": int(last.get("bytes_received", 0)),
                "useful_tokens": round(useful[name]),
                "compute_s": round(compute_s, 3),
                "sync_s": round(last.get("sync_s", 0.0), 3),
                "train_s": round(train_s, 3),
                "commit_failures": int(last.get("commit_failures", 0)),
            }
        )
    rounds = max(
        (int(r.get("outer_step", 0)) for recs in records.values() for r in recs), default=0
    )
    summary = build_summary(
        mode="torchft",
        run_dir=run_dir,
        wall_s=wall_s,
        val_initial=val_initial,
        val_final=val_final,
        rounds=rounds,
        learners=per_learner,
        num_params=num_params,
        seq_len=seq_len,
        stopped_by=stopped_by,
    )
    tokens = summary["tokens"]
    up = summary["bytes"]["up"]
    per_token = up / tokens if tokens else None
    dp = data_parallel_bytes_per_token(num_params, learners, learners * batch * seq_len)
    summary["bytes"].update(
        {
            "per_token": per_token,
            "reduction_vs_data_parallel": (dp / per_token) if per_token and dp else None,
            "counted": "TCP payload bytes from the kernel (TCP_INFO) on every socket of every "
            "replica process; per_token = bytes sent / tokens",
        }
    )
    train_s = (max(ends) - min(starts)) if starts else 0.0
    commits = [r["t"] for r in records.get(0, []) if r.get("committed")]
    gaps = commit_gaps(commits)
    total_provisioned = sum(provisioned.values())
    summary.update(
        {
            "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "train_s": round(train_s, 2),
            "train_tokens_per_s": tokens / train_s if train_s else 0.0,
            "goodput": sum(useful.values()) / total_provisioned if total_provisioned else None,
            "useful_tokens": {k: round(v) for k, v in useful.items()},
            "provisioned_tokens": {k: round(v) for k, v in provisioned.items()},
            "uptime": uptime(commits, min(starts), max(ends)) if starts else 0.0,
            "max_commit_gap_s": max(gaps) if gaps else None,
            "replicas_max_diff": max_diff,
            "fragments": fragments,
        }
    )
    return summary


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
    """``["1=3", ...]`` -> ``{1: 3.0}``."""
    out = {}
    for v in values:
        index, sep, factor = v.partition("=")
        if not sep:
            raise ValueError(f"--slow wants I=F, got {v!r}")
        out[int(index)] = float(factor)
    return out

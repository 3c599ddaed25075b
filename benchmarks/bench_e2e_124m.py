"""A GPT-2-small-sized model (124M parameters) end to end: two real learners, a real syncer
process, the export; against the plain training loop of the same model.

    python benchmarks/bench_e2e_124m.py [--repeats 3] [--steps 30] [--json out.json]
    python benchmarks/bench_e2e_124m.py --quick          # a tiny GPT-2, the smoke test

**The model and data.** ``transformers.GPT2LMHeadModel`` from ``GPT2Config()``'s defaults
(vocabulary 50,257, 12 layers of width 768, 12 heads: GPT-2 small) with a context of 256
positions: 123.8M parameters, random initialisation (seed 0), nothing downloaded. Each step
is AdamW (lr 1e-4) on a batch of 4 × 128 random tokens (a seeded generator: no data set is
read, the rate and memory of a step do not depend on the tokens). ``--quick`` is a 2-layer
GPT-2 of width 64 over 512 tokens (0.1M parameters) with fewer steps: the same code path.

**What runs, per repeat** (each process fresh; the training processes use one torch thread):

- ``plain``: the training loop alone, pinned to CPU 0 (it imports transformers and torch,
  not diloco).
- ``learner``: the same loop plus the real ``diloco.Learner`` (``malloc_arenas=1``, as
  ``diloco learner`` sets it), pinned to CPU 0, and a real syncer process
  (``diloco syncer --model bench_e2e_124m:build_124m --state-dir ...``, today's default
  exchange: P = 24, H = 16, sign1 up, int2 down) pinned to CPU 1. This is the overhead
  comparison: **steps/s and peak RSS of this learner against ``plain``** (targets: ≥ 0.95×
  the steps/s, ≤ 1.3× the memory). On a 2-core machine it is the only fair one: the learner
  has CPU 0 to itself as the plain loop had, and the syncer (which in a deployment runs on
  its own machine) has the other core.
- ``fleet``: two such learners (``a`` pinned to CPU 0, ``b`` to CPU 1) and the syncer, not
  pinned, so on 2 cores the syncer's merges take CPU time from the learners: their steps/s
  are reported, not held to the 5%. This run checks that **the syncer makes every due
  commit**: its clock owes one round every ``H·ξ/P`` seconds (ξ the fleet's step time: the
  faster learner's). Both learners join first and start training together; over the window
  from the first measured step of either to the last of either (the clock asks whoever is
  live) ``due = window · P / (H · ξ)``; *made* counts the clock's requests (``tick`` records of the
  syncer's tape) in that window whose fragment was committed afterwards (a ``round`` or a
  ``dropped`` record of a newer version). Target, as in ``bench_syncer_capacity.py``: made
  ≥ 95% of due, less one commit for the window's edges. Each learner closes with a flush, so
  every step it trained must come back merged (``learner.accounting()``).
- ``export``: ``diloco export STATE_DIR --model ... --format safetensors --max-shard-size
  100MB`` of the fleet's state directory, after its syncer exited. Its peak RSS (the
  process's ``VmHWM``, see below) is compared with the model's fp32
  bytes above a baseline process that only imports what the export imports: the export
  holds the model it writes into and one fragment at a time, so that difference must stay
  below two fp32 copies (about one, plus a fragment; building the 124M GPT-2 alone peaks
  about 0.3 copies above the model, transformers' initialisation). The written shards are
  loaded back strictly into a fresh model and compared with what the syncer committed.

Peak RSS of every process is the high-water mark of its own address space (``VmHWM``,
``bench_learner_overhead.peak_rss_mb``; the ``diloco`` commands run in a ``--role cli``
wrapper that writes it when they end), not ``ru_maxrss``: Linux carries a parent's peak
across ``exec`` into its child's ``ru_maxrss``, and this script's own peak (it loads the
exported model back) showed as every later child's. The syncer's is also reported per model
parameter. Medians over ``--repeats`` are printed (and written as JSON with ``--json``), and
whether each target was met; at ``--quick`` only the commits, the merged steps and the
export's shards mean something (the processes' imports outweigh a 0.1M model).

On the 2-core reference machine one plain step of the 124M model takes about 5 to 6 s (its
peak RSS about 3.6 GB; a learner about 4 GB, the syncer about 4.2 GB), so a repeat (4
training processes of 35 steps, the syncer's starts, the export) takes about 12 minutes and
the default 3 repeats about 40; the machine needs about 13 GB free for the fleet. Run it on
a quiet machine: a busy one changes steps/s more than the 5% it checks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import bench_learner_overhead as overhead

BENCH_DIR = Path(__file__).resolve().parent
MODULE = Path(__file__).stem
SEED = 0
LEARNERS = ("a", "b")
"""The fleet's learner ids; ``a`` is also the learner of the overhead comparison."""
JOIN_TIMEOUT_S = 300.0
"""How long a learner waits for the global model (the 124M keyframes: 0.5 GB over loopback)."""
DRAIN_TIMEOUT_S = 120.0
"""How long a closing learner waits for its last deltas to come back merged (the 124M
syncer merges both learners' finals of all 24 fragments at the end; the default's 30 s may
not be enough on a busy 2-core machine)."""
PROCESS_TIMEOUT_S = 3600.0
"""The longest any one process of the benchmark may run before it is killed."""
MADE_SHARE = 0.95
"""The share of the due commits the syncer must make (less one for the window's edges)."""
SPEED_TARGET = 0.95
"""The learner's steps/s over the plain loop's that the overhead comparison asks for."""
MEMORY_TARGET = 1.3
"""The learner's peak RSS over the plain loop's that the overhead comparison allows."""
EXPORT_COPIES_LIMIT = 2.0
"""The export's peak RSS above its imports, in fp32 copies of the model, that it stays below."""


@dataclass(frozen=True)
class Size:
    """One model size of the benchmark and how each of its steps trains."""

    gpt2: dict = field(default_factory=dict)
    """``GPT2Config`` fields that differ from its defaults."""
    seq_len: int = 128
    batch: int = 4
    steps: int = 30
    """Measured steps per run (after ``overhead.WARMUP`` warm-up steps)."""
    max_shard_size: str = "100MB"
    """The export's ``--max-shard-size``."""
    min_step_s: float = 0.0
    """A stated step time: each step lasts at least this long (``overhead.timed_loop``)."""


SIZES = {
    "124m": Size(gpt2={"n_positions": 256}),
    "quick": Size(
        gpt2={"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 2,
              "bos_token_id": None, "eos_token_id": None},
        seq_len=32, batch=2, steps=20, max_shard_size="64KB", min_step_s=0.25,
    ),
}  # fmt: skip


def build(size: str):
    """The benchmark's model of ``size``, seeded: every learner and the syncer build the same."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # (its note on the config's loss_type)
    torch.manual_seed(SEED)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**SIZES[size].gpt2))


def build_124m():
    """``--model bench_e2e_124m:build_124m``: GPT-2 small with 256 positions."""
    return build("124m")


def build_quick():
    """``--model bench_e2e_124m:build_quick``: the ``--quick`` model."""
    return build("quick")


def model_ref(size: str) -> str:
    return f"{MODULE}:build_{size}"


# ----------------------------------------------------------------------------- children
def train(args) -> dict:
    """One measured run in this process (``args.syncer`` empty: the plain loop)."""
    import torch

    torch.set_num_threads(1)
    size = SIZES[args.size]
    model = build(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = None
    if args.syncer:
        import diloco

        learner = diloco.Learner(
            model,
            optimizer,
            syncer=args.syncer,
            learner_id=args.learner_id,
            malloc_arenas=1,
            drain_timeout_s=DRAIN_TIMEOUT_S,
        )
        learner.wait_for_global(timeout=JOIN_TIMEOUT_S)
        Path(args.ready_file).touch()  # joined: the fleet starts training together
        wait_for_files([Path(args.go_file)], [])
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(SEED)
    result = overhead.timed_loop(
        model,
        optimizer,
        lambda m, x: m(input_ids=x, labels=x).loss,
        lambda: torch.randint(0, vocab, (size.batch, size.seq_len), generator=gen),
        args.steps,
        learner,
        min_step_s=size.min_step_s,
    )
    result["peak_rss_mb"] = overhead.peak_rss_mb()  # (the training's peak, before the close)
    result["params"] = sum(p.numel() for p in model.parameters())
    if learner is not None:
        learner.close()  # flush: every trained step goes to the syncer
        accounting = learner.accounting()
        result["trained"] = accounting.trained
        result["merged_min"] = min(accounting.merged)
        result["uploads"] = learner.stats["uploads_sent"]
    return result


def without_model(size: str) -> dict:
    """The baseline of the export's memory: a process that imported what the export imports
    and built the model on the meta device (its code, none of its bytes)."""
    import torch

    import diloco.cli  # noqa: F401
    import diloco.launch.export  # noqa: F401

    with torch.device("meta"):
        build(size)
    return {"peak_rss_mb": overhead.peak_rss_mb()}


# ----------------------------------------------------------------------------- processes
def child_env() -> dict:
    """This environment with the benchmark's directory on the path (``--model`` imports it)."""
    path = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def pinned(cpus: set[int] | None):
    """A ``preexec_fn`` that pins the child (every thread it will make) to ``cpus``."""
    if cpus is None:
        return None
    usable = sorted(os.sched_getaffinity(0))
    cpus = {usable[c % len(usable)] for c in cpus}
    return lambda: os.sched_setaffinity(0, cpus)


def start(cmd: list[str], cpus: set[int] | None = None, output: Path | None = None):
    """Start ``cmd`` (pinned to ``cpus``; its stdout into ``output``, else discarded)."""
    with open(output or os.devnull, "w") as out:
        return subprocess.Popen(cmd, env=child_env(), preexec_fn=pinned(cpus), stdout=out)


def finish(proc: subprocess.Popen, timeout: float = PROCESS_TIMEOUT_S) -> None:
    """Wait for ``proc`` (killed after ``timeout``). Raises ``RuntimeError`` when it failed."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, proc.args[:6]))} ... exited {proc.returncode}")


def diloco_command(peak_file: Path, *argv: str) -> list[str]:
    """``diloco ARGV`` run by this script's ``--role cli``, which writes the command's peak
    RSS in MiB to ``peak_file`` when it ends (``peak_mb`` reads it)."""
    return [sys.executable, __file__, "--role=cli", f"--peak-file={peak_file}", "--", *argv]


def run_diloco(argv: list[str], peak_file: str) -> int:
    """``--role cli``: the ``diloco`` command ``argv`` in this process; then its peak RSS."""
    from diloco.cli import main as diloco_main

    try:
        return diloco_main(argv)
    finally:
        Path(peak_file).write_text(f"{overhead.peak_rss_mb()}\n")


def peak_mb(peak_file: Path) -> float:
    return float(peak_file.read_text())


def wait_for_files(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    """Wait until every one of ``paths`` exists (files other processes write: polled, there is
    no event to wait on); ``RuntimeError`` when one of ``procs`` exits first or after
    ``PROCESS_TIMEOUT_S``."""
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while not all(path.exists() for path in paths):
        if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"waited in vain for {', '.join(map(str, paths))}")
        time.sleep(0.1)


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill and reap those of ``procs`` still running (after a failure)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def child(role: str, args, *extra: str) -> list[str]:
    return [sys.executable, __file__, f"--role={role}", f"--size={args.size}",
            f"--steps={args.steps}", *extra]  # fmt: skip


def run_child(role: str, args, output: Path, cpus: set[int] | None = None) -> dict:
    """Run a child of this script to its end; the JSON it printed."""
    finish(start(child(role, args), cpus, output))
    return json.loads(output.read_text().strip().splitlines()[-1])


def start_syncer(args, state_dir: Path, cpus: set[int] | None) -> tuple[subprocess.Popen, str]:
    """A real ``diloco syncer`` process serving the benchmark's model from ``state_dir``
    (today's default exchange); it exits when its learners have left. Returns it and its
    address."""
    port_file = state_dir.with_suffix(".port")  # (written once it serves)
    proc = start(
        diloco_command(
            state_dir.with_suffix(".peak"), "syncer", "--model", model_ref(args.size),
            "--state-dir", str(state_dir), "--bind", "127.0.0.1:0", "--port-file", str(port_file),
            "--stop-when-learners-leave"),
        cpus,
    )  # fmt: skip
    try:
        wait_for_files([port_file], [proc])
    except RuntimeError:
        kill_all([proc])
        raise
    return proc, port_file.read_text().strip()


def measure_learners(args, work: Path, ids: tuple[str, ...], syncer_cpus) -> dict:
    """A syncer and ``ids`` learners (the i-th pinned to CPU i): the learners' results, the
    syncer's peak RSS and its state directory."""
    state_dir = work / f"syncer-{len(ids)}"
    syncer, address = start_syncer(args, state_dir, syncer_cpus)
    procs = [syncer]
    go = work / f"{state_dir.name}.go"
    ready = [work / f"{state_dir.name}-{i}.ready" for i in ids]
    try:
        for cpu, learner_id in enumerate(ids):
            extra = (f"--syncer={address}", f"--learner-id={learner_id}",
                     f"--ready-file={ready[cpu]}", f"--go-file={go}")  # fmt: skip
            output = work / f"{state_dir.name}-{learner_id}.json"
            procs.append(start(child("train", args, *extra), {cpu}, output))
        wait_for_files(ready, procs)
        go.touch()
        for proc in procs[1:]:
            finish(proc)
        results = {
            i: json.loads((work / f"{state_dir.name}-{i}.json").read_text().splitlines()[-1])
            for i in ids
        }
        finish(syncer)
        syncer_rss = peak_mb(state_dir.with_suffix(".peak"))
    finally:
        kill_all(procs)
    return {"learners": results, "syncer_rss_mb": syncer_rss, "state_dir": state_dir}


# ----------------------------------------------------------------------------- measures
def commits_made(tape: Path, window: tuple[float, float], step_s: float) -> dict:
    """The clock's due rounds in ``window`` (wall-clock seconds) and how many were made, from
    the syncer's tape (see the module docstring)."""
    from diloco.wire.protocol import ProtocolConfig

    records = [json.loads(line) for line in tape.read_text().splitlines() if line.strip()]
    start = next(r for r in records if r.get("event") == "start")
    fragments = len(start["fragments"])  # (those it serves)
    sync_every = ProtocolConfig().sync_every  # (the syncer runs the default exchange)
    committed: dict[int, int] = {}
    for r in records:
        if r.get("event") in ("round", "dropped"):
            committed[r["fragment"]] = max(committed.get(r["fragment"], 0), r["version"])
    ticks = [r for r in records if r.get("event") == "tick" and window[0] <= r["t"] <= window[1]]
    made = sum(committed.get(r["fragment"], 0) > r["version"] for r in ticks)
    due = (window[1] - window[0]) * fragments / (sync_every * step_s)
    return {"due": due, "ticks": len(ticks), "made": made,
            "every_due_commit": made >= MADE_SHARE * due - 1}  # fmt: skip


def export(args, state_dir: Path, out: Path, params: int) -> dict:
    """``diloco export`` of ``state_dir`` to sharded safetensors: its peak RSS against the
    model's fp32 bytes above the imports' baseline; the shards loaded back and checked."""
    baseline = run_child("without-model", args, out.with_suffix(".json"))["peak_rss_mb"]
    proc = start(
        diloco_command(
            out.with_suffix(".peak"), "export", str(state_dir), "--model", model_ref(args.size),
            "-o", str(out), "--format", "safetensors",
            "--max-shard-size", args.max_shard_size or SIZES[args.size].max_shard_size),
    )  # fmt: skip
    finish(proc)
    peak = peak_mb(out.with_suffix(".peak"))
    model_mb = params * 4 / 2**20
    return {
        "peak_rss_mb": peak,
        "baseline_mb": baseline,
        "model_fp32_mb": model_mb,
        "copies": (peak - baseline) / model_mb,
        "shards": len(list(out.glob("*.safetensors"))),
        "loads_back": exported_equals_state(args.size, state_dir, out),
    }


def exported_equals_state(size: str, state_dir: Path, out: Path) -> bool:
    """The exported shards load strictly into a fresh model, and every parameter is the value
    the syncer's state directory holds."""
    import torch

    from diloco.algorithm.fragments import FragmentLayout
    from diloco.runtime.tensor_files import load_sharded
    from diloco.syncer.export import load_into_model

    model = build(size)
    model.load_state_dict(load_sharded(out), strict=True)
    exported = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = FragmentLayout.from_dict(json.loads((state_dir / "meta.json").read_text())["layout"])
    state, _ = load_into_model(build(size), layout, [state_dir])
    return all(torch.equal(exported[n], state[n]) for n in exported)


def one_repeat(args, work: Path) -> dict:
    plain = run_child("train", args, work / "plain.json", {0})
    single = measure_learners(args, work, LEARNERS[:1], {1})
    fleet = measure_learners(args, work, LEARNERS, None)
    learners = fleet["learners"].values()
    window = (min(r["measured_from"] for r in learners), max(r["measured_to"] for r in learners))
    step_s = 1 / max(r["steps_per_s"] for r in learners)
    learner = single["learners"][LEARNERS[0]]
    params = plain["params"]
    return {
        "params": params,
        "plain": plain,
        "learner": learner,
        "speed_ratio": learner["steps_per_s"] / plain["steps_per_s"],
        "rss_ratio": learner["peak_rss_mb"] / plain["peak_rss_mb"],
        "syncer_bytes_per_param": single["syncer_rss_mb"] * 2**20 / params,
        "fleet": {
            "learners": fleet["learners"],
            "speed_ratios": [r["steps_per_s"] / plain["steps_per_s"] for r in learners],
            "all_merged": all(r["merged_min"] == r["trained"] for r in learners),
            "syncer_bytes_per_param": fleet["syncer_rss_mb"] * 2**20 / params,
            **commits_made(fleet["state_dir"] / "events.jsonl", window, step_s),
        },
        "export": export(args, fleet["state_dir"], work / "export", params),
    }


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats, and whether each target was met."""

    def median(get) -> float:
        return statistics.median(get(r) for r in runs)

    summary = {
        "params": runs[0]["params"],
        "plain_steps_per_s": median(lambda r: r["plain"]["steps_per_s"]),
        "learner_steps_per_s": median(lambda r: r["learner"]["steps_per_s"]),
        "speed_ratio": median(lambda r: r["speed_ratio"]),
        "plain_peak_rss_mb": median(lambda r: r["plain"]["peak_rss_mb"]),
        "learner_peak_rss_mb": median(lambda r: r["learner"]["peak_rss_mb"]),
        "rss_ratio": median(lambda r: r["rss_ratio"]),
        "syncer_bytes_per_param": median(lambda r: r["syncer_bytes_per_param"]),
        "fleet_speed_ratio": median(lambda r: min(r["fleet"]["speed_ratios"])),
        "commits_due": median(lambda r: r["fleet"]["due"]),
        "commits_made": median(lambda r: r["fleet"]["made"]),
        "export_peak_rss_mb": median(lambda r: r["export"]["peak_rss_mb"]),
        "export_copies": median(lambda r: r["export"]["copies"]),
    }
    summary["targets"] = {
        "speed": summary["speed_ratio"] >= SPEED_TARGET,
        "memory": summary["rss_ratio"] <= MEMORY_TARGET,
        "every_due_commit": all(r["fleet"]["every_due_commit"] for r in runs),
        "every_step_merged": all(r["fleet"]["all_merged"] for r in runs),
        "export_streams": summary["export_copies"] < EXPORT_COPIES_LIMIT,
        "export_loads_back": all(r["export"]["loads_back"] for r in runs),
    }
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="bench", choices=("bench", "train", "without-model", "cli"))
    p.add_argument("--peak-file", default="", help=argparse.SUPPRESS)
    p.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="the tiny model: a smoke test")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help="measured steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-shard-size", default=None, help="the export's (default: the size's)")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--keep", default="", help="keep the runs' files in this directory")
    p.add_argument("--syncer", default="", help=argparse.SUPPRESS)
    p.add_argument("--learner-id", default=LEARNERS[0], help=argparse.SUPPRESS)
    p.add_argument("--ready-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--go-file", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.size = args.size or ("quick" if args.quick else "124m")
    args.steps = args.steps or SIZES[args.size].steps
    if args.role == "train":
        print(json.dumps(train(args)))
        return 0
    if args.role == "cli":
        return run_diloco(args.argv, args.peak_file)
    if args.role == "without-model":
        print(json.dumps(without_model(args.size)))
        return 0
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
            work = Path(args.keep, f"repeat-{repeat}") if args.keep else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            runs.append(one_repeat(args, work))
        print(f"repeat {repeat}:", json.dumps(runs[-1], default=str), flush=True)
    summary = summarize(runs)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

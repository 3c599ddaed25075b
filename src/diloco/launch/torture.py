"""The torture run: real processes, seeded faults, then the exactly-once audit.

One ``diloco syncer`` process and M ``diloco learner`` processes (the ``tiny`` recipe), each
learner behind its own TCP relay (``diloco.launch.relay``). A seeded schedule of faults
(:func:`fault_schedule`, a pure function of the spec) hits them while they train:

* ``syncer-kill``: SIGKILL of the syncer at a random moment (rounds open, merges and writes
  in flight); it is started again on the same address and state directory;
* ``disk-full``: the syncer's state directory (a small tmpfs) fills up for a few seconds; the
  syncer must fail (exit non-zero), and is started again until the disk has room;
* ``learner-kill``: SIGKILL of one learner; it comes back with the same id and no local state
  (its checkpoint is gone with its machine), joins and trains on;
* ``partition``: one learner's link is cut for a few seconds;
* lost replies, all along: each learner's relay loses the reply to an upload with a given
  probability (the syncer handled it; the learner never hears).

At the end every fault is healed, the learners stop cleanly (SIGTERM: flush, drain, exit 0)
and then the syncer; :func:`diloco.report.exactly_once.audit` reads the tape, the journals,
the learners' final accounting and the state directory. ``benchmarks/bench_torture.py`` runs
many seeds; ``tests/test_torture.py`` a short one. Disk-full faults need root (a tmpfs).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diloco.launch.relay import Relay
from diloco.launch.syncer_process import FAILED
from diloco.learner.journal import JOURNAL_FILE
from diloco.report.audit_files import FINAL_ACCOUNTING, audit_directories
from diloco.report.exactly_once import Audit
from diloco.runtime.disk import SmallDisk
from diloco.runtime.jsonl import read_jsonl
from diloco.runtime.procs import Child, diloco_command

FAULT_KINDS = ("syncer-kill", "disk-full", "learner-kill", "partition")
STALL_BOUND_S = 20.0
"""The longest the syncer may serve without a commit while learners train: learners come
back within their capped reconnect backoff (5 s) of a restart, and a round holding a
contribution closes within one cycle of the clock (well under a second here)."""
DISK_BYTES = 16 << 20
"""Size of the syncer's state filesystem (the tiny recipe's state is about 1 MB)."""


@dataclass(frozen=True)
class TortureSpec:
    seed: int = 0
    learners: int = 3
    seconds: float = 40.0
    """Training time; faults fall in [5 s, seconds − 12 s], the rest is quiet."""
    syncer_kills: int = 2
    disk_fulls: int = 1
    learner_kills: int = 2
    partitions: int = 2
    reply_loss: float = 0.1
    """Probability that the reply to an upload is lost."""
    disk_full_s: tuple[float, float] = (2.0, 6.0)
    """How long the disk stays full (drawn uniformly): shorter than the syncer's retries
    (about 3 s) it is ridden out, longer it fails the syncer."""
    comms: str = "default"
    """The syncer's ``--comms`` setting (its H and codecs)."""
    up_codec: str | None = "int4"
    """The syncer's ``--up-codec`` (None: the setting's). int4 by default: the relays tell
    an upload from the other calls by its size (``relay.REQUEST_BYTES``) to lose its reply,
    and the tiny recipe's fragments in the default's sign1 are smaller than that."""
    down_codec: str | None = None
    """The syncer's ``--down-codec`` (None: the setting's)."""


@dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the learners started."""
    kind: str
    target: int = -1
    """The learner (-1: the syncer)."""
    down_s: float = 0.0


def fault_schedule(spec: TortureSpec) -> list[Fault]:
    """The faults of ``spec``, in time order: a pure function of it (same spec, same
    schedule). Learner faults of one learner do not overlap, and at most M − 1 learners are
    down at once."""
    rng = random.Random(spec.seed)
    first, last = 5.0, max(6.0, spec.seconds - 12.0)
    faults = [
        Fault(rng.uniform(first, last), "syncer-kill", -1, rng.uniform(0.5, 3.0))
        for _ in range(spec.syncer_kills)
    ]
    faults += [
        Fault(rng.uniform(first, last), "disk-full", -1, rng.uniform(*spec.disk_full_s))
        for _ in range(spec.disk_fulls)
    ]
    busy: dict[int, list[tuple[float, float]]] = {i: [] for i in range(spec.learners)}
    for kind, count in (("learner-kill", spec.learner_kills), ("partition", spec.partitions)):
        for _ in range(count):
            for _attempt in range(50):
                at, down = rng.uniform(first, last), rng.uniform(1.0, 4.0)
                target = rng.randrange(spec.learners)
                span = (at, at + down + 1.0)
                if any(a < span[1] and span[0] < b for a, b in busy[target]):
                    continue
                others = sum(
                    any(a < span[1] and span[0] < b for a, b in spans)
                    for i, spans in busy.items()
                    if i != target
                )
                if others >= spec.learners - 1:
                    continue
                busy[target].append(span)
                faults.append(Fault(at, kind, target, down))
                break
    return sorted(faults, key=lambda f: f.at)


@dataclass
class TortureResult:
    spec: TortureSpec
    audit: Audit
    faults: list[Fault]
    syncer_starts: int
    syncer_failures: int
    """Times the syncer exited on its own (the disk filled up), not killed by the run."""
    learner_kills: int
    """Learner processes killed (a kill may hit a restarted one before it journaled)."""
    syncer_kills: int
    """Syncer processes killed (a kill that finds the syncer down already does nothing)."""
    replies_lost: int
    commits: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            "spec": asdict(self.spec),
            "audit": self.audit.to_dict(),
            "faults": [asdict(f) for f in self.faults],
            "syncer_starts": self.syncer_starts,
            "syncer_failures": self.syncer_failures,
            "learner_kills": self.learner_kills,
            "syncer_kills": self.syncer_kills,
            "replies_lost": self.replies_lost,
            "commits": self.commits,
            "seconds": round(self.seconds, 1),
        }


class Torture:
    """One torture run in ``workdir`` (see the module docstring)."""

    def __init__(self, spec: TortureSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        self.faults = fault_schedule(spec)
        if os.geteuid() != 0 and any(f.kind == "disk-full" for f in self.faults):
            raise PermissionError("disk-full faults need root (a tmpfs); set disk_fulls=0")
        self.disk: SmallDisk | None = None
        self.syncer: Child | None = None
        self.learners: list[Child | None] = [None] * spec.learners
        self.relays: list[Relay] = []
        self.address = ""
        self.down: list[tuple[float, float]] = []
        self._down_since: float | None = None
        self.syncer_starts = 0
        self.syncer_failures = 0
        self._serving = False
        self._port_file = self.workdir / "syncer.port"
        self.learner_kills = 0
        self.syncer_kills = 0
        self._t0 = time.time()
        self._log_path = self.workdir / "torture.jsonl"

    # ------------------------------------------------------------------ paths
    @property
    def state_dir(self) -> Path:
        return (self.disk.path if self.disk else self.workdir / "disk") / "state"

    def learner_dir(self, i: int) -> Path:
        return self.workdir / "learners" / f"l{i}"

    def _log(self, event: str, **fields) -> None:
        """One line of the run's own log (``torture.jsonl``: what it did, when)."""
        record = {"t": round(time.time() - self._t0, 3), "event": event, **fields}
        with open(self._log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # --------------------------------------------------------------- processes
    def _start_syncer(self, *, wait: bool = False) -> None:
        """Start the syncer process (on the address it had, if any); ``wait``: until it
        serves or exits (60 s at most). Otherwise ``_check_serving`` notices it serving, so
        the schedule goes on while it starts."""
        self._port_file.unlink(missing_ok=True)
        argv = diloco_command(
            "syncer",
            "--recipe=tiny",
            f"--bind={self.address or '127.0.0.1:0'}",
            f"--state-dir={self.state_dir}",
            f"--port-file={self._port_file}",
            *([f"--comms={self.spec.comms}"] if self.spec.comms != "default" else []),
            *([f"--up-codec={self.spec.up_codec}"] if self.spec.up_codec else []),
            *([f"--down-codec={self.spec.down_codec}"] if self.spec.down_codec else []),
            "--exit-with-parent",
        )
        self.syncer = Child("syncer", argv, self.workdir / "syncer.log")
        self.syncer_starts += 1
        self._serving = False
        deadline = time.monotonic() + 60
        while wait and not self._check_serving() and self.syncer.running:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def _check_serving(self) -> bool:
        """Whether the syncer serves (noticing the moment it starts to)."""
        if not self._serving and self.syncer is not None and self._port_file.exists():
            self._serving = True
            self.address = self._port_file.read_text().strip()
            self._log("syncer-serving", address=self.address)
            if self._down_since is not None:
                self.down.append((self._down_since, time.time()))
                self._down_since = None
        return self._serving

    def _syncer_went_down(self) -> None:
        if self._down_since is None:
            self._down_since = time.time()

    def _start_learner(self, i: int) -> None:
        workdir = self.learner_dir(i)
        for stale in ("checkpoint.pt", "delivered.json", FINAL_ACCOUNTING):
            (workdir / stale).unlink(missing_ok=True)  # a new machine: no local state
        argv = diloco_command(
            "learner",
            "--recipe=tiny",
            f"--id=l{i}",
            f"--index={i}",
            f"--syncer={self.relays[i].address}",
            f"--workdir={workdir}",
            "--checkpoint-every=0",
            "--exit-with-parent",
        )
        self.learners[i] = Child(f"l{i}", argv, workdir / "learner.log")
        self._log("learner-start", learner=i)

    # --------------------------------------------------------------------- run
    def run(self) -> TortureResult:
        t_start = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        use_disk = any(f.kind == "disk-full" for f in self.faults)
        self.disk = SmallDisk(self.workdir / "disk", DISK_BYTES) if use_disk else None
        try:
            self._start_syncer(wait=True)
            if not self._serving:
                raise RuntimeError(f"the syncer did not start:\n{self.syncer.tail()}")
            self.relays = [
                Relay(self.address, name=f"relay-l{i}") for i in range(self.spec.learners)
            ]
            for i, relay in enumerate(self.relays):
                relay.lose_replies(self.spec.reply_loss, seed=self.spec.seed * 1000 + i)
                self._start_learner(i)
            started = time.time()
            self._play(started)
            self._heal_everything()
            window_end = time.time()
            self._stop_learners()
            self._stop_syncer()
        finally:
            self._clean_up()
        result = self._audit(started, window_end)
        result.seconds = time.monotonic() - t_start
        return result

    def _play(self, started: float) -> None:
        """Carry out the schedule while the learners train; restart what died."""
        pending = list(self.faults)
        restarts: list[tuple[float, str, int]] = []  # (when, what, learner)
        end = started + self.spec.seconds
        while time.time() < end:
            now = time.time()
            while pending and started + pending[0].at <= now:
                self._inject(pending.pop(0), now, restarts)
            for item in sorted(restarts):
                when, what, i = item
                if when > now:
                    continue
                restarts.remove(item)
                if what == "learner":
                    self._start_learner(i)
                elif what == "heal":
                    self.relays[i].heal()
                elif what == "free":
                    self.disk.free()
            self._keep_syncer_up(now, restarts)
            time.sleep(0.05)

    def _inject(self, fault: Fault, now: float, restarts: list) -> None:
        self._log("fault", **asdict(fault))
        if fault.kind == "syncer-kill" and self.syncer is not None and self.syncer.running:
            self.syncer.signal(signal.SIGKILL)
            self.syncer.proc.wait(timeout=10)
            self.syncer_kills += 1
            self._syncer_went_down()
            restarts.append((now + fault.down_s, "syncer", -1))
        elif fault.kind == "disk-full" and self.disk is not None:
            self.disk.fill()
            restarts.append((now + fault.down_s, "free", -1))
        elif fault.kind == "learner-kill":
            child = self.learners[fault.target]
            if child is not None and child.running:
                child.signal(signal.SIGKILL)
                child.proc.wait(timeout=10)
                self.learner_kills += 1
            restarts.append((now + fault.down_s, "learner", fault.target))
        elif fault.kind == "partition":
            self.relays[fault.target].partition(float("inf"))
            restarts.append((now + fault.down_s, "heal", fault.target))

    def _keep_syncer_up(self, now: float, restarts: list) -> None:
        """Start the syncer again when it exited on its own (its disk filled up, or a start
        on a full disk) or its kill's down time is over (``restarts`` holds those)."""
        due_kill = [r for r in restarts if r[1] == "syncer" and r[0] <= now]
        for r in due_kill:
            restarts.remove(r)
        self._check_serving()
        if self.syncer is not None and self.syncer.running:
            return
        if self.syncer is not None and not due_kill and self._down_since is None:
            code = self.syncer.poll()
            self._log("syncer-exited", code=code)
            self.syncer_failures += code == FAILED  # it failed by itself: its disk
            self._syncer_went_down()
        elif self.syncer is not None and not self._serving and not due_kill:
            self._log("syncer-start-failed", code=self.syncer.poll())
        if any(r[1] == "syncer" for r in restarts):
            return  # a kill's down time is not over yet
        self._start_syncer()

    def _heal_everything(self) -> None:
        if self.disk is not None:
            self.disk.free()
        for relay in self.relays:
            relay.heal()
        deadline = time.monotonic() + 90
        while not (self.syncer is not None and self.syncer.running and self._check_serving()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the syncer does not come back:\n{self.syncer.tail()}")
            if self.syncer is None or not self.syncer.running:
                self._start_syncer(wait=True)
            time.sleep(0.05)
        for i, child in enumerate(self.learners):
            if child is None or not child.running:
                self._start_learner(i)
        deadline = time.monotonic() + 120
        while not all(self._contributing(i) for i in range(self.spec.learners)):
            if time.monotonic() > deadline:
                raise RuntimeError("a learner does not come back to train")
            time.sleep(0.2)
        time.sleep(3.0)  # a few rounds with everyone

    def _contributing(self, i: int) -> bool:
        """Whether learner i's current life has sent an upload (its journal says so)."""
        lines = read_jsonl(self.learner_dir(i) / JOURNAL_FILE)
        lives = [line["life"] for line in lines if "start" in line]
        return bool(lives) and any(line.get("life") == lives[-1] and "u" in line for line in lines)

    def _stop_learners(self) -> None:
        for child in self.learners:
            if child is not None and child.running:
                child.signal(signal.SIGTERM)  # flush, drain, leave, exit 0
        for child in self.learners:
            if child is not None:
                child.stop(timeout=60)

    def _stop_syncer(self) -> None:
        if self.syncer is not None:
            self.syncer.stop(timeout=30)

    def _clean_up(self) -> None:
        for child in [*self.learners, self.syncer]:
            if child is not None and child.running:
                child.kill()
        for relay in self.relays:
            relay.close()
        if self.disk is not None:
            # keep what the audit reads, then give the memory back
            if (self.disk.path / "state").exists():
                shutil.copytree(
                    self.disk.path / "state", self.workdir / "state", dirs_exist_ok=True
                )
            self.disk.unmount()

    # ------------------------------------------------------------------- audit
    def _audit(self, started: float, window_end: float) -> TortureResult:
        state = self.workdir / "state" if self.disk else self.state_dir
        verdict = audit_directories(
            state,
            {f"l{i}": self.learner_dir(i) for i in range(self.spec.learners)},
            down=self.down,
            window=(started + 5.0, window_end),
            stall_bound_s=STALL_BOUND_S,
            stopped_cleanly=True,
        )
        return TortureResult(
            self.spec,
            verdict,
            self.faults,
            self.syncer_starts,
            self.syncer_failures,
            self.learner_kills,
            self.syncer_kills,
            sum(r.replies_lost for r in self.relays),
            verdict.commits,
            0.0,
        )

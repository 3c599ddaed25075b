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
* ``learner-resume``: SIGKILL of one learner; it comes back with the same id and its local
  state (its checkpoint and upload journal: a requeued job on the same disk) and resumes;
* ``partition``: one learner's link is cut for a few seconds;
* ``long-partition``: one learner's link is cut for longer than the syncer keeps commit logs
  (``--commit-logs-kept``, lowered here to ``COMMIT_LOGS_KEPT`` so that a run of seconds
  outlasts it), with a syncer kill inside: the fates it cannot learn are counted *unknown*,
  never guessed;
* ``second-syncer``: a second ``diloco syncer`` is started on the same state directory while
  the first serves: it must refuse to start (exit 2) and write nothing;
* ``clock-step``: the syncer's wall clock steps back (``runtime.clock.WALL_OFFSET_FILE_ENV``)
  for the rest of the run: it must keep committing (its decisions run on a monotonic clock);
* ``rollback``: the syncer is SIGKILLed and its state directory replaced by a copy taken a
  few seconds earlier (a backup restored), then started again with ``--accept-rollback``:
  a new lineage; learners ahead of it take keyframes, settle what they cannot know as
  unknown, and train on (the audit marks the commits the restore undid);
* ``zombie``: one learner is cut off and a replacement process with the same id (a newer
  generation, its own machine: another work directory) starts; when the link heals the old
  process is refused for good and must exit non-zero by itself;
* lost replies, all along: each learner's relay loses the answer to an upload (told by its
  gRPC method, whatever its codec) with a given probability (the syncer handled it; the
  learner never hears).

At the end every fault is healed, the learners stop cleanly (SIGTERM: flush, drain, exit 0)
and then the syncer; :func:`diloco.report.exactly_once.audit` reads the tape, the journals,
the learners' final accounting and the state directory. ``benchmarks/bench_torture.py`` runs
many seeds; ``tests/test_torture.py`` a short one. Disk-full faults need root (a tmpfs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from diloco.launch.relay import Relay
from diloco.launch.syncer_process import FAILED
from diloco.launch.torture_schedule import (
    CLOCK_STEP_S,
    COMMIT_LOGS_KEPT,
    FAULT_KINDS,
    Fault,
    TortureSpec,
    fault_schedule,
)
from diloco.learner.config import CLOSE_BOUND_S
from diloco.learner.journal import JOURNAL_FILE
from diloco.report.audit_files import FINAL_ACCOUNTING, audit_directories, unstepped_tape
from diloco.report.exactly_once import Audit
from diloco.runtime.clock import WALL_OFFSET_FILE_ENV
from diloco.runtime.disk import SmallDisk
from diloco.runtime.jsonl import read_jsonl
from diloco.runtime.live_copy import copy_live_directory
from diloco.runtime.procs import Child, diloco_command

__all__ = ["FAULT_KINDS", "STALL_BOUND_S", "Fault", "Torture", "TortureSpec", "fault_schedule"]

STALL_BOUND_S = 20.0
"""The longest the syncer may serve without a commit while learners train: learners come
back within their capped reconnect backoff (5 s) of a restart, and a round holding a
contribution closes within one cycle of the clock (well under a second here)."""
DISK_BYTES = 16 << 20
"""Size of the syncer's state filesystem (the tiny recipe's state is about 1 MB)."""


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
    learner_resumes: int = 0
    """Learner processes killed and restarted from their checkpoint."""
    second_syncers_refused: int = 0
    """Second syncers on the state directory that refused to start (exit 2); ``succeeded``:
    that served because the first had stopped meanwhile (a legitimate successor)."""
    second_syncers_succeeded: int = 0
    clock_step_commit_s: float | None = None
    """Seconds from the syncer's wall-clock step to its next commit (None: no step, or the
    syncer was restarted before it committed again)."""
    rollbacks: int = 0
    """State directories restored from a backup (the syncer started again on the copy)."""
    zombies_fenced: int = 0
    """Superseded learner processes that exited non-zero by themselves once their link
    healed."""

    def to_dict(self) -> dict:
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        plain.update(
            spec=asdict(self.spec), audit=self.audit.to_dict(), seconds=round(self.seconds, 1)
        )
        plain["faults"] = [asdict(f) for f in self.faults]
        return plain


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
        self._offset_file = self.workdir / "wall-clock-offset"
        self.learner_resumes = 0
        self.second: Child | None = None  # (a second syncer on the directory, until it exits)
        self.second_syncers_refused = 0
        self.second_syncers_succeeded = 0
        self._second_due, self._second_beside = False, None  # (beside: a Child, the first)
        self._clock_step: tuple[float, int, Child] | None = None
        """(when, the tape's size then, the syncer then) of a clock step not yet followed by
        a commit of that syncer."""
        self.clock_step_commit_s: float | None = None
        self.tape_bytes_before_step: int | None = None
        self.problems: list[str] = []  # (what the run saw go wrong, added to the audit's)
        self.workdirs: dict[int, list[Path]] = {
            i: [self.workdir / "learners" / f"l{i}"] for i in range(spec.learners)
        }
        """Each learner id's work directories, one a machine it ran on (a zombie's
        replacement runs on another); the last is the current one."""
        self.zombies: list[tuple[Child, float]] = []  # (superseded processes, when they heal)
        self.zombies_fenced = 0
        self._old_relays: list[Relay] = []
        self._backup = self.workdir / "backup"
        self._accept_rollback = False
        """The next start of the syncer accepts a rolled-back state directory."""
        self.rollbacks = 0
        self.tape_path = self.workdir / "events.jsonl"
        """The tape, outside the state directory: a backup restored over the directory
        does not roll it back, so the syncer sees the rollback."""

    # ------------------------------------------------------------------ paths
    @property
    def state_dir(self) -> Path:
        return (self.disk.path if self.disk else self.workdir / "disk") / "state"

    def learner_dir(self, i: int) -> Path:
        """Learner i's current work directory."""
        return self.workdirs[i][-1]

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
            f"--tape={self.tape_path}",
            f"--port-file={self._port_file}",
            f"--commit-logs-kept={COMMIT_LOGS_KEPT}",
            *(["--accept-rollback"] if self._accept_rollback else []),
            *([f"--comms={self.spec.comms}"] if self.spec.comms != "default" else []),
            *([f"--up-codec={self.spec.up_codec}"] if self.spec.up_codec else []),
            *([f"--down-codec={self.spec.down_codec}"] if self.spec.down_codec else []),
            "--exit-with-parent",
        )
        env = {WALL_OFFSET_FILE_ENV: str(self._offset_file)}
        self.syncer = Child("syncer", argv, self.workdir / "syncer.log", env=env)
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
            self._accept_rollback = False
            self.address = self._port_file.read_text().strip()
            self._log("syncer-serving", address=self.address)
            if self._down_since is not None:
                self.down.append((self._down_since, time.time()))
                self._down_since = None
        return self._serving

    def _syncer_went_down(self) -> None:
        if self._down_since is None:
            self._down_since = time.time()

    def _start_learner(self, i: int, *, resume: bool = False) -> None:
        """Start learner i: on a new machine (no local state), or ``resume`` from the
        checkpoint and journal its killed life left in its work directory."""
        workdir = self.learner_dir(i)
        stale = (FINAL_ACCOUNTING,) if resume else ("checkpoint.pt", "delivered.json")
        for name in (*stale, FINAL_ACCOUNTING):
            (workdir / name).unlink(missing_ok=True)
        argv = diloco_command(
            "learner",
            "--recipe=tiny",
            f"--id=l{i}",
            f"--index={i}",
            f"--syncer={self.relays[i].address}",
            f"--workdir={workdir}",
            "--checkpoint-every=1",
            "--exit-with-parent",
        )
        self.learners[i] = Child(f"l{i}", argv, workdir / "learner.log")
        self._log("learner-start", learner=i, resume=resume)

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
                if what in ("learner", "learner-resume"):
                    self._start_learner(i, resume=what == "learner-resume")
                elif what == "heal":
                    self.relays[i].heal()
                elif what == "free":
                    self.disk.free()
            self._keep_syncer_up(now, restarts)
            self._watch_second_syncer(now)
            self._watch_clock_step(now)
            self._watch_zombies(now)
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
        elif fault.kind in ("learner-kill", "learner-resume"):
            child = self.learners[fault.target]
            if child is not None and child.running:
                child.signal(signal.SIGKILL)
                child.proc.wait(timeout=10)
                self.learner_kills += 1
                self.learner_resumes += fault.kind == "learner-resume"
            what = "learner-resume" if fault.kind == "learner-resume" else "learner"
            restarts.append((now + fault.down_s, what, fault.target))
        elif fault.kind in ("partition", "long-partition"):
            self.relays[fault.target].partition(float("inf"))
            restarts.append((now + fault.down_s, "heal", fault.target))
        elif fault.kind == "second-syncer":
            self._second_due = True  # (started once the syncer serves: ``_watch_second_syncer``)
        elif fault.kind == "backup":
            copy_live_directory(self.state_dir, self._backup)
        elif fault.kind == "rollback":
            self._roll_back(now, fault, restarts)
        elif fault.kind == "zombie":
            self._supersede(fault.target, now + fault.down_s)
        elif fault.kind == "clock-step":
            self._step_clock(now)

    def _roll_back(self, now: float, fault: Fault, restarts: list) -> None:
        """Kill the syncer and restore the backup over its state directory; it starts again
        (after ``fault.down_s``) accepting the rollback."""
        if not self._backup.exists():
            return
        if self.syncer is not None and self.syncer.running:
            self.syncer.signal(signal.SIGKILL)
            self.syncer.proc.wait(timeout=10)
            self._syncer_went_down()
        try:
            shutil.rmtree(self.state_dir)
            shutil.copytree(self._backup, self.state_dir)
        except OSError as exc:  # (the small disk is full: the next start restores nothing)
            self._log("rollback-failed", error=repr(exc))
            shutil.copytree(self._backup, self.state_dir, dirs_exist_ok=True)
        self.rollbacks += 1
        self._accept_rollback = True
        restarts.append((now + fault.down_s, "syncer", -1))

    def _supersede(self, i: int, heals_at: float) -> None:
        """Cut learner i off and start its replacement (same id, a new machine: another work
        directory, another relay); the old process becomes a zombie until ``heals_at``."""
        old = self.learners[i]
        self.relays[i].partition(float("inf"))
        if old is not None and old.running:
            self.zombies.append((old, heals_at))
            self._old_relays.append(self.relays[i])
        else:
            self.relays[i].close()
        relay = Relay(self.address, name=f"relay-l{i}-r{len(self.workdirs[i])}")
        relay.lose_replies(self.spec.reply_loss, seed=self.spec.seed * 1000 + 100 + i)
        self.relays[i] = relay
        self.workdirs[i].append(self.workdir / "learners" / f"l{i}-r{len(self.workdirs[i])}")
        self._start_learner(i)

    def _watch_zombies(self, now: float) -> None:
        """Heal a zombie's link when due; once healed it must exit non-zero within 60 s
        (refused for good by the syncer), and a problem is noted if it does not."""
        for item in list(self.zombies):
            zombie, heals_at = item
            relay = self._old_relays[self.zombies.index(item)]
            if now >= heals_at and relay.partitioned:
                relay.heal()
            code = zombie.poll()
            if code is not None or now - heals_at > 60:
                self.zombies.remove(item)
                self._old_relays.remove(relay)
                relay.close()
                if code not in (None, 0):
                    self.zombies_fenced += 1
                else:
                    how = "exited 0" if code == 0 else "ran on"
                    self.problems.append(f"a zombie learner {how}: {zombie.tail()}")
                    zombie.kill()
                self._log("zombie-exited", code=code)

    def _start_second_syncer(self) -> None:
        """A second syncer on the state directory while the first one runs (a replacement
        started beside a process that is only cut off): it must refuse to start."""
        serving = self.syncer is not None and self.syncer.running and self._serving
        if self.second is not None or not serving:
            return  # (only beside a syncer that serves: one starting may not hold the lock yet)
        self._second_due = False
        self._second_beside = self.syncer
        argv = diloco_command(
            "syncer",
            "--recipe=tiny",
            "--bind=127.0.0.1:0",
            f"--state-dir={self.state_dir}",
            f"--port-file={self.workdir / 'second.port'}",
            "--exit-with-parent",
        )
        self.second = Child("second-syncer", argv, self.workdir / "second-syncer.log")

    def _watch_second_syncer(self, now: float) -> None:
        """A second syncer must exit 2 without serving (within 60 s), unless the first one
        stopped meanwhile."""
        if self._second_due:
            self._start_second_syncer()
        if self.second is None:
            return
        code = self.second.poll()
        served = (self.workdir / "second.port").exists()
        first = self._second_beside
        first_gone = first is not None and first.poll() is not None
        if code is None and not first_gone and not served and now - self.second.started_at < 60:
            return
        if code == 2 and not served:
            self.second_syncers_refused += 1
        elif first_gone:
            # the first stopped meanwhile and let the directory go: a legitimate successor,
            # ended at once (left to serve, it would hold the directory against the restarts)
            self._log("second-syncer-succeeded", first_exit=first.poll())
            self.second_syncers_succeeded += 1
            self.second.kill()
        else:
            self.problems.append(
                f"a second syncer on the state directory {'served' if served else 'ran'} "
                f"(exit {code}): {self.second.tail()}"
            )
            self.second.kill()
        self._log("second-syncer-exited", code=code)
        self.second = None

    def _step_clock(self, now: float) -> None:
        """Step the syncer's wall clock back (``CLOCK_STEP_S``) for the rest of the run."""
        self._offset_file.write_text(f"{CLOCK_STEP_S}\n")
        size = self.tape_path.stat().st_size if self.tape_path.exists() else 0
        self.tape_bytes_before_step = size  # (the audit takes the step out of those after)
        if self.syncer is not None and self.syncer.running and self._serving:
            self._clock_step = (now, size, self.syncer)

    def _watch_clock_step(self, now: float) -> None:
        """Note how long after a clock step its syncer committed again (a syncer restarted
        before that tells nothing: it read the stepped clock from its start)."""
        if self._clock_step is None:
            return
        at, size, syncer = self._clock_step
        if syncer is not self.syncer or not syncer.running:
            self._clock_step = None
            return
        with open(self.tape_path, "rb") as f:
            f.seek(size)
            tail = f.read()
        if b'"event":"round"' in tail or b'"event": "round"' in tail:
            self.clock_step_commit_s = round(now - at, 3)
            self._clock_step = None
        elif now - at > STALL_BOUND_S:
            self.problems.append(f"no commit {STALL_BOUND_S:g} s after the wall clock stepped")
            self._clock_step = None

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
        if any(r[1] == "syncer" for r in restarts):
            return  # a kill's down time is not over yet
        if self.syncer is not None and not self._serving and not due_kill:
            self._log("syncer-start-failed", code=self.syncer.poll())
        self._start_syncer()

    def _heal_everything(self) -> None:
        if self.disk is not None:
            self.disk.free()
        for relay in self.relays:
            relay.heal()
        while self.second is not None:  # its verdict: exited, or 60 s after its start
            self._watch_second_syncer(time.time())
            time.sleep(0.1)
        deadline = time.monotonic() + 90
        while self.zombies:  # healed now; each must be refused and exit by itself
            self._watch_zombies(max(time.time(), *(h for _, h in self.zombies)))
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
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
            for i, child in enumerate(self.learners):
                if child is None or not child.running:  # (one that gave up on a syncer
                    self._start_learner(i)  # down for its whole first minute exits 1)
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
                code = child.stop(timeout=CLOSE_BOUND_S + 10)
                self._log("learner-stopped", learner=child.name, code=code)

    def _stop_syncer(self) -> None:
        if self.syncer is not None:
            self.syncer.stop(timeout=30)

    def _clean_up(self) -> None:
        for child in [*self.learners, self.syncer, self.second, *(z for z, _ in self.zombies)]:
            if child is not None and child.running:
                child.kill()
        for relay in [*self.relays, *self._old_relays]:
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
        tape = self.tape_path
        if self.tape_bytes_before_step is not None:  # (the stall check reads the run's clock)
            before = self.tape_bytes_before_step
            tape = unstepped_tape(tape, before, CLOCK_STEP_S, self.workdir / "unstepped.jsonl")
        verdict = audit_directories(
            state,
            {f"l{i}": self.workdirs[i] for i in range(self.spec.learners)},
            tape=tape,
            down=self.down,
            window=(started + 5.0, window_end),
            stall_bound_s=STALL_BOUND_S,
            stopped_cleanly=True,
        )
        verdict.problems.extend(self.problems)
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
            self.learner_resumes,
            self.second_syncers_refused,
            self.second_syncers_succeeded,
            self.clock_step_commit_s,
            self.rollbacks,
            self.zombies_fenced,
        )

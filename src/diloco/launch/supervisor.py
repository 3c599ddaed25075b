"""The supervisor's process table: start, restart and inject failures into the run's children.

Policy (docs/resilience.md): a learner that dies is restarted after its down time (the chaos schedule's,
or ``restart_delay_s`` for an unplanned crash) with the same id and work directory, so it
resumes from its own checkpoint and rejoins; a learner that exits 0 has finished and stays
down. The syncer is restarted from its state directory on the same address whenever it dies.
Every injected failure and every restart is appended to the event tape (``chaos`` and
``restart`` records) next to the syncer's own records.

With ``spares=N`` the supervisor keeps N warm spares (:mod:`diloco.runtime.spare`: interpreters
that have imported torch) from the start of the chaos clock on; a restart hands the child's
command to one (``"warm": true`` on a learner's ``restart`` record; the syncer always
restarts fresh) and a new spare is started in its
place. Without a spare ready, a restart starts a fresh process as before.

A *group* (the data-parallel baseline, ``group=[names]``) fails as a whole, as a static
``torch.distributed`` job does: when one member dies, the supervisor kills the others (a
``group-stop`` record) and restarts every member together once the dead one's down time is over,
with ``--generation=G`` in their command lines bumped so that they rendezvous afresh.
"""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diloco.chaos import NETWORK_KINDS, ChaosEvent
from diloco.launch.syncers import is_syncer
from diloco.runtime.disk import SmallDisk
from diloco.runtime.procs import MAX_UNPLANNED_RESTARTS, Child

__all__ = ["MAX_UNPLANNED_RESTARTS", "ProcessSlot", "Supervisor"]


@dataclass
class ProcessSlot:
    """One supervised process and what the supervisor knows about it."""

    name: str
    argv: list[str]
    log: Path
    child: Child | None = None
    restart_at: float | None = None
    resume_at: float | None = None
    finished: bool = False
    env: dict[str, str] | None = None
    """Variables set for this process on top of the supervisor's environment."""
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    expected_death: bool = False
    heal_at: float | None = None
    planned_deaths: int = 0


class Supervisor:
    """Runs ``slots`` (learners and the syncer), carries out ``chaos`` events, restarts the dead.

    ``tape`` is called with each record to append; ``clock`` gives seconds since the run
    started. ``poll`` is called from the supervisor loop; it never blocks for long.

    Chaos times count from :meth:`start_chaos` (called once every learner is training), not
    from the launch: start-up takes seconds and varies with the machine's load, and a fault
    meant for a training learner must not hit one that is still importing torch.
    """

    def __init__(
        self,
        *,
        tape: Callable[[dict], None],
        clock: Callable[[], float],
        chaos: list[ChaosEvent] = (),
        restart_delay_s: float = 1.0,
        relays: dict | None = None,
        group: list[str] = (),
        spares: int = 0,
        disk: SmallDisk | None = None,
    ) -> None:
        """``relays``: each learner's relay (network faults); ``disk``: the small disk under
        the syncer's fragment files (``disk-full``; ``diloco.launch.run.mount_syncer_disk``)."""
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.relays = relays or {}
        self.disk = disk
        self.slots: dict[str, ProcessSlot] = {}
        self.tape = tape
        self.clock = clock
        self.pending = sorted(chaos)
        self.restart_delay_s = restart_delay_s
        self.chaos_started: float | None = None  # clock() when chaos times start counting
        self.group = list(group)
        self.generation = 0  # of the group: bumped at every group stop
        self._group_down = False
        self.spares_wanted = spares
        self._spares: list[Child] = []
        self._spare_log: Path | None = None  # beside the first child's log

    def start_chaos(self) -> None:
        """Start the chaos clock now (idempotent); records a ``chaos-clock`` tape event.
        The spares start now too: once every learner trains, not during the launch."""
        if self.chaos_started is None:
            self.chaos_started = self.clock()
            if self.pending:
                self.tape({"event": "chaos-clock", "t": time.time()})
            self._fill_spares()

    def add(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> ProcessSlot:
        """Start ``name`` (``env``: its own variables, kept across its restarts)."""
        if self._spare_log is None:
            self._spare_log = Path(log).parent / "spare.log"
        slot = ProcessSlot(name, argv, log, env=env)
        slot.child = Child(name, argv, log, env=env)
        self.slots[name] = slot
        return slot

    def relaunch(self, name: str, argv: list[str]) -> None:
        """Start ``name`` again now with ``argv`` after a planned stop (a group that grows);
        not a failure: no restart is counted or recorded."""
        slot = self.slots[name]
        if slot.child is not None and slot.child.running:
            raise RuntimeError(f"{name} is still running")
        slot.argv, slot.finished, slot.restart_at = list(argv), False, None
        slot.expected_death = False
        slot.child = Child(name, slot.argv, slot.log, env=slot.env)

    def learners(self) -> list[ProcessSlot]:
        return [s for s in self.slots.values() if not is_syncer(s.name)]

    def running(self, name: str) -> bool:
        slot = self.slots[name]
        return slot.child is not None and slot.child.running

    # ------------------------------------------------------------------------ loop step
    def poll(self) -> None:
        now = self.clock()
        if self.chaos_started is not None:
            while self.pending and self.pending[0].t <= now - self.chaos_started:
                self._inject(self.pending.pop(0), now)
        for slot in self.slots.values():
            self._check(slot, now)
        if self.group:
            self._hold_group_together(now)

    def _hold_group_together(self, now: float) -> None:
        """If a group member is down, stop the others and restart them all at the same time."""
        members = [self.slots[n] for n in self.group if n in self.slots]
        down = [s for s in members if s.restart_at is not None and not s.finished]
        if not down:
            return
        survivors = [s for s in members if s.child is not None and s.child.running]
        if survivors or not self._group_down:
            self._group_down = True
            # Peers of a dead rank fail on their own within milliseconds ("connection reset"):
            # one group failure counts as at most one unplanned crash.
            on_their_own = [s for s in down if not s.expected_death]
            for s in on_their_own[1:] if len(on_their_own) == len(down) else on_their_own:
                s.planned_deaths += 1
            self.generation += 1  # a fresh rendezvous: the old group's keys stay behind
            self.tape(
                {
                    "event": "group-stop",
                    "t": time.time(),
                    "cause": sorted(s.name for s in down),
                    "stopped": sorted(s.name for s in survivors),
                    "generation": self.generation,
                }
            )
            for s in survivors:
                s.expected_death = True
                s.planned_deaths += 1
                s.child.signal(signal.SIGCONT)
                s.child.kill()
                s.child.proc.wait(10)
                s.exit_codes.append(s.child.poll())
                s.child.close_log()
                s.restart_at = now
            for s in members:
                s.argv = [
                    f"--generation={self.generation}" if a.startswith("--generation=") else a
                    for a in s.argv
                ]
        when = max(s.restart_at for s in members if s.restart_at is not None)
        for s in members:
            if s.restart_at is not None:
                s.restart_at = when

    def _inject(self, event: ChaosEvent, now: float) -> None:
        slot = self.slots.get(event.target)
        if slot is None or slot.finished or slot.child is None or not slot.child.running:
            return  # nothing to fail: already down or done
        if slot.resume_at is not None or slot.heal_at is not None:
            return  # hung, or a network fault (partition, delay) is still on
        if event.kind in NETWORK_KINDS and event.target not in self.relays:
            return
        if event.kind == "disk-full" and self.disk is None:
            return
        record = {
            "event": "chaos",
            "t": time.time(),
            "kind": event.kind,
            "target": event.target,
            "down_s": round(event.down_s, 3),
        }
        if event.kind == "delay":
            record["latency_s"] = event.latency_s
        if event.kind == "lose-replies":
            record["probability"] = event.probability
        self.tape(record)
        if event.kind in ("kill", "syncer-kill"):
            slot.expected_death = True
            slot.planned_deaths += 1
            slot.child.kill()
            slot.child.proc.wait(10)
            slot.restart_at = now + event.down_s
        elif event.kind in ("hang", "syncer-hang"):
            slot.child.signal(signal.SIGSTOP)
            slot.resume_at = now + event.down_s
        # A network fault lasts until ``_check`` heals it (not on the relay's own clock): the
        # heal record is stamped before the link works again, so the tape never shows the
        # learner back before its fault ended.
        elif event.kind == "partition":
            self.relays[event.target].partition(math.inf)
            slot.heal_at = now + event.down_s
        elif event.kind == "delay":
            self.relays[event.target].delay(math.inf, event.latency_s)
            slot.heal_at = now + event.down_s
        elif event.kind == "drop":
            self.relays[event.target].drop()
        elif event.kind == "lose-replies":
            self.relays[event.target].lose_replies(event.probability, seed=int(event.t * 1000))
            slot.heal_at = now + event.down_s
        elif event.kind == "disk-full":  # the syncer fails, exits, is restarted: see _check
            self.disk.fill()
            slot.heal_at = now + event.down_s

    def _check(self, slot: ProcessSlot, now: float) -> None:
        child = slot.child
        if slot.heal_at is not None and now >= slot.heal_at:
            slot.heal_at = None
            t = time.time()  # stamped before the fault ends: nothing of the learner's precedes it
            if is_syncer(slot.name):  # (a full disk)
                self.disk.free()
            else:
                self.relays[slot.name].heal()
                self.relays[slot.name].lose_replies(0.0)
            self.tape({"event": "heal", "t": t, "target": slot.name})
        if slot.resume_at is not None and now >= slot.resume_at:
            slot.resume_at = None
            t = time.time()
            child.signal(signal.SIGCONT)
            self.tape({"event": "resume", "t": t, "target": slot.name})
        if child is not None and not child.running and slot.restart_at is None:
            code = child.poll()
            slot.exit_codes.append(code)
            child.close_log()
            if code == 0 and not is_syncer(slot.name):
                slot.finished = True
                slot.child = None
                return
            if not slot.expected_death:
                self.tape(
                    {"event": "crash", "t": time.time(), "target": slot.name, "exit_code": code}
                )
                if slot.heal_at is not None and is_syncer(slot.name):
                    slot.planned_deaths += 1  # its disk is full on purpose: it could not commit
            slot.restart_at = now + (0.0 if is_syncer(slot.name) else self.restart_delay_s)
        if slot.restart_at is not None and now >= slot.restart_at:
            slot.restart_at = None
            slot.expected_death = False
            slot.restarts += 1
            slot.child, warm = self._start(slot)
            self.tape({"event": "restart", "t": time.time(), "target": slot.name, "warm": warm})
            if slot.name in self.group:
                self._group_down = False

    # ------------------------------------------------------------------------ spares
    def _start(self, slot: ProcessSlot) -> tuple[Child, bool]:
        """A process for ``slot``: a warm spare if one is ready (learners only), else a fresh
        one."""
        if not is_syncer(slot.name) and slot.env is None:  # (a spare takes no environment)
            while self._spares:
                spare = self._spares.pop(0)
                try:
                    spare.assign(slot.name, slot.argv, slot.log)
                except RuntimeError:  # it died while waiting: use the next one
                    spare.close_log()
                    continue
                self._fill_spares()
                return spare, True
            self._fill_spares()
        return Child(slot.name, slot.argv, slot.log, env=slot.env), False

    def _fill_spares(self) -> None:
        if self.chaos_started is None or self._spare_log is None:
            return
        while len(self._spares) < self.spares_wanted:
            self._spares.append(Child.spare(self._spare_log))

    def _stop_spares(self) -> None:
        for spare in self._spares:
            spare.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                spare.proc.wait(5)
            spare.close_log()
        self._spares = []

    # ------------------------------------------------------------------------ shutdown
    def stop(self, names: list[str], timeout: float) -> dict[str, int | None]:
        """Stop the named processes (resume hung ones first); name -> exit code of the clean
        stop, 0 if it had finished before, None if it was down when asked to stop."""
        from diloco.runtime.procs import stop_all

        live = []
        for name in names:
            slot = self.slots[name]
            slot.restart_at = None
            slot.resume_at = None
            if slot.child is not None and slot.child.running:
                live.append(slot.child)
        for c in live:
            c.signal(signal.SIGCONT)
        codes = stop_all(live, timeout=timeout)
        out = {}
        for name in names:
            slot = self.slots[name]
            if name in codes:
                slot.exit_codes.append(codes[name])
                out[name] = codes[name]
            elif slot.finished:
                out[name] = 0
            else:
                out[name] = None  # down (failed or waiting for its restart) when the run ended
            if slot.child is not None and slot.child.running is False:
                slot.child.close_log()
        return out

    def kill_everything(self) -> None:
        self._stop_spares()
        for slot in self.slots.values():
            if slot.child is not None and slot.child.running:
                slot.child.signal(signal.SIGCONT)
                slot.child.kill()

    def close(self) -> None:
        """Release what the supervisor holds besides its children: the idle spares."""
        self._stop_spares()

"""Where a syncer's start went, phase by phase: the line it logs once it can serve, so that
an operator whose restart is slow knows why (``SyncerServer.restart_times``).

The phases, in the order they run (``PHASES``): ``claim`` (the state directory claimed,
``diloco.syncer.fencing``), ``tape`` (what the event tape records, through its index),
``restore`` (every owned fragment restored, in parallel on ``threads`` threads: its wall
time), ``state`` (the state, the receipt log, the generations and the service built from
what was restored), ``start`` (the ``start`` record: the tape's ``recovered`` records, the
state's hash). Inside ``restore`` each fragment's work is counted in its own parts, summed
over the threads (so they may add up to more than ``restore`` itself): ``read`` (a snapshot
file's bytes into its tensors), ``checksum`` (their SHA-256, on the bytes as they arrive),
``journal`` (the commit journal's segments read and checked, the claim markers appended),
``replay`` (the journal's records made again: ``count`` of them) and ``digest`` (each
restored Θ_p's digest, for the start record). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = ("claim", "tape", "restore", "state", "start")
"""The start's phases, in the order they run (wall seconds each)."""
PARTS = ("read", "checksum", "journal", "replay", "digest")
"""The parts of ``restore``, summed over its threads."""


class RestartTimes:
    """Seconds (and counts) per phase and part of a syncer's start (the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.threads = 1
        """The threads ``restore`` ran on."""
        self.fragments = 0
        """The fragments ``restore`` found on disk (the others start at their initial value)."""
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, name: str, seconds: float, count: int = 0) -> None:
        """Add ``seconds`` (and ``count`` things done) to a phase or part (``ValueError``
        for a name in neither)."""
        if name not in PHASES and name not in PARTS:
            raise ValueError(f"unknown phase {name!r}: one of {', '.join(PHASES + PARTS)}")
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds
            self._counts[name] = self._counts.get(name, 0) + count

    @contextmanager
    def timing(self, name: str, count: int = 0) -> Iterator[None]:
        """Time the block into ``name`` (also when it raises)."""
        started = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - started, count)

    def seconds(self, name: str) -> float:
        with self._lock:
            return self._seconds.get(name, 0.0)

    def count(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def summary(self) -> dict:
        """``{"total_s", "threads", "fragments", "replayed", name + "_s" for every phase
        and part}``: what the benchmark shows and the log line says."""
        with self._lock:
            out = {f"{name}_s": self._seconds.get(name, 0.0) for name in PHASES + PARTS}
            out["total_s"] = sum(self._seconds.get(name, 0.0) for name in PHASES)
            out["replayed"] = self._counts.get("replay", 0)
        out["threads"], out["fragments"] = self.threads, self.fragments
        return out

    def line(self) -> str:
        """One log line: the total, each phase, and the parts of ``restore``.

        >>> t = RestartTimes()
        >>> t.add("restore", 2.0); t.add("read", 1.5); t.add("replay", 2.1, count=3)
        >>> t.threads, t.fragments = 2, 24
        >>> t.line()  # doctest: +NORMALIZE_WHITESPACE
        'started in 2.00 s: claim 0.00 s, tape 0.00 s, restore 2.00 s, state 0.00 s,
        start 0.00 s; restore of 24 fragments on 2 threads (thread seconds): read 1.50 s,
        checksum 0.00 s, journal 0.00 s, replay 2.10 s (3 records), digest 0.00 s'
        """
        s = self.summary()
        phases = ", ".join(f"{name} {s[name + '_s']:.2f} s" for name in PHASES)
        parts = ", ".join(
            f"{name} {s[name + '_s']:.2f} s"
            + (f" ({s['replayed']} records)" if name == "replay" else "")
            for name in PARTS
        )
        return (
            f"started in {s['total_s']:.2f} s: {phases}; restore of {s['fragments']} "
            f"fragments on {s['threads']} threads (thread seconds): {parts}"
        )

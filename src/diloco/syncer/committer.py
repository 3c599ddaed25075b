"""The syncer's committer: its clock, closing rounds, persisting and broadcasting commits,
and what happens when it cannot (a part ``diloco.syncer.service.SyncerService`` holds, its
``committer``).

One committer thread runs the syncer's clock (opens rounds and queues their requests),
closes rounds, merges them outside the lock, makes each commit durable (its record in the
commit journal, ``diloco.syncer.journal``; the whole fragment for its first commit; full
snapshots follow in the background, ``diloco.syncer.snapshots``), appends it to the tape and
only then hands the new fragment to every subscriber.

**When the committer fails.** A commit it cannot persist (disk full, I/O error: an
``OSError`` from the store or the tape) is retried ``PERSIST_ATTEMPTS`` times over about
``PERSIST_RETRY_S`` seconds; then the syncer has *failed*: ``failure`` says why, every RPC is
answered ``UNAVAILABLE``, ``Status`` reports it, subscriptions end and ``on_failure`` is called
(the syncer process exits non-zero, so whatever supervises it restarts it from its state
directory). Nothing it answered after the last persisted commit can be lost: an upload it
accepted and did not commit is returned to its learner's progress at rejoin, because the
restarted syncer reports the versions on disk. A syncer never stays up unable to commit.
A commit the store refuses because another syncer has claimed the state directory
(``diloco.syncer.fencing.Superseded``) fails the syncer at once, without retries: it must
never write there again.

**What learners hold.** For every fragment the committer keeps the wire image ``W_p``: the
value every learner holding version v holds, bit for bit. A commit sends ``d = Θ_p − W_p``
in the down codec and moves ``W_p`` by the decoded ``d̂`` (the rounding stays in ``Θ_p − W_p``
and goes out with the next delta); a learner applies the same ``W + d̂``. ``W_p`` is persisted
with the commit, so a restarted syncer goes on sending deltas its learners can apply. With
``down_feedback`` off the rounding is dropped instead: Θ_p takes the value ``W_p`` before the
commit is persisted, so Θ_p and ``W_p`` are equal at every persisted version (in memory, from
the outer step until its delta is encoded, moments later, Θ_p is the unrounded value; the
norm guard's ‖Θ_p‖ is taken anew after the change).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from diloco.algorithm.merge_sizes import WHOLE_SPAN_VALUES
from diloco.runtime import clock
from diloco.runtime.buffers import BufferPool
from diloco.runtime.watchdog import Watchdog
from diloco.syncer.broadcast import RECENT_VERSIONS, Keyframe, Subscriber
from diloco.syncer.receipt_log import ReceiptLog
from diloco.syncer.replay import down_step
from diloco.syncer.snapshots import Snapshots
from diloco.syncer.stage_times import StageTimes
from diloco.syncer.state import Closing, Commit, RoundRequest, SyncerState, fragment_digest
from diloco.syncer.store import EventTape, FragmentStore, SyncFailed
from diloco.syncer.tape_index import TapeIndex, dropped_in

log = logging.getLogger(__name__)

SPAN_BUFFERS = 8
"""Span buffers the committer keeps for its merges (``Committer.spans``): one per upload of a
round of up to 8 learners; a larger round's others are new for each tensor. At most 8 × 32
MB (``merge_sizes.WHOLE_SPAN_VALUES``), 4 MB each for 1024 × 1024 matrices."""

MAX_REASON_CHARS = 500
"""Refusal messages are cut to this length (they may quote what a client sent)."""

PERSIST_ATTEMPTS = 5
"""Tries of a commit's write (store, then tape) before the syncer gives up and fails."""
PERSIST_RETRY_S = 0.2
"""Pause before the second try; it doubles before each later one (0.2 + 0.4 + 0.8 + 1.6 s)."""
COMMIT_DEADLINE_S = 120.0
"""A commit still being written after this long (a disk that hangs instead of failing) fails
the syncer, like a write error does: it never stays up without committing."""
STOP_WAIT_S = 10.0
"""How long ``stop`` waits for the committer to finish the commit it is writing."""


def retrying(write: Callable[[], None]) -> None:
    """``write()``, tried again after an ``OSError`` (``PERSIST_ATTEMPTS`` tries, pauses from
    ``PERSIST_RETRY_S`` doubling); the last error is raised. Any other error (``Superseded``)
    is raised at once, and so is ``SyncFailed``: a failed fsync is not retried, since a later
    one may report a success for data never written (``diloco.syncer.store.SyncFailed``).

    What a retry of each write means: the store's ``replace_atomically`` writes a fresh
    temporary file from scratch each time (the failed one is removed), so its fsync covers
    every byte it renames; the receipt log truncates a failed line away and writes it again
    from scratch, re-dirtying every page the failed write touched (a truncate it cannot make
    is ``SyncFailed``); the tape cannot take a line back, so its failed fsync is final."""
    pause = PERSIST_RETRY_S
    for attempt in range(PERSIST_ATTEMPTS):
        try:
            return write()
        except SyncFailed:
            raise
        except OSError as exc:
            if attempt + 1 == PERSIST_ATTEMPTS:
                raise
            log.warning("could not persist a commit (%s); trying again in %.1f s", exc, pause)
            time.sleep(pause)
            pause *= 2


class Committer:
    """The committer thread and what it owns: the wire images ``W_p`` and each fragment's
    latest keyframe, the recent versions' contributors, the store, the receipt log, the tape
    and its index, the time each stage of the commits takes (``stage_times``), and whether
    the syncer stops or has failed (see the module docstring).

    The service shares its lock (every change to the state happens under it), its watchdog
    and a view of its subscriptions; it tells the committer when something may close a
    round (``wake``) and asks it what a new subscription lacks (``offer_latest``)."""

    def __init__(
        self,
        state: SyncerState,
        lock: threading.Lock,
        *,
        store: FragmentStore | None,
        tape: EventTape | None,
        receipt_log: ReceiptLog | None,
        tape_index: TapeIndex | None,
        wire: dict[int, torch.Tensor] | None,
        subscribers: Callable[[], list[Subscriber]],
        watchdog: Watchdog,
        on_failure: Callable[[BaseException], None] | None,
    ) -> None:
        """``wire``: the restored wire image of each fragment (taken, not copied; default:
        a copy of Θ_p).
        ``subscribers()``: the service's subscriptions now (a copy). ``on_failure(exc)``:
        called once, on the committer's thread, when the syncer fails."""
        self.state = state
        self.lock = lock
        self.store = store
        self.tape = tape
        self.receipt_log = receipt_log
        self.tape_index = tape_index
        """The tape's index (``diloco.syncer.tape_index``), kept up to date here."""
        self.subscribers = subscribers
        self.watchdog = watchdog
        self.on_failure = on_failure
        self.failure: BaseException | None = None
        """Why the syncer cannot do its job (None while it can); see the module docstring."""
        self.stage_times = StageTimes()
        """Where the commits' time goes, stage by stage (``diloco.syncer.stage_times``)."""
        self.commit_lock = threading.Lock()
        """Held while a commit is made, persisted and published: by the committer, and by
        ``stop`` for the last commits (never two publishers of one ``W_p``)."""
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._closing: list[int] = []
        """The contributions of each round the committer has closed and not yet published,
        in order (``waiting``)."""
        wire = wire or {}
        self._wire = {p: wire[p] if p in wire else state.params[p].clone() for p in state.served}
        # Latest version of each fragment, its keyframe (W_p), who that version merged.
        self._payloads: dict[int, tuple[int, Keyframe, frozenset[str]]] = {
            p: (state.versions[p], Keyframe(self._wire[p]), frozenset()) for p in state.served
        }
        # Contributors of each fragment's last few versions: a learner catching up after a
        # reconnect must know whether any version it missed merged its own contribution.
        self._recent: dict[int, list[tuple[int, frozenset[str], dict]]] = {}
        self._held_drops: dict[int, dict[str, frozenset[int]]] = {}
        """Per fragment, upload ids a dropped round left out (nothing was broadcast): they go
        out with the fragment's next version, the one their learners would take them as
        merged by."""
        self.buffers = BufferPool(keep=len(state.served) + 3)
        """The merged deltas' and the new wire images' buffers, reused (``runtime.buffers``):
        one wire image per fragment held, a merged delta, the wire image a commit just
        replaced and the span of a tensor the merge decodes beyond
        ``merge_sizes.WHOLE_SPAN_VALUES`` for its norm; no fresh fragment-sized buffer (its
        pages zeroed) per commit."""
        self.spans = BufferPool(keep=SPAN_BUFFERS)
        """The buffers the merge decodes its uploads' tensor spans into (one per upload of
        the tensor being merged, up to ``merge_sizes.WHOLE_SPAN_VALUES`` values each)."""
        self._thread = threading.Thread(target=self._commit_loop, name="committer", daemon=True)
        self.snapshots = (
            Snapshots(
                store,
                state.config.commits_per_snapshot,
                {p: store.replayed.get(p) for p in state.served},
                numel={p: state.layout.fragments[p].numel for p in state.served},
                journal_bytes={p: store.journal.size(p) for p in state.served},
                on_failure=self.fail,
                note=self._note,
                stage_times=self.stage_times,
            )
            if store is not None
            else None
        )
        """The background snapshots (``diloco.syncer.snapshots``; None without a store)."""

    def start(self) -> None:
        """Start the committer thread."""
        self._thread.start()

    def wake(self) -> None:
        """Something may close a round (an upload, a leave, a stream that ended): the
        committer decides again now instead of at its next wake-up."""
        self._wake.set()

    def stopping(self) -> bool:
        """Whether ``stop`` began or the syncer failed: an upload is then refused and the
        streams end."""
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop the committer; then commit what waits for learners that are all gone (the
        rounds ``poll`` closes now), so progress flushed by the last learners is kept. A
        committer still writing a commit after ``STOP_WAIT_S`` (a stalled disk) is left to
        it, and nothing more is committed here; a failed syncer commits nothing more.

        Stopping begins under the lock: an upload admitted before it is in a round when the
        last poll runs; one arriving after it is refused ``UNAVAILABLE`` (``Upload``), never
        answered "accepted" by a syncer that will not commit it."""
        with self.lock:
            self._stopping.set()
        self._wake.set()
        for sub in self.subscribers():
            sub.close()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)
        if self.failure is not None or not self.commit_lock.acquire(timeout=1.0):
            return
        try:
            now = clock.monotonic()
            with self.lock:
                commits, _ = self.state.poll(now, wait_for_finals=False)
            for commit in commits:
                self._publish(commit, now)
        except Exception as exc:  # (the disk failed on the last commits: said, not raised)
            self.fail(exc)
        finally:
            self.commit_lock.release()
            if self.snapshots is not None:  # (the journal holds what a snapshot waited for)
                self.snapshots.close(timeout=STOP_WAIT_S)

    def fail(self, exc: BaseException) -> None:
        """The syncer cannot do its job: refuse everything from now on, end the streams,
        tell ``on_failure`` (once)."""
        with self.lock:
            if self.failure is not None:
                return
            self.failure = exc
        self._stopping.set()
        if self.snapshots is not None:
            self.snapshots.close(timeout=0)
        for sub in self.subscribers():
            sub.close()
        self._note({"event": "failed", "t": clock.wall(), "error": repr(exc)[:300]})
        if self.on_failure is not None:
            self.on_failure(exc)

    def _emit(self, record: dict, sync: bool = False) -> None:
        """Append a record the run needs (a commit's): ``OSError`` when it cannot be written."""
        if self.tape is not None:
            self.tape.append(record, sync=sync)

    def _note(self, record: dict) -> None:
        """Append a record the run can do without (a tick): never raises."""
        if self.tape is not None:
            self.tape.try_append(record)

    # ------------------------------------------------------------------ helpers
    def _commit_loop(self) -> None:
        """The committer thread: the clock's ticks, closing rounds, commits. Any error here
        fails the syncer (``fail``): it never keeps answering without committing."""
        try:
            self._run_clock()
        except Exception as exc:
            log.exception("the syncer's committer failed")
            self.fail(exc)

    def _run_clock(self) -> None:
        wake_at: float | None = None
        while not self._stopping.is_set():
            timeout = 0.25 if wake_at is None else min(0.25, max(0.0, wake_at - clock.monotonic()))
            self._wake.wait(timeout)
            self._wake.clear()
            with self.commit_lock:
                if self._stopping.is_set():
                    return
                t0 = clock.monotonic()
                with self.lock:
                    request, tick_at = self.state.tick(t0)
                    if request is not None:
                        self._ask(request)
                    closed_at = self.stage_times.clock()
                    closing, wake_at = self.state.close_rounds(t0)
                    if closing:
                        self.stage_times.add("guard", self.stage_times.clock() - closed_at)
                    self._closing = [len(r.contributions) + len(r.left_out) for r in closing]
                if tick_at is not None:
                    wake_at = tick_at if wake_at is None else min(wake_at, tick_at)
                while closing:
                    self._commit(closing.pop(0), t0)

    def _commit(self, round_: Closing, t0: float) -> None:
        """Merge, apply, persist and broadcast one closed round. A method of its own: what
        a commit makes (the merged delta, the commit's copies, the round's uploads) is let go
        when it returns, not kept by the clock's loop until its next wake-up."""
        with self.stage_times.timing("merge"):
            # the costly part, while uploads go on
            merged = round_.merge(self.buffers.tensor, self._span_buffer)
        with self.lock, self.stage_times.timing("outer"):
            commit = self.state.apply(round_, merged, t0)
        del merged, round_
        self._publish_in_time(commit, t0)
        with self.lock:
            self._closing.pop(0)

    def _span_buffer(self, n: int) -> torch.Tensor:
        """A buffer for the merge to decode ``n`` values of an upload into: a kept one up to
        ``merge_sizes.WHOLE_SPAN_VALUES`` values, else a fragment-sized one of ``buffers``."""
        pool = self.spans if n <= WHOLE_SPAN_VALUES else self.buffers
        return pool.tensor(n)

    def waiting(self) -> int:
        """Contributions admitted and not yet settled: in open rounds, or in rounds the
        committer has closed and is merging, persisting or broadcasting (not the last
        commits ``stop`` makes). Lock held."""
        open_rounds = sum(len(r.contributions) for r in self.state.rounds.values())
        return open_rounds + sum(self._closing)

    def _publish_in_time(self, commit: Commit, t0: float) -> None:
        """``_publish``, failing the syncer if it takes longer than ``COMMIT_DEADLINE_S``."""
        hung = TimeoutError(f"a commit was still being written after {COMMIT_DEADLINE_S:g} s")
        handle = self.watchdog.arm(clock.monotonic() + COMMIT_DEADLINE_S, lambda: self.fail(hung))
        try:
            self._publish(commit, t0)
        finally:
            self.watchdog.disarm(handle)

    def _ask(self, request: RoundRequest) -> None:
        """Queue the clock's request on the streams of the learners it asks (lock held)."""
        for sub in self.subscribers():
            if not sub.observer and sub.learner_id in request.asked:
                sub.request(request.fragment, request.version)
        self._note(
            {
                "event": "tick",
                "t": clock.wall(),
                "fragment": request.fragment,
                "version": request.version,
                "asked": len(request.asked),
            }
        )

    def _publish(self, commit: Commit, t0: float) -> None:
        """Persist, then record, then broadcast one commit (in that order); a dropped round
        is persisted (its log) and recorded only.

        The broadcast is the delta from the wire image (see the module docstring); the
        committer is the only thread that moves ``W_p``, one commit at a time. Raises
        ``OSError`` when the commit cannot be persisted or recorded (after retries)."""
        p = commit.fragment
        codec = self.state.config.down_codec
        if commit.changed:
            with self.stage_times.timing("encode"):
                delta, wire = down_step(commit.params, self._wire[p], codec, self.buffers.tensor)
            if not self.state.config.down_feedback:  # Θ_p takes the value learners will hold
                with self.lock:  # (``commit.params`` is Θ_p itself: it holds W_p now)
                    self.state.model.take_wire_image(p, wire)
        else:
            delta, wire = b"", self._wire[p]
        with self.stage_times.timing("checksum"):
            digest = fragment_digest(commit.params)  # hashed here, not under the lock
        if self.store is not None:
            journalled = []
            with self.stage_times.timing("persist"):
                retrying(lambda: journalled.append(self._persist(commit, wire, digest)))
            if journalled[-1]:  # (the commit is made: a snapshot may be due)
                self.snapshots.after_commit(commit, wire, journalled[-1])
        logged_at = self.stage_times.clock()
        if self.receipt_log is not None:  # (after the commit is made: a successor re-appends it)
            retrying(lambda: self.receipt_log.append(commit.log))
        record = dict(commit.record)
        record["digest"] = digest
        record["sync_s"] = round(clock.monotonic() - t0, 6)
        record["bytes_delta"] = len(delta)
        retrying(lambda: self._emit(record, sync=True))
        self.stage_times.add("log", self.stage_times.clock() - logged_at)
        with self.lock:  # on disk: resends are answered from it, drops reported
            receipts, now = self.state.receipts, clock.monotonic()
            receipts.settle(commit.log, now)
            for event in receipts.take_events():  # (retention: diloco.syncer.retention)
                log.warning("commit log retention: %s", event)
                self.state.record(event.pop("event"), now, **event)
            complete_from, kept = dict(receipts.complete_from), receipts.kept
        if self.receipt_log is not None:  # (after memory let go: the file holds no less)
            self.receipt_log.compact(complete_from, kept)
        if self.tape_index is not None:
            self.tape_index.note(record, self.tape.end)
            if self.tape_index.due():
                self.save_tape_index()
        dropped = {
            lid: frozenset(u.upload_id for u in parts) for lid, parts in commit.log.excluded.items()
        }
        if not commit.changed:
            held = self._held_drops.setdefault(p, {})
            for lid, ids in dropped.items():
                held[lid] = held.get(lid, frozenset()) | ids
            return
        for lid, ids in self._held_drops.pop(p, {}).items():
            dropped[lid] = dropped.get(lid, frozenset()) | ids
        with self.lock, self.stage_times.timing("broadcast"):
            keyframe = Keyframe(wire)
            self._wire[p] = wire
            contributors = frozenset(commit.record["participants"])
            self._payloads[p] = (commit.version, keyframe, contributors)
            recent = self._recent.setdefault(p, [])
            recent.append((commit.version, contributors, dropped))
            del recent[:-RECENT_VERSIONS]
            for sub in self.subscribers():
                sub.offer(
                    p,
                    commit.version,
                    keyframe=keyframe,
                    delta=delta,
                    delta_codec=codec,
                    contributors=contributors,
                    dropped=dropped,
                )
            self.state.record_sync_time(clock.monotonic() - t0)

    def _persist(self, commit: Commit, wire: torch.Tensor, digest: str) -> int:
        """Make ``commit`` durable: its journal record appended and synced, or, for a
        fragment without a snapshot yet, the whole fragment written (``FragmentStore.save``).
        Returns the bytes journalled (0: written whole). Raises what the store raises."""
        p = commit.fragment
        if commit.inputs is not None and not self.snapshots.first(p):
            return self.store.journal.append(dataclasses.replace(commit.inputs, digest=digest))
        self.store.save(
            p,
            commit.version,
            commit.params,
            commit.momentum,
            wire=wire,
            commits=commit.history,
            merged_tokens=commit.merged_tokens,
        )
        self.snapshots.written_whole(p)
        return 0

    def save_tape_index(self) -> None:
        """Write the tape's index (``diloco.syncer.tape_index``; nothing without a tape),
        keeping the dropped uploads of the commit logs a restart would check."""
        if self.tape_index is None:
            return
        with self.lock:
            logs = [log for history in self.state.closing.history.values() for log in history]
        self.tape_index.save(keep=dropped_in(logs))

    def hash_latest(self) -> None:
        """Compute the digest of every fragment's latest keyframe (kept by the keyframe), so
        that ``offer_latest`` compares a subscription's digests without hashing under the
        lock."""
        with self.lock:
            latest = [keyframe for _, keyframe, _ in self._payloads.values()]
        for keyframe in latest:
            keyframe.digest  # noqa: B018 (computed once, then kept)

    def offer_latest(self, sub: Subscriber, have: list[int], digests: list[str]) -> None:
        """Queue on a new subscription every fragment's latest version its learner does not
        hold (``have``: the versions it holds; ``digests``: the values it holds where it
        knows no version; lock held). A method, not inline in the stream's generator: the
        generator's frame lives as long as the stream and would keep the last keyframe it
        looked at."""
        for p, (version, keyframe, _) in self._payloads.items():
            since = have[p] if p < len(have) else -1
            if since == version:
                continue
            if since < 0 and p < len(digests) and digests[p] == keyframe.digest:
                sub.confirm(p, version)  # it holds exactly this value already
                continue
            contributors, dropped = self._since(p, since)
            sub.offer(p, version, keyframe=keyframe, contributors=contributors, dropped=dropped)

    def _since(self, fragment: int, version: int) -> tuple[frozenset[str], dict]:
        """Everyone merged into ``fragment`` after ``version``, and per learner the upload
        ids those versions left out (as far as the recent history goes; nothing after a
        restart: heartbeat replies then tell learners what was left out)."""
        newer = [(c, d) for v, c, d in self._recent.get(fragment, ()) if v > version]
        dropped: dict[str, frozenset[int]] = {}
        for _, d in newer:
            for lid, ids in d.items():
                dropped[lid] = dropped.get(lid, frozenset()) | ids
        return frozenset().union(*(c for c, _ in newer)), dropped

    def wire_image(self, fragment: int) -> torch.Tensor:
        """``W_p`` itself, not a copy (never changed in place: each version is a new
        tensor): for readers that only look, e.g. a memory probe."""
        with self.lock:
            return self._wire[fragment]

    def wire(self, fragment: int) -> torch.Tensor:
        """A copy of ``W_p``: the value every learner holding the current version holds."""
        with self.lock:
            return self._wire[fragment].clone()

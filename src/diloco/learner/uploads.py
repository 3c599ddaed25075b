"""A learner link's upload queue: what waits to be sent, what is in flight, what goes again.

Per fragment at most one new job waits (a newer one replaces it, and the replaced one is
answered ``failed``); fragments take turns, oldest waiting first. Every upload that got no
answer waits to be sent again as it was (``MAX_RESENDS``, same upload id) before any new
job, so an upload the syncer accepted but whose reply was lost is merged once. The queue only
keeps order and counts; the link's sender thread sends and answers. Thread-safe.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from diloco.runtime.clock import monotonic


@dataclass(frozen=True)
class EncodedUpload:
    """An upload as it goes on the wire."""

    payload: bytes
    """The encoded delta sent."""
    tokens: int
    """The tokens it claims."""
    meant: bytes
    """What the learner meant to send (the payload unless a fault damaged it): its residual
    is measured against this, so damage is never fed back into the learner's progress."""
    codec: str
    """The codec of ``payload`` and ``meant``."""


@dataclass
class UploadJob:
    """One outer gradient to send: fragment ``fragment``'s ``A_p − θ_p``."""

    fragment: int
    base_version: int
    steps: int
    tokens: int
    delta: torch.Tensor
    step_time_s: float
    local_step: int = 0
    """The learner's step when it queued this delta (for its delivery log)."""
    job_id: int = 0
    final: bool = False
    """The learner is stopping: the syncer merges this without waiting for its clock."""
    upload_id: int = 0
    """Names this delta on the wire across resends (given by the link when first sent)."""
    attempts: int = 0
    """Times it was sent without an answer (``MAX_RESENDS`` bounds the resends)."""
    on_the_wire: bool = False
    """It left at least once (a call was started with it): the syncer may have it."""
    resend_at: float = 0.0
    """The queue's ``clock()`` reading before which it is not sent again."""
    first_send: EncodedUpload | None = None
    """The bytes its first send carried, in their codec: every resend carries them again as
    they were, whatever codec the syncer asks for now (a syncer restarted with another
    ``--up-codec`` answers the resend from its commit log, and the ``sent`` its learner
    records must be what the first send, perhaps merged, carried)."""


MAX_RESENDS = 20
"""An upload that got no answer (connection lost, timeout, the syncer's stream cap) is sent
again as it was, with its upload id, until it is answered, at most this many times (about
80 s of pauses) before it is answered ``failed``: if the syncer had accepted it and only its
reply was lost, it answers the resend with its first verdict, so the delta is merged once
(folding it into the next delta would merge it twice, and so would giving up after a few
lost replies in a row)."""
MAX_WAITING_RESENDS = 64
"""Unanswered uploads a link keeps to send again; beyond it the oldest is answered ``failed``."""
RESEND_PAUSE_S = 0.5
"""The n-th resend waits ``min(n × RESEND_PAUSE_S, MAX_RESEND_PAUSE_S)`` (time for the link
to reconnect)."""
MAX_RESEND_PAUSE_S = 5.0


@dataclass(frozen=True)
class UploadResult:
    """The answer to one upload: ``outcome`` is ``accepted`` (``admitted`` is the fragment's
    version at admission, ``sent`` the delta as the syncer decoded it), ``guard`` (the norm
    guard refused it), ``stale`` (too stale, resync), ``refused`` (another refusal),
    ``unknown`` (a resend whose earlier send the syncer may have merged, by a commit whose
    log it no longer keeps: neither merged nor sent again) or ``failed`` (no answer:
    connection lost, timeout). ``syncer_id``: the syncer instance that
    answered (its answer may reach the learner after the rejoin to a successor)."""

    outcome: str
    admitted: int = -1
    sent: torch.Tensor | None = None
    syncer_id: str = ""


class UploadQueue:
    """Jobs waiting by fragment, unanswered ones waiting to go again, the one in flight."""

    def __init__(
        self, encoded_size: Callable[[UploadJob], int], *, clock: Callable[[], float] = monotonic
    ) -> None:
        """``encoded_size(job)``: the payload bytes of a job (for the backlog); ``clock``: the
        ``now`` of resend pauses."""
        self.encoded_size, self.clock = encoded_size, clock
        self.cond = threading.Condition()
        self._jobs: dict[int, UploadJob] = {}
        self._resends: list[UploadJob] = []
        # When each fragment first queued a job not yet sent: a job withdrawn and queued again
        # keeps its turn (oldest waiting fragment first), so a fragment asked again and again
        # while its upload waits is not sent to the back of the queue each time.
        self._waiting_since: dict[int, int] = {}
        self._queued_count = 0
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._held = 0
        self._upload_ids = itertools.count(secrets.randbits(40) << 20)

    def put(self, job: UploadJob) -> UploadJob | None:
        """Queue ``job``; returns the job of the same fragment it replaced (if any)."""
        with self.cond:
            replaced = self._jobs.pop(job.fragment, None)
            self._jobs[job.fragment] = job
            self._queued_count += 1
            self._waiting_since.setdefault(job.fragment, self._queued_count)
            self.cond.notify()
        return replaced

    def withdraw(self, fragment: int) -> UploadJob | None:
        """Take back the waiting (never sent) job of ``fragment``, if any."""
        with self.cond:
            return self._jobs.pop(fragment, None)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Send nothing while inside (a flush queues all its finals first, so the first one
        sent names them all)."""
        with self.cond:
            self._held += 1
        try:
            yield
        finally:
            with self.cond:
                self._held -= 1
                self.cond.notify_all()

    def final_fragments(self) -> list[int]:
        """The fragments of the final jobs waiting to be sent or to go again: what a final
        upload names (the syncer waits for them when nobody is live)."""
        with self.cond:
            return sorted({j.fragment for j in (*self._jobs.values(), *self._resends) if j.final})

    def queued_ids(self) -> set[int]:
        """Job ids waiting to be sent for the first time."""
        with self.cond:
            return {job.job_id for job in self._jobs.values()}

    def backlog_bytes(self) -> int:
        """Payload bytes waiting, waiting to go again, or in flight."""
        with self.cond:
            waiting = [*self._jobs.values(), *self._resends]
            return sum(self.encoded_size(job) for job in waiting) + self._in_flight_bytes

    def busy(self) -> bool:
        """Anything waiting, waiting to go again, or in flight (call with ``cond`` held)."""
        return bool(self._jobs or self._resends or self._in_flight)

    def take(self, ready: Callable[[], bool], stopping: threading.Event) -> UploadJob | None:
        """The next job to send, once ``ready()`` (connected): an unanswered one whose pause
        is over first, else the oldest waiting fragment's. ``None`` when ``stopping`` is set
        (or nothing is due yet: ask again). The job is then in flight until ``done``; it has
        its upload id."""
        with self.cond:
            while not stopping.is_set() and (
                not (self._jobs or self._resends) or self._held or not ready()
            ):
                self.cond.wait(0.2)
            if stopping.is_set():
                return None
            now = self.clock()
            due = [j for j in self._resends if j.resend_at <= now]
            if due:
                job = min(due, key=lambda j: j.resend_at)
                # by identity: a job's fields hold tensors, which == cannot compare
                self._resends = [j for j in self._resends if j is not job]
            elif self._jobs:
                fragment = min(self._jobs, key=lambda p: self._waiting_since.get(p, 0))
                job = self._jobs.pop(fragment)
                self._waiting_since.pop(fragment, None)
            else:
                self.cond.wait(0.05)
                return None
            self._in_flight += 1
            self._in_flight_bytes += self.encoded_size(job)
            job.upload_id = job.upload_id or next(self._upload_ids)
            return job

    def resume(self, job: UploadJob) -> None:
        """Queue a job whose answer is unknown (a delta a restored learner's checkpoint holds
        without an answer) to go as a resend, before new jobs, with its upload id: the
        syncer answers it with its first verdict if it accepted it before."""
        with self.cond:
            job.resend_at = 0.0
            self._resends.append(job)
            self.cond.notify()

    @staticmethod
    def given_up(job: UploadJob, stopping: threading.Event) -> UploadResult:
        """The answer to an unanswered job that is not sent again (its ``MAX_RESENDS``
        spent, or displaced by newer ones): ``unknown`` once it has been on the wire (the
        syncer may have merged it: folding its progress into a new upload could merge it
        twice), ``failed`` (its progress goes out again) when it never left or the link is
        stopping (the flush answers what it can; the close report lists what was not)."""
        if job.on_the_wire and not stopping.is_set():
            return UploadResult("unknown")
        return UploadResult("failed")

    def send_again(
        self, job: UploadJob, stopping: threading.Event
    ) -> tuple[bool, UploadJob | None]:
        """Queue an unanswered job to go again (after a pause that grows with ``attempts``):
        ``(True, oldest)`` where ``oldest`` is the unanswered job it displaced when
        ``MAX_WAITING_RESENDS`` already wait (answer that one ``failed``), or ``(False,
        None)`` when it had its ``MAX_RESENDS`` or the link is stopping (answer it
        ``failed``)."""
        if job.attempts >= MAX_RESENDS or stopping.is_set() or not job.upload_id:
            return False, None
        job.attempts += 1
        job.resend_at = self.clock() + min(RESEND_PAUSE_S * job.attempts, MAX_RESEND_PAUSE_S)
        with self.cond:
            self._resends.append(job)
            oldest = self._resends.pop(0) if len(self._resends) > MAX_WAITING_RESENDS else None
            self.cond.notify()
        return True, oldest

    def done(self, job: UploadJob) -> None:
        """``job`` is no longer in flight (answered, or queued to go again)."""
        with self.cond:
            self._in_flight -= 1
            self._in_flight_bytes -= self.encoded_size(job)
            self.cond.notify_all()

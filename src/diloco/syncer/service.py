"""The syncer's gRPC service: decode, validate, call the state machine, persist, broadcast.

Threads: gRPC's pool runs the RPC handlers (each ``Subscribe`` stream holds one thread for
its lifetime, so the pool is sized from ``max_learners``); one **committer** thread runs the
syncer's clock (opens rounds and queues their requests), closes rounds, writes each commit
to disk, appends it to the tape and only then hands the new fragment to every subscriber.
All state changes happen under one lock, and nothing slow (decoding, encoding, disk,
network) happens while it is held, except the merge itself.

The service holds its **committer** (``diloco.syncer.committer``, ``service.committer``): the
thread, the wire images and the persistence are the committer's; it says what happens when a
commit cannot be persisted and what learners hold. The service owns the RPC handlers, the
subscriptions and the caps on open streams.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import torch

from diloco.algorithm import codecs
from diloco.algorithm.encoded_delta import EncodedDelta
from diloco.runtime import clock
from diloco.runtime.watchdog import Watchdog
from diloco.syncer.broadcast import Subscriber, chunk_payload
from diloco.syncer.committer import MAX_REASON_CHARS, Committer
from diloco.syncer.fencing import Superseded
from diloco.syncer.generations import GenerationFile
from diloco.syncer.held_uploads import held_uploads
from diloco.syncer.limits import (
    DEFAULT_MAX_LEARNERS,
    FIRST_CHUNK_S,
    SHORT_CALL_THREADS,
    Caller,
    LimitExceeded,
    StreamLimits,
    StreamSlot,
    stream_limits,
)
from diloco.syncer.receipt_log import ReceiptLog
from diloco.syncer.state import Refused, SyncerState
from diloco.syncer.store import (
    EventTape,
    FragmentStore,
    state_hash,
)
from diloco.syncer.tape_index import TapeIndex
from diloco.syncer.upload import cancelled_upload_reason, check_unsettled, receive_upload
from diloco.wire import auth
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.protocol import NOT_ADMITTED_KEY, syncer_upload_deadline_s

log = logging.getLogger(__name__)


STOPPING_REASON = "the syncer is stopping: send this upload again to its successor"
"""Why an upload arriving once ``stop`` began is refused ``UNAVAILABLE`` (a learner's link
takes that as no answer and sends the upload again, with its id, once it has rejoined)."""


def pool_threads(limits: StreamLimits) -> int:
    """Threads the gRPC pool needs: every stream cap plus ``SHORT_CALL_THREADS``."""
    return sum(limits.caps.values()) + SHORT_CALL_THREADS


class SyncerService(pb_grpc.SyncerServicer):
    """The RPC handlers; its ``committer`` runs the committer thread (``SyncerServer`` runs it)."""

    def __init__(
        self,
        state: SyncerState,
        *,
        store: FragmentStore | None,
        tape: EventTape | None,
        receipt_log: ReceiptLog | None = None,
        generation_file: GenerationFile | None = None,
        tape_index: TapeIndex | None = None,
        allowed_learners: frozenset[str] | None = None,
        wire: dict[int, torch.Tensor] | None = None,
        secret: str | None = None,
        learner_tokens: bool = False,
        limits: StreamLimits | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        lineage: str = "",
    ) -> None:
        """``wire``: the restored wire image of each fragment (default: Θ_p). ``secret``: the
        shared token (the interceptor checks it; the handlers check whose id a call may use),
        ``learner_tokens``: the shared token may not act as a learner (``diloco.wire.auth``).
        ``generation_file``: where the learners' highest generations are kept
        (``diloco.syncer.generations``). ``limits``: caps on open streams
        (``diloco.syncer.limits``; default: ``DEFAULT_MAX_LEARNERS`` learners').
        ``on_failure(exc)``: called once, on the committer's thread, when the syncer fails
        (see the module docstring). ``lineage``: the lineage of its versions, told to
        learners at join (``diloco.syncer.lineage``)."""
        self.state = state
        self.lineage = lineage
        self.allowed_learners = allowed_learners
        self.secret = secret
        self.learner_tokens = learner_tokens
        self.limits = limits or stream_limits(DEFAULT_MAX_LEARNERS)
        self.watchdog = Watchdog()
        self.first_chunk_s = FIRST_CHUNK_S
        """Seconds an upload may wait for its first chunk (``limits.FIRST_CHUNK_S``)."""
        self.generation_file = generation_file
        """Where the learners' highest generations are kept (None: in memory only)."""
        self._arriving: dict[tuple[str, int], int] = {}
        """(learner id, upload id) of the uploads received and not yet answered, counted: a
        refused copy of one of them is not said to be never admitted (``_fate_metadata``)."""
        self.lock = threading.Lock()
        self.started_at = clock.monotonic()
        self._subscribers: dict[Subscriber, Callable[[], None]] = {}
        """Every subscription whose handler runs, and how to end it (give its place back,
        cancel its call): a newer subscription of the same learner does (``_replace``)."""
        self.committer = Committer(
            state,
            self.lock,
            store=store,
            tape=tape,
            receipt_log=receipt_log,
            tape_index=tape_index,
            wire=wire,
            subscribers=lambda: list(self._subscribers),
            watchdog=self.watchdog,
            on_failure=on_failure,
        )
        """The committer thread and the commits' persistence (``diloco.syncer.committer``)."""

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the committer (the server starts serving RPCs)."""
        self.committer.start()

    def stop(self) -> None:
        """Stop: refuse uploads, end the streams, commit what waits (``Committer.stop``)."""
        self.committer.stop()
        self.watchdog.close()

    @property
    def failure(self) -> BaseException | None:
        """Why the syncer cannot do its job (``Committer.failure``; None while it can)."""
        return self.committer.failure

    def check_alive(self, context: grpc.ServicerContext) -> None:
        """Answer ``UNAVAILABLE`` (and return nothing) once the syncer has failed."""
        if self.failure is not None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the syncer failed and is restarting: {self.failure!r}"[:MAX_REASON_CHARS],
            )

    def _refuse(self, context: grpc.ServicerContext, learner_id: str, err: Refused, rpc: str):
        """Tape the refusal, answer its status and ``Refused.metadata``; never returns."""
        with self.lock:
            self.state.note_refusal(learner_id, err.code, err.message, clock.monotonic(), rpc=rpc)
        if err.metadata:
            context.set_trailing_metadata(err.metadata)
        context.abort(getattr(grpc.StatusCode, err.code), err.message[:MAX_REASON_CHARS])

    def refuse_unauthenticated(self, method: str, reason: str) -> None:
        """Called by the token interceptor for a call it turned away (no state is touched)."""
        with self.lock:
            self.state.note_refusal("", "UNAUTHENTICATED", reason, clock.monotonic(), rpc=method)

    def check_caller(self, context: grpc.ServicerContext, learner_id: str) -> None:
        """Raise ``Refused("PERMISSION_DENIED")`` unless the call's token may act as
        ``learner_id``: a learner token only as its own id, the shared token as any id unless
        the syncer requires learner tokens."""
        who = auth.caller_identity(context.invocation_metadata(), self.secret)
        if who == auth.SHARED and not self.learner_tokens:
            return
        if who == auth.SHARED:
            raise Refused(
                "PERMISSION_DENIED",
                "this syncer requires each learner's own token (diloco learner-token ID)",
            )
        if who != learner_id:
            raise Refused(
                "PERMISSION_DENIED",
                f"the token is learner {who!r}'s; it cannot act as {learner_id[:64]!r}",
            )

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        """Whom the stream limits count a call against: the learner id of its own token,
        else its connection and address (``diloco.syncer.limits.Caller``)."""
        who = auth.caller_identity(context.invocation_metadata(), self.secret)
        return Caller(context.peer(), learner=who or None)

    # --------------------------------------------------------------------- RPCs
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self.check_alive(context)
        tensors = [(t.name, tuple(t.shape), t.dtype) for t in request.tensors]
        try:
            self.check_caller(context, request.learner_id)
            if (
                self.allowed_learners is not None
                and request.learner_id not in self.allowed_learners
            ):
                raise Refused(
                    "PERMISSION_DENIED",
                    f"learner id {request.learner_id[:64]!r} is not on the syncer's allow-list",
                )
            fragments = self.state.layout.num_fragments
            unsettled = check_unsettled(request.unsettled_from, fragments, request.num_fragments)
            with self.lock:
                now = clock.monotonic()
                info = self.state.join(
                    request.learner_id,
                    tensors=tensors,
                    layout_hash=request.layout_hash,
                    num_fragments=request.num_fragments,
                    observer=request.observer,
                    now=now,
                    tokens_per_step=request.tokens_per_step,
                    generation=request.generation,
                )
                self.state.receipts.pin(request.learner_id, unsettled, self.state.versions, now)
                versions = list(self.state.versions)
                held = held_uploads(self.state.receipts, request.learner_id)
                logged_from = self.state.logged_from()
                unwritten = self.state.roster.generations.changes > self.generation_file_holds()
            if unwritten:  # on disk before this process is told it holds the id
                self._write_generations(context)
        except Refused as err:
            return self._refuse(context, request.learner_id, err, "Join")
        cfg = self.state.config
        return pb.JoinReply(
            session=info.session,
            versions=versions,
            lease_s=cfg.lease_s,
            heartbeat_s=cfg.heartbeat_interval_s,
            up_codec=cfg.up_codec,
            down_codec=cfg.down_codec,
            fragments=self.state.served,
            syncer_id=self.state.syncer_id,
            shard=self.state.shard[0],
            num_shards=self.state.shard[1],
            schedule=cfg.schedule,
            sync_every=self.state.sync_every(),  # (an H schedule: the H it runs at now)
            **held,  # committed_uploads, fates
            logged_from=logged_from,
            lineage=self.lineage,
        )

    def generation_file_holds(self) -> int:
        """The ``Generations.changes`` the state directory's file holds (all of them without
        a state directory: nothing to write)."""
        if self.generation_file is None:
            return self.state.roster.generations.changes
        return self.generation_file.written

    def _write_generations(self, context: grpc.ServicerContext) -> None:
        """Persist the learners' highest generations (``diloco.syncer.generations``); a
        write that fails answers the join ``UNAVAILABLE`` (it is tried again at the next
        join), a superseded syncer fails."""

        def snapshot():
            with self.lock:
                return self.state.roster.generations.snapshot()

        try:
            self.generation_file.write(snapshot)
        except Superseded as exc:
            self.committer.fail(exc)
            self.check_alive(context)
        except OSError as exc:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not persist the learner generations: {exc}"[:MAX_REASON_CHARS],
            )

    def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FragmentChunk]:
        self.check_alive(context)
        have = list(request.have_versions)
        digests = list(request.have_digests)
        try:
            P = self.state.layout.num_fragments
            if len(have) > P or len(digests) > P:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"have_versions lists {len(have)} and have_digests {len(digests)} "
                    f"fragments, the model has {P}",
                )
            if any(len(d) > 64 for d in digests):
                raise Refused("INVALID_ARGUMENT", "a have_digests entry is over 64 characters")
            self.check_caller(context, request.learner_id)
            with self.lock:
                info = self.state.roster.session_of(request.learner_id, request.session)
            yield from self._stream(context, info, self._caller(context), have, digests)
        except LimitExceeded as exc:
            err = Refused("RESOURCE_EXHAUSTED", str(exc))
            return self._refuse(context, request.learner_id, err, "Subscribe")
        except Refused as err:
            return self._refuse(context, request.learner_id, err, "Subscribe")

    def _stream(self, context, info, caller: Caller, have: list[int], digests: list[str]):
        """One subscription's life: it takes the place of the learner's older ones
        (``_replace``; ``LimitExceeded`` over a cap), sends what the learner lacks, then
        requests and new versions until the stream ends."""
        sub = Subscriber(info.learner_id, info.session, info.observer, held=dict(enumerate(have)))
        if any(digests):  # hash the values to compare with here, not under the lock
            self.committer.hash_latest()
        with self.lock:
            slot = self._replace(sub, caller, context)
            self.committer.offer_latest(sub, have, digests)
        context.add_callback(sub.close)
        try:
            while context.is_active() and not self.committer.stopping() and not sub.closed:
                requests, items = sub.take(timeout=0.5)
                for p, version in requests:
                    yield pb.FragmentChunk(
                        fragment=p, version=version, request=True, chunk_index=0, num_chunks=1
                    )
                for item in items:
                    pieces = chunk_payload(item.payload)
                    numel = self.state.layout.fragments[item.fragment].numel
                    for i, piece in enumerate(pieces):
                        yield pb.FragmentChunk(
                            fragment=item.fragment,
                            version=item.version,
                            codec=item.codec,
                            numel=numel,
                            chunk_index=i,
                            num_chunks=len(pieces),
                            data=bytes(piece),
                            contributors=sorted(item.contributors) if i == 0 else (),
                            dropped_uploads=sorted(item.dropped) if i == 0 else (),
                            is_delta=item.is_delta,
                            base_version=max(item.base_version, 0),
                            unchanged=item.unchanged,
                        )
                    with self.lock:
                        info.bytes_down += len(item.payload)
                        self.state.bytes_down += len(item.payload)
        finally:
            slot.release()
            with self.lock:
                self._subscribers.pop(sub, None)
                if not any(s.session == sub.session for s in self._subscribers):
                    self.state.leave(
                        sub.learner_id, sub.session, now=clock.monotonic(), reason="stream closed"
                    )
            self.committer.wake()

    def _replace(self, sub: Subscriber, caller: Caller, context) -> StreamSlot:
        """Register ``sub`` in the place of its learner's older subscriptions (lock held).

        Each older one is closed, its place under the stream caps given back at once and its
        call cancelled: a handler blocked in a send on a dead connection (a vanished VM,
        before keepalive notices) ends now instead of holding the learner's only place. Then
        ``sub`` takes its own place (``LimitExceeded`` over a cap: nothing registered)."""
        for older in [s for s in self._subscribers if s.learner_id == sub.learner_id]:
            older.close()
            self._subscribers[older]()
        slot = self.limits.take("subscribe", caller)

        def end() -> None:
            slot.release()
            context.cancel()

        self._subscribers[sub] = end
        return slot

    def Upload(
        self, request_iterator: Iterator[pb.UploadChunk], context: grpc.ServicerContext
    ) -> pb.UploadReply:
        self.check_alive(context)
        who: dict[str, object] = {}
        counted = 0  # (1 once this upload counts as arriving)
        with contextlib.ExitStack() as arriving:
            try:
                with self.limits.hold("upload", self._caller(context)):
                    header, payload = self._receive(request_iterator, context, who)
                arriving.enter_context(self._arrival(header))
                counted = 1
                return self._admit(header, payload)
            except LimitExceeded as exc:
                err = Refused("RESOURCE_EXHAUSTED", str(exc))
            except Refused as err_:
                err = err_
                err.metadata = (*err.metadata, *self._fate_metadata(who.get("header"), counted))
            except grpc.RpcError:  # cancelled: its deadline passed, or the client went away
                err = Refused("CANCELLED", cancelled_upload_reason(who))
        if who.get("ended_early") and ("deadline_s" in who or not context.is_active()):
            err = Refused("CANCELLED", cancelled_upload_reason(who))  # (its stream just ended)
        if err.code == "CANCELLED":
            log.info("upload of %r not received: %s", who.get("learner_id", ""), err.message)
        return self._refuse(context, str(who.get("learner_id", "")), err, "Upload")

    @contextlib.contextmanager
    def _arrival(self, header: pb.UploadChunk):
        """Count ``header``'s upload as arriving while inside (received, not yet answered)."""
        key = (header.learner_id, header.upload_id)
        with self.lock:
            self._arriving[key] = self._arriving.get(key, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                self._arriving[key] -= 1
                if not self._arriving[key]:
                    del self._arriving[key]

    def _fate_metadata(self, header, own: int) -> tuple[tuple[str, str], ...]:
        """The ``NOT_ADMITTED_KEY`` mark for a refused resend (``header``: its first chunk, or
        None) this syncer can tell was never admitted (``Receipts.never_admitted``, and no
        copy of it is arriving but its ``own`` count): its learner may send that progress
        again. Without the mark a refused resend's fate is unknown."""
        if header is None or not header.resend:
            return ()
        with self.lock:
            if self._arriving.get((header.learner_id, header.upload_id), 0) > own:
                return ()
            never = self.state.receipts.never_admitted(
                header.learner_id, header.upload_id, header.fragment, header.base_version
            )
        return ((NOT_ADMITTED_KEY, "1"),) if never else ()

    def _admit(self, header: pb.UploadChunk, payload: bytes) -> pb.UploadReply:
        """Submit a received upload to the state, as it arrived (decoded once here, a chunk
        at a time, for its norm and to refuse a bad payload; the merge decodes it again
        where it reads it: ``EncodedDelta``); its reply."""
        numel = self.state.layout.fragments[header.fragment].numel
        try:
            with self.committer.stage_times.timing("decode"):
                delta = EncodedDelta([(header.codec, payload)], numel)
                norm = delta.norm()  # here, not under the lock
        except codecs.CodecError as exc:
            raise Refused("INVALID_ARGUMENT", f"cannot decode the delta: {exc}") from None
        with self.lock:
            if self.committer.stopping():  # (set under this lock: see ``Committer.stop``)
                raise Refused("UNAVAILABLE", STOPPING_REASON)
            admission = self.state.submit(
                header.learner_id,
                header.session,
                fragment=header.fragment,
                base_version=header.base_version,
                steps=header.steps,
                tokens=header.tokens,
                delta=delta,
                step_time_s=header.step_time_s,
                nbytes=len(payload),
                now=clock.monotonic(),
                final=header.final,
                upload_id=header.upload_id,
                delta_norm=norm,
                final_fragments=tuple(header.final_fragments),
                resend=header.resend,
            )
            current = self.state.versions[header.fragment]
            if admission.version is not None:
                current = admission.version
        self.committer.wake()
        return pb.UploadReply(
            accepted=admission.accept,
            reason=admission.reason,
            resync=admission.resync,
            current_version=current,
            fate_unknown=admission.fate_unknown,
        )

    def _receive(self, chunks, context: grpc.ServicerContext, who: dict[str, object]):
        """``receive_upload`` under the upload's deadlines: ``first_chunk_s`` for the first
        chunk, then ``wire.protocol.syncer_upload_deadline_s`` of its size; past a deadline
        the call is cancelled (its chunk iterator raises ``grpc.RpcError``) and ``who`` gets
        the deadline that passed (``deadline_s``)."""
        started = clock.monotonic()

        def expire(deadline_s: float) -> Callable[[], None]:
            def cancel() -> None:
                who["deadline_s"] = deadline_s  # (before the cancel the handler sees)
                context.cancel()

            return cancel

        handle = [self.watchdog.arm(started + self.first_chunk_s, expire(self.first_chunk_s))]

        def on_header(nbytes: int) -> None:
            self.watchdog.disarm(handle[0])
            deadline_s = syncer_upload_deadline_s(nbytes, first_chunk_s=self.first_chunk_s)
            handle[0] = self.watchdog.arm(started + deadline_s, expire(deadline_s))

        try:
            return receive_upload(
                chunks,
                self.state,
                self.lock,
                who,
                check_caller=lambda learner_id: self.check_caller(context, learner_id),
                on_header=on_header,
            )
        finally:
            self.watchdog.disarm(handle[0])

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatReply:
        """A learner's heartbeat: ``known=False`` for an unknown session; a token that may
        not act as ``learner_id`` is refused ``PERMISSION_DENIED`` (nothing changes)."""
        self.check_alive(context)
        try:
            self.check_caller(context, request.learner_id)
            unsettled = check_unsettled(request.unsettled_from, self.state.layout.num_fragments)
        except Refused as err:
            return self._refuse(context, request.learner_id, err, "Heartbeat")
        sps = request.steps_per_s
        with self.lock:
            try:
                self.state.heartbeat(
                    request.learner_id,
                    request.session,
                    now=(now := clock.monotonic()),
                    step=max(0, request.step),
                    tokens=max(0, request.tokens),
                    steps_per_s=sps if 0 <= sps < 1e9 else 0.0,  # NaN and Inf report as 0
                    state="".join(c for c in request.state[:64] if c.isprintable()),
                )
            except Refused:
                return pb.HeartbeatReply(known=False, versions=self.state.versions)
            self.state.receipts.pin(request.learner_id, unsettled, self.state.versions, now)
            return pb.HeartbeatReply(
                known=True,
                versions=self.state.versions,
                dropped_uploads=self.state.receipts.dropped(request.learner_id),
            )

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        """A learner leaves (unknown sessions change nothing); a token that may not act as
        ``learner_id`` is refused ``PERMISSION_DENIED``."""
        self.check_alive(context)
        try:
            self.check_caller(context, request.learner_id)
        except Refused as err:
            return self._refuse(context, request.learner_id, err, "Leave")
        with self.lock:
            self.state.leave(
                request.learner_id, request.session, now=clock.monotonic(), reason="left"
            )
        self.committer.wake()
        return pb.LeaveReply()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self.lock:
            s = self.state
            live = s.live(clock.monotonic())
            streaming = {(u.learner_id, u.session) for u in self._subscribers if not u.closed}
            learners = []
            for i in s.learners.values():
                if i.observer:
                    continue
                connected = i.connected and (i.learner_id, i.session) in streaming
                learners.append(
                    pb.LearnerStatus(
                        learner_id=i.learner_id,
                        live=i.learner_id in live,
                        step=i.step,
                        tokens=i.tokens,
                        steps_per_s=i.steps_per_s,
                        state=i.state,
                        contributions=i.contributions,
                        bytes_up=i.bytes_up,
                        bytes_down=i.bytes_down,
                        connected=connected,
                        finals_due=len(i.finals_due) if connected else 0,
                    )
                )
            return pb.StatusReply(
                syncer_id=s.syncer_id,
                versions=s.versions,
                rounds=s.rounds_committed,
                bytes_up=s.bytes_up,
                bytes_down=s.bytes_down,
                learners=learners,
                uptime_s=clock.monotonic() - self.started_at,
                refused=s.refused,
                fragments=s.served,
                shard=s.shard[0],
                num_shards=s.shard[1],
                failure=repr(self.failure) if self.failure is not None else "",
                waiting=self.committer.waiting(),
                merged_tokens=s.closing.tokens_merged(),
            )

    def committed_hash(self) -> str:
        """``store.state_hash`` of the versions and Θ_p, under the lock."""
        with self.lock:
            return state_hash(self.state.versions, self.state.params)

    def state_digest(self) -> str:
        """``SyncerState.digest`` under the lock: equal before and after a refused request."""
        with self.lock:
            return self.state.digest()

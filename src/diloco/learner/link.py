"""The learner's connection to the syncer, run entirely on background threads.

``SyncerLink`` joins (layout handshake), keeps a subscription that receives every new
fragment version (keyframes and deltas) and the requests of the syncer's clock, sends queued
uploads and heartbeats, and reconnects with exponential backoff when the syncer goes away.
What it learns goes to its owner's ``LinkListener`` (``diloco.learner.listener``). The
training loop only ever calls ``submit`` and ``withdraw`` (a dict under a lock, never
blocks); every submitted job gets exactly one answer through ``listener.on_result``
(accepted, refused, failed, ...), except a withdrawn one.

Threads: ``link`` (connect / reconnect and the subscription stream), ``sender`` (encodes
and uploads the jobs of its ``diloco.learner.uploads.UploadQueue``), ``heartbeat``. A
refused first join (another model) and a join refused because a newer process of this
learner id joined are fatal (``diloco.learner.refusals``): ``error`` is set and the owner
raises it to the user.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from diloco.algorithm import codecs
from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.shards import ShardError, ShardInfo, check_cover
from diloco.learner.address import FILE_PREFIX as ADDRESS_FILE
from diloco.learner.address import resolve as resolve_address
from diloco.learner.encoder import UploadEncoder
from diloco.learner.listener import HeldFates, LinkListener
from diloco.learner.pacing import UploadMeter, backlog_seconds, upload_deadline_s
from diloco.learner.refusals import fatal_join_refusal, upload_refusal
from diloco.learner.uploads import UploadJob, UploadQueue, UploadResult
from diloco.runtime.clock import monotonic
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire import keepalive
from diloco.wire.comms import CommsBudgetError, check_budget
from diloco.wire.protocol import CHUNK_BYTES, MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
"""The first pause before reconnecting (then doubled while joins fail; ``_link_loop``)."""


@dataclass
class LinkStats:
    bytes_up: int = 0
    bytes_down: int = 0
    uploads_sent: int = 0
    uploads_refused: int = 0
    uploads_failed: int = 0
    stale_replies: int = 0
    fragments_received: int = 0
    keyframes: int = 0
    requests: int = 0
    connects: int = 0


class SyncerLink:
    """Background connection of one learner (or observer) to one syncer."""

    def __init__(
        self,
        address: str,
        learner_id: str,
        layout: FragmentLayout,
        listener: LinkListener,
        *,
        observer: bool = False,
        tokens_per_step: int = 0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        rpc_timeout_s: float = 30.0,
        max_backoff_s: float = 5.0,
        encoder: UploadEncoder | None = None,
        check_join: Callable[[SyncerLink, ShardInfo], None] | None = None,
        comms: str | None = None,
        generation: int = 0,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        """``listener`` hears everything the link learns and answers what it asks, on the
        link's threads (``diloco.learner.listener``). ``encoder`` turns a job into the bytes
        sent (``UploadEncoder``; fault injection wraps it, ``diloco.learner.corrupt``).
        ``check_join(link, info)`` is called after every successful join with what the
        syncer said it owns; raising ``ShardError`` refuses that syncer (fatal, like a refused
        join). The default insists that this one syncer owns every fragment, so a learner
        given a single shard of a sharded syncer fails with a clear error
        (``diloco.learner.shards`` passes its own check when it fans out to several shards).
        ``comms``: the named setting whose traffic is the most this link accepts; a syncer
        whose exchange is heavier is refused at join (fatal; ``diloco.wire.comms``).
        ``rpc_timeout_s``: the deadline of a join, and the least an upload gets (a big upload
        on a slow link gets more: ``diloco.learner.pacing.upload_deadline_s``).
        ``generation``: this process's generation, sent with every join (0: none; a join
        refused as superseded by a newer process of the id is fatal,
        ``diloco.learner.refusals``)."""
        self.name = address
        """The syncer as configured: ``HOST:PORT`` or ``@FILE`` (``diloco.learner.address``);
        what the listener knows it by, whatever address it is reached at."""
        self.address = resolve_address(address) or address
        """The ``HOST:PORT`` connected to (for ``@FILE``: read again before every connect)."""
        self.learner_id = learner_id
        self.layout = layout
        self.listener = listener
        self.observer = observer
        self.credentials = credentials
        self.metadata = metadata
        self.rpc_timeout_s = rpc_timeout_s
        self.max_backoff_s = max_backoff_s
        self.tokens_per_step = tokens_per_step
        self.comms = comms
        self.generation = generation
        self.encoder = encoder or UploadEncoder()
        self.schedule = "learner"
        """Who drives the rounds, as the syncer said at the last join (``"learner"`` until
        then)."""
        self.sync_every = 0
        """H the syncer paces its rounds with (0 until the first join, or not used)."""
        self.stats = LinkStats()
        self.clock = clock
        """Where the link's ``now`` comes from (its owner's clock: ``Learner.clock``)."""
        self.meter = UploadMeter(clock=clock)
        """This learner's upload rate, measured on its own uploads (``diloco.learner.pacing``)."""
        self.error: BaseException | None = None
        self.connected = threading.Event()
        self.joined_versions: list[int] | None = None
        """Fragment versions the syncer reported at the last join (None before the first)."""
        self.up_codec = "int4"
        self.shard_info: ShardInfo | None = None
        """What the syncer said at the last join: the fragments it owns, its shard."""
        self._check_join = check_join or _check_owns_all
        self._owned: frozenset[int] = frozenset()
        self._session = ""
        self._heartbeat_s = 1.0
        self._stub: pb_grpc.SyncerStub | None = None
        self._joined: tuple = (None, "", "")
        self._channels: list[grpc.Channel] = []
        """The control channel (join, uploads, heartbeats) and the download channel (the
        subscription), each its own TCP connection (``_open_channel``)."""
        self._downloads: pb_grpc.SyncerStub | None = None
        # Creating a channel's stubs while another thread closes it crashes grpc's C core
        # (seen as a segfault in a test's close()): both happen under this lock.
        self._channel_lock = threading.Lock()
        self._closing = threading.Event()
        self.queue = UploadQueue(self._encoded_size, clock=clock)
        self._threads = [
            threading.Thread(target=self._link_loop, name=f"link-{learner_id}", daemon=True),
            threading.Thread(target=self._send_loop, name=f"sender-{learner_id}", daemon=True),
            threading.Thread(
                target=self._heartbeat_loop, name=f"heartbeat-{learner_id}", daemon=True
            ),
        ]

    # ------------------------------------------------------------------ public
    def start(self) -> SyncerLink:
        for t in self._threads:
            t.start()
        return self

    def submit(self, job: UploadJob) -> None:
        """Queue an upload. A job of the same fragment still queued is replaced and answered
        ``failed`` (callers that keep a ledger ``withdraw`` it first)."""
        replaced = self.queue.put(job)
        if replaced is not None:
            self.answer(replaced, UploadResult("failed"))

    def resume(self, job: UploadJob) -> None:
        """Send a job whose answer is unknown again as it was (``UploadQueue.resume``)."""
        self.queue.resume(job)

    def withdraw(self, fragment: int) -> UploadJob | None:
        """Take back the queued, not yet sent job of ``fragment`` (None if there is none: it
        was sent or is being sent, and will be answered)."""
        return self.queue.withdraw(fragment)

    def holding(self) -> contextlib.AbstractContextManager[None]:
        """Send nothing while inside (``UploadQueue.holding``)."""
        return self.queue.holding()

    def backlog_s(self, fragment: int) -> float:
        """How long this link's waiting uploads take at its measured rate (``fragment``: for
        the sharded link's signature; one link has one queue)."""
        return backlog_seconds(self.backlog_bytes(), self.meter.rate_Bps)

    @property
    def up_rate_Bps(self) -> float | None:  # noqa: N802 - bytes, not bits
        return self.meter.rate_Bps

    def backlog_bytes(self) -> int:
        """Payload bytes of the uploads waiting to be sent or being sent."""
        return self.queue.backlog_bytes()

    def _encoded_size(self, job: UploadJob) -> int:
        if job.first_send is not None:  # (a resend: sent as it was)
            return len(job.first_send.payload)
        return codecs.encoded_nbytes(job.delta.numel(), self.up_codec)

    def queued_jobs(self) -> set[int]:
        """Ids of the jobs waiting to be sent (not yet on the wire)."""
        return self.queue.queued_ids()

    def reconnect(self) -> None:
        """Join and subscribe again (the learner asks for keyframes of fragments it cannot
        apply deltas to through ``have_versions``)."""
        self._end_channels()

    def answer(self, job: UploadJob, result: UploadResult) -> None:
        """Give ``job`` its one answer (the listener's ``on_result``): the sender's verdict,
        or a job that never went out (replaced, given up, or no shard owns it)."""
        self.listener.on_result(job, result)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued upload has been sent (or given up); True if idle in time."""
        deadline = self.clock() + timeout
        with self.queue.cond:
            while self.queue.busy():
                left = deadline - self.clock()
                if left <= 0 or not self.connected.is_set():
                    return False
                self.queue.cond.wait(min(left, 0.1))
        return True

    def close(self, *, leave: bool = True) -> None:
        """Stop all threads (bounded) and, if connected, tell the syncer we leave."""
        self._closing.set()
        with self.queue.cond:
            self.queue.cond.notify_all()
        if leave and self.connected.is_set():
            self._leave_quietly()
        self._end_channels()
        for t in self._threads:
            t.join(timeout=5)

    # ---------------------------------------------------------------- threads
    def _link_loop(self) -> None:
        """Join, listen, and when the link ends retry with a backoff that doubles (up to
        ``max_backoff_s``) while joins fail and starts over once one succeeded: a link lost
        after a successful (re)join (a syncer killed again) retries at once, not after the
        backoff grown while the syncer was down before."""
        backoff = FIRST_BACKOFF_S
        while not self._closing.is_set():
            joins = self.stats.connects
            try:
                if self._follow_address():
                    self._connect_and_listen()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
                joined_before = self.connected.is_set() or self._session != ""
                if fatal_join_refusal(code, trailing, joined_before=joined_before):
                    self.error = RuntimeError(
                        f"the syncer at {self.address} refused this learner: {exc.details()}"
                    )
                    log.info("%s", self.error)  # (the training thread raises it: said once)
                    return
                log.debug("link to %s lost: %s", self.address, code)
            except (ShardError, CommsBudgetError) as exc:  # retrying cannot fix either
                what = "syncer shards" if isinstance(exc, ShardError) else "--comms"
                self.error = RuntimeError(f"{what}: {exc}")
                log.info("%s", self.error)  # (the training thread raises it: said once)
                self.connected.clear()
                self._leave_quietly()
                self._end_channels(forget=True)
                return
            except Exception as exc:  # never let the link thread die silently
                log.warning("link error: %r", exc)
            self.connected.clear()
            self._end_channels(forget=True)
            if self.stats.connects > joins:  # joined this time: start over
                backoff = FIRST_BACKOFF_S
            if self._closing.wait(backoff):
                return
            backoff = min(backoff * 2, self.max_backoff_s)

    def _follow_address(self) -> bool:
        """For ``@FILE``: connect to the address the file holds now (a syncer restarted on
        another host wrote its new one); while it holds none, the last one read. False while
        no address is known yet (the file was never readable: wait and look again)."""
        address = resolve_address(self.name)
        if address is not None and address != self.address:
            if self.stats.connects:
                log.info("the syncer moved: %s -> %s (%s)", self.address, address, self.name)
            self.address = address
        return self.address != self.name or not self.name.startswith(ADDRESS_FILE)

    def _leave_quietly(self) -> None:
        """Tell the syncer this session ends (bounded, errors ignored)."""
        stub = self._stub
        if stub is None:
            return
        try:
            stub.Leave(
                pb.LeaveRequest(learner_id=self.learner_id, session=self._session),
                timeout=2,
                metadata=self.metadata,
            )
        except (grpc.RpcError, ValueError):
            pass

    def _end_channels(self, *, forget: bool = False) -> None:
        """Close the channels (their calls fail; the link thread reconnects unless closing);
        ``forget``: and drop them and their stubs (the link thread, before reconnecting)."""
        with self._channel_lock:
            for channel in self._channels:
                channel.close()
            if forget:
                self._channels = []
                self._stub = self._downloads = None

    def _connect_and_listen(self) -> None:
        """Open a channel, join, subscribe, then hand every arrival to the callbacks until
        the stream ends (or this link closes)."""
        stub = self._open_channel()
        if stub is None:
            return
        reply = self._join(stub)
        stream = self._downloads.Subscribe(
            pb.SubscribeRequest(
                learner_id=self.learner_id,
                session=reply.session,
                have_versions=self.listener.have_versions(),
                have_digests=self.listener.have_digests(),
            ),
            metadata=self.metadata,
        )
        self.connected.set()
        with self.queue.cond:
            self.queue.cond.notify_all()
        self._listen(stream)

    def _open_channel(self) -> pb_grpc.SyncerStub | None:
        """Fresh channels to the syncer; returns the control channel's stub (None when the
        link is closing).

        The subscription gets a TCP connection of its own: on a slow link its bytes fill
        the connection's socket buffers for seconds, and a reply queued behind them (an
        upload's verdict, a heartbeat's) would wait as long; the learner would see its
        uploads as slow and stop sending (``pacing``)."""
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *keepalive.client_options(),  # a dead syncer is noticed within 35 s
        ]
        own_connection = [*options, ("grpc.use_local_subchannel_pool", 1)]
        with self._channel_lock:
            if self._closing.is_set():
                return None
            self._channels = [self._channel_to(options), self._channel_to(own_connection)]
            self._downloads = pb_grpc.SyncerStub(self._channels[1])
            return pb_grpc.SyncerStub(self._channels[0])

    def _channel_to(self, options: list) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.address, self.credentials, options=options)
        return grpc.insecure_channel(self.address, options=options)

    def _join(self, stub: pb_grpc.SyncerStub) -> pb.JoinReply:
        """Join and take in what the syncer said (session, owned fragments, codec, clock);
        ``on_join`` may refuse the syncer (``ShardError``: fatal)."""
        tensors = [pb.TensorSpec(name=n, shape=list(s), dtype=d) for n, s, d in self.layout.tensors]
        reply = stub.Join(
            pb.JoinRequest(
                learner_id=self.learner_id,
                layout_hash=self.layout.hash,
                num_fragments=self.layout.num_fragments,
                tensors=tensors,
                observer=self.observer,
                tokens_per_step=self.encoder.declared_tokens_per_step(self.tokens_per_step),
                generation=self.generation,
                unsettled_from=self.listener.unsettled_from(),
            ),
            timeout=self.rpc_timeout_s,
            metadata=self.metadata,
        )
        info = ShardInfo(
            self.name,
            tuple(reply.fragments),
            reply.shard,
            reply.num_shards or 1,
        )
        self._stub, self._session = stub, reply.session  # so that a refusal can leave cleanly
        self._check_join(self, info)  # may raise ShardError: fatal
        if self.comms is not None:  # may raise CommsBudgetError: fatal
            check_budget(
                self.comms,
                sync_every=reply.sync_every,
                up_codec=reply.up_codec,
                down_codec=reply.down_codec,
            )
        self.shard_info, self._owned = info, frozenset(info.fragments)
        self._heartbeat_s, self.up_codec = max(0.05, reply.heartbeat_s), reply.up_codec
        self.schedule = reply.schedule
        self.sync_every = reply.sync_every
        self.stats.connects += 1
        self.listener.on_rejoin(
            self.name,
            reply.syncer_id,
            list(reply.versions),
            info.fragments,
            list(reply.committed_uploads),
            list(reply.logged_from),
            reply.lineage,
            HeldFates.of_reply(reply),
        )
        # After the rejoin is reported: whoever waits for these versions (wait_for_global)
        # then settles that rejoin first.
        self.joined_versions = list(reply.versions)
        # What an upload is sent with, read at once (stub, session, syncer instance), set only
        # now: an answer of this instance must be reported after the rejoin to it.
        self._joined = (stub, reply.session, reply.syncer_id)
        return reply

    def _listen(self, stream) -> None:
        """Requests, unchanged notes and chunked fragments from the subscription, in order."""
        parts: list[bytes] = []
        contributors: frozenset[str] = frozenset()
        dropped: frozenset[int] = frozenset()
        for chunk in stream:
            if self._closing.is_set():
                stream.cancel()
                return
            if chunk.fragment not in self._owned:  # validate before indexing the layout
                raise ConnectionError(
                    f"{self.address} sent fragment {chunk.fragment}, which it does not own"
                )
            if chunk.request:
                self.stats.requests += 1
                self.listener.on_request(chunk.fragment, chunk.version)
                continue
            if chunk.unchanged:  # it holds this value already: no payload
                self.listener.on_fragment(chunk.fragment, chunk.version, None, frozenset(), -1)
                continue
            if chunk.chunk_index == 0:
                parts = []
                contributors = frozenset(chunk.contributors)
                dropped = frozenset(chunk.dropped_uploads)
            parts.append(chunk.data)
            if chunk.chunk_index + 1 == chunk.num_chunks:
                if dropped:  # before the version arrives
                    self.listener.on_versions(self.name, [], list(dropped))
                self._arrived(chunk, b"".join(parts), contributors)

    def _arrived(self, last_chunk, payload: bytes, contributors: frozenset[str]) -> None:
        """A whole fragment (keyframe or delta) arrived: decode it and hand it on."""
        self.stats.bytes_down += len(payload)
        numel = self.layout.fragments[last_chunk.fragment].numel
        value = codecs.decode(payload, numel, last_chunk.codec)
        self.stats.fragments_received += 1
        base = last_chunk.base_version if last_chunk.is_delta else -1
        self.stats.keyframes += base < 0
        self.listener.on_fragment(
            last_chunk.fragment, last_chunk.version, value, contributors, base
        )

    def _send_loop(self) -> None:
        while not self._closing.is_set():
            job = self.queue.take(self.connected.is_set, self._closing)
            if job is None:
                continue
            try:
                result = self._upload(job)
            except ValueError:
                # The link thread closed the channel under us (connection lost): the job
                # goes again once reconnected (``UploadQueue.send_again``).
                self.stats.uploads_failed += 1
                result = UploadResult("failed")
            except Exception as exc:  # the sender must never die silently
                self.stats.uploads_failed += 1
                log.warning("upload of fragment %d failed: %r", job.fragment, exc)
                result = UploadResult("failed")
            try:
                again, older = (False, None)
                if result.outcome == "failed":
                    again, older = self.queue.send_again(job, self._closing)
                    result = result if again else self.queue.given_up(job, self._closing)
                if older is not None:
                    self.answer(older, self.queue.given_up(older, self._closing))
                if not again:
                    self.answer(job, result)
            finally:
                self.queue.done(job)

    def _upload(self, job: UploadJob) -> UploadResult:
        stub, session, syncer_id = self._joined
        if stub is None or self._stub is None:
            self.stats.uploads_failed += 1
            return UploadResult("failed")
        outgoing = job.first_send or self.encoder.encode(job, self.up_codec)
        job.first_send, payload = outgoing, outgoing.payload  # (a resend: sent as it was)
        view = memoryview(payload)
        pieces = [view[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [
            view[:0]
        ]
        # a final names itself and the finals still waiting here (read now: after a rejoin
        # the ones already delivered are not named again)
        finals = sorted({job.fragment, *self.queue.final_fragments()}) if job.final else []

        def chunks():
            for i, piece in enumerate(pieces):
                yield pb.UploadChunk(
                    learner_id=self.learner_id,
                    session=session,
                    fragment=job.fragment,
                    base_version=job.base_version,
                    steps=job.steps,
                    tokens=outgoing.tokens,
                    codec=outgoing.codec,
                    numel=job.delta.numel(),
                    chunk_index=i,
                    num_chunks=len(pieces),
                    data=bytes(piece),
                    step_time_s=job.step_time_s,
                    final=job.final,
                    upload_id=job.upload_id,
                    final_fragments=finals if i == 0 else (),
                    resend=job.attempts > 0,
                )

        try:
            deadline = upload_deadline_s(len(payload), self.meter.rate_Bps, self.rpc_timeout_s)
            self.meter.began(len(payload))
            job.on_the_wire = True
            reply = stub.Upload(chunks(), timeout=deadline, metadata=self.metadata)
        except grpc.RpcError as exc:
            self.meter.ended(delivered=False)
            code = exc.code() if hasattr(exc, "code") else None
            trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
            # a refused resend: its fate is unknown unless the syncer proves it never admitted
            outcome = upload_refusal(code, trailing, resend=job.attempts > 0)
            if outcome is not None:
                self.stats.uploads_refused += 1
                log.warning("upload of fragment %d refused: %s", job.fragment, exc.details())
                return UploadResult(outcome)
            self.stats.uploads_failed += 1
            return UploadResult("failed")
        self.meter.ended(delivered=True)
        self.stats.bytes_up += len(payload)
        self.stats.uploads_sent += 1
        if reply.fate_unknown:  # (a resend: nobody can tell whether its first send merged)
            return UploadResult("unknown")
        if not reply.accepted:
            self.stats.stale_replies += 1
            return UploadResult("stale")
        # The rest of the delta (the quantization residual) stays with the learner for the
        # next upload; it is measured against what the learner meant to send.
        sent = codecs.decode(outgoing.meant, job.delta.numel(), outgoing.codec)
        return UploadResult("accepted", reply.current_version, sent, syncer_id)

    def _heartbeat_loop(self) -> None:
        while not self._closing.wait(self._heartbeat_s):
            stub = self._stub
            if stub is None or not self.connected.is_set():
                continue
            info = self.listener.heartbeat_info()
            try:
                reply = stub.Heartbeat(
                    pb.HeartbeatRequest(
                        learner_id=self.learner_id,
                        session=self._session,
                        step=int(info.get("step", 0)),
                        tokens=int(info.get("tokens", 0)),
                        steps_per_s=float(info.get("steps_per_s", 0.0)),
                        state=str(info.get("state", "")),
                        unsettled_from=self.listener.unsettled_from(),
                    ),
                    timeout=max(2.0, 2 * self._heartbeat_s),
                    metadata=self.metadata,
                )
            except (grpc.RpcError, ValueError):  # ValueError: channel closed by the link thread
                continue
            if not reply.known:
                # The syncer restarted or dropped us: reconnect (join again) from the link thread.
                self._end_channels()
            else:
                self.listener.on_versions(
                    self.name, list(reply.versions), list(reply.dropped_uploads)
                )


def _check_owns_all(link: SyncerLink, info: ShardInfo) -> None:
    """Default join check of a single syncer: it must own every fragment (not be one shard)."""
    check_cover(link.layout.num_fragments, [info])

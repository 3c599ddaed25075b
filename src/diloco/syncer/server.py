"""``SyncerServer``: the syncer as an object a program starts and stops. It restores the state
directory, builds the state machine (:class:`diloco.syncer.state.SyncerState`) and serves it
with the gRPC service (:class:`diloco.syncer.service.SyncerService`) on an address.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from collections.abc import Collection, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import torch

from diloco.algorithm.fragments import FragmentLayout
from diloco.algorithm.shards import shard_fragments
from diloco.runtime import clock
from diloco.runtime.renamed import fragment_ids_not_p, moved_to_protocol, refuse_renamed
from diloco.syncer.config import SyncerConfig
from diloco.syncer.fencing import Claim, claim_state_dir
from diloco.syncer.generations import GenerationFile
from diloco.syncer.limits import DEFAULT_MAX_LEARNERS
from diloco.syncer.lineage import Rollback, behind, new_lineage, rollback_record, rollback_refusal
from diloco.syncer.receipt_log import ReceiptLog
from diloco.syncer.restart_times import RestartTimes
from diloco.syncer.restore import Restored, restore_fragments, restore_threads
from diloco.syncer.service import (
    SyncerService,
    pool_threads,
    stream_limits,
)
from diloco.syncer.state import SyncerState, fragment_digest
from diloco.syncer.store import (
    EventTape,
    FragmentStore,
    StateError,
    Taped,
    state_hash,
)
from diloco.syncer.tape_index import TapeIndex
from diloco.wire import auth, keepalive
from diloco.wire import diloco_pb2_grpc as pb_grpc
from diloco.wire.protocol import CHUNK_BYTES, MAX_MESSAGE_BYTES

__all__ = ["CHUNK_BYTES", "SyncerServer", "SyncerService"]

log = logging.getLogger(__name__)


class SyncerServer:
    """A running syncer: state (loaded from ``state_dir`` if it holds one) behind a gRPC server."""

    def __init__(
        self,
        layout: FragmentLayout,
        initial_params: Sequence[torch.Tensor],
        config: SyncerConfig | None = None,
        *,
        bind: str = "127.0.0.1:0",
        state_dir: str | Path | None = None,
        tape_path: str | Path | None = None,
        fragments: Sequence[int] | None = None,
        shard: tuple[int, int] = (0, 1),
        max_learners: int = DEFAULT_MAX_LEARNERS,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        token: str | None = None,
        learner_tokens: bool = False,
        allowed_learners: Sequence[str] | None = None,
        embeddings: Collection[str] | None = None,
        accept_rollback: bool = False,
    ) -> None:
        """``token``: require ``authorization: Bearer <token>`` on every call (mandatory when
        ``bind`` is not a loopback address: ``auth.AuthConfigError`` otherwise).
        ``credentials``: TLS (``diloco.wire.auth.server_credentials``). ``allowed_learners``:
        if given, only these ids may join (learners and observers alike). ``learner_tokens``:
        learners must present their own token (``diloco.wire.auth.learner_token`` of
        ``token``); a call made with a learner's token may only act as that learner either
        way. ``max_learners`` sizes the stream caps and the thread pool
        (``diloco.syncer.limits``). ``shard=(i, S)``:
        own only the fragments of shard i of S (``diloco.algorithm.shards``); ``fragments``
        overrides that list. ``embeddings``: the parameter names merged by weighted mean
        (``diloco.algorithm.embeddings.embedding_parameter_names`` of the model; ``for_model``
        passes them; None: the name rule of ``diloco.algorithm.merge``).
        ``accept_rollback``: serve a state directory its tape (or its receipt log) shows
        was rolled back, as a new lineage (``diloco.syncer.lineage``); without it such a
        directory is a ``StateError``."""
        if isinstance(fragments, int):  # the previous release's P, by its old name
            raise TypeError(
                f"SyncerServer(fragments={fragments!r}): {fragment_ids_not_p(fragments)}"
            )
        auth.check_bind(bind, token)
        if state_dir is not None and Path(state_dir).exists() and not Path(state_dir).is_dir():
            raise StateError(f"the state directory {state_dir} is a file, not a directory")
        if learner_tokens and token is None:
            raise auth.AuthConfigError("learner tokens are derived from a shared token: give one")
        self.config = config or SyncerConfig()
        self.layout = layout
        # Checked before anything is written: a bad shard must not leave a state directory or tape.
        owned = (
            list(fragments)
            if fragments is not None
            else shard_fragments(layout.num_fragments, *shard)
        )
        limits = stream_limits(max_learners)
        if token is not None:
            interceptors = [
                auth.TokenInterceptor(
                    token, lambda m, r: self.service.refuse_unauthenticated(m, r)
                ),
                *interceptors,
            ]
        # Bound before anything is written: a busy or invalid address leaves no state behind.
        self._pool = futures.ThreadPoolExecutor(
            max_workers=pool_threads(limits), thread_name_prefix="syncer-rpc"
        )
        self._server, self.port = self._bind(bind, credentials, interceptors)
        self._embeddings = embeddings
        self.claim: Claim | None = None
        """This syncer's claim on its state directory (``diloco.syncer.fencing``), or None."""
        self.lineage = ""
        """The lineage of the versions this syncer serves (``diloco.syncer.lineage``)."""
        self._rollback: Rollback | None = None
        self.restart_times = RestartTimes()
        """Where this syncer's start went, phase by phase (``diloco.syncer.restart_times``);
        its ``line()`` is logged once the syncer can serve."""
        try:
            restored, taped = self._build(
                initial_params,
                owned,
                shard,
                state_dir,
                tape_path,
                accept_rollback,
                secret=token,
                learner_tokens=learner_tokens,
                limits=limits,
                allowed_learners=(
                    frozenset(allowed_learners) if allowed_learners is not None else None
                ),
            )
        except BaseException:
            self._server.stop(None)
            self._pool.shutdown(wait=False)
            if self.claim is not None:
                self.claim.release()
            raise
        pb_grpc.add_SyncerServicer_to_server(self.service, self._server)
        self.host = bind.rsplit(":", 1)[0]
        self._started = False
        with self.restart_times.timing("start"):
            self._emit_start(restored, taped)
        log.info("syncer %s", self.restart_times.line())

    def _build(
        self, initial_params, owned, shard, state_dir, tape_path, accept_rollback, **service_options
    ):
        """The tape, the store, the restored state and the service (``service_options`` go
        to ``SyncerService``); returns what ``_emit_start`` needs: ``(restored, the newest
        version of each fragment the tape records under the directory's lineage)``. The
        state directory is claimed before anything in it is read (a second syncer on it:
        ``StateError``); one rolled back is refused unless ``accept_rollback``."""
        if len(initial_params) != self.layout.num_fragments:  # (before anything is claimed)
            raise ValueError(
                f"{len(initial_params)} parameter vectors for {self.layout.num_fragments} fragments"
            )
        times = self.restart_times
        with times.timing("claim"):
            if state_dir:
                self.claim = claim_state_dir(state_dir)
        with times.timing("tape"):
            self.tape_index = TapeIndex(tape_path, shard) if tape_path else None
            taped = self.tape_index.read() if self.tape_index else Taped()
        self.store = (
            FragmentStore(state_dir, fence=self.claim.check, epoch=self.claim.epoch, times=times)
            if state_dir
            else None
        )
        with times.timing("restore"):
            found = self._restore(owned, shard)
        versions, restored = found.versions, found.optimizer
        self._digests = found.digests
        # (a restored fragment's Θ_p is the restore's: its initial value is never made)
        params = [found.params.get(p) for p in range(self.layout.num_fragments)]
        params = [t if t is not None else initial_params[p] for p, t in enumerate(params)]
        del found.params  # (the state copies Θ_p: the restore's copy goes when it has)
        state_began = times.clock()
        held = self.store.lineage if self.store is not None else None
        taped = taped.of_lineage(held)
        restoring = self.store is not None and not self.store.created
        taped_ahead = behind(taped.versions, versions, owned) if restoring else []
        if taped_ahead and not accept_rollback:
            raise StateError(rollback_refusal(state_dir, tape_path, taped_ahead))
        self.tape = EventTape(tape_path) if tape_path else None
        emit = self.tape.try_append if self.tape else (lambda record: None)
        self.state = SyncerState(
            self.layout,
            params,
            self.config,
            versions=versions,
            emit=emit,
            wall_of=clock.wall_of,
            fragments=owned,
            shard=shard,
            embeddings=self._embeddings,
        )
        for p, momentum in restored.items():
            self.state.outer.load_fragment_state(p, momentum)
            self.state.closing.restore_history(
                p, self.store.load_commits(p), self.store.load_merged_tokens(p)
            )
        receipt_log = generation_file = None
        if state_dir:
            kept = self.config.commit_logs_kept
            receipt_log = ReceiptLog(state_dir, kept, fence=self.claim.check)
            generation_file = GenerationFile(state_dir, fence=self.claim.check)
            self.state.roster.generations.restore(generation_file.load())
        if receipt_log is not None:
            embedded = {p: self.store.load_commits(p) for p in restored}
            logs = receipt_log.open(
                {p: versions[p] for p in owned}, embedded, accept_rollback=accept_rollback
            )
            since = clock.monotonic() if restored or logs else None  # (pins come anew)
            self.state.receipts.restore(logs, receipt_log.complete_from, now=since)
        self.lineage = self._lineage(held, taped_ahead, receipt_log)
        self.service = SyncerService(
            self.state,
            store=self.store,
            tape=self.tape,
            receipt_log=receipt_log,
            generation_file=generation_file,
            tape_index=self.tape_index,
            wire=found.wire,
            lineage=self.lineage,
            **service_options,
        )
        times.add("state", times.clock() - state_began)
        return restored, taped

    def _lineage(self, held: str | None, taped_ahead, receipt_log) -> str:
        """The lineage this syncer serves: the state directory's, or a new one (persisted
        in it) when the operator accepted a rollback, or for a directory made before
        lineages; a new one at every start without a state directory."""
        if self.store is None:
            return new_lineage()
        logged_ahead = receipt_log.rolled_back if receipt_log is not None else []
        if held is not None and not taped_ahead and not logged_ahead:
            return held
        lineage = new_lineage()
        self.store.set_lineage(lineage)
        if taped_ahead or logged_ahead:
            self._rollback = Rollback(held, lineage, taped_ahead, logged_ahead)
        return lineage

    def _restore(self, owned: list[int], shard: tuple[int, int]) -> Restored:
        """Each owned fragment's saved version, value, optimizer state, last wire image and
        digest from the state directory, restored in parallel (``diloco.syncer.restore``)."""
        if self.store is None:
            return Restored(versions=[0] * self.layout.num_fragments)
        self.store.initialize(self.layout, dataclasses.asdict(self.config), shard=shard)
        self.restart_times.threads = restore_threads(len(owned))
        return restore_fragments(self.store, self.layout, owned, self.restart_times.threads)

    def _bind(self, bind: str, credentials, interceptors):
        """A gRPC server bound to ``bind`` (TLS with ``credentials``) with the pool's threads:
        ``(server, port)``; the service is added once built. Raises OSError when the address
        cannot be bound (in use, or not an address)."""
        busy = _address_in_use(bind)
        if busy:  # said here: gRPC's own attempt would also print a line of its C core's log
            raise OSError(f"cannot bind the syncer to {bind}: {busy}")
        server = grpc.server(
            self._pool,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # gRPC shares a port with another server by default (SO_REUSEPORT): a second
                # syncer on a busy port would serve half of the connections, silently
                ("grpc.so_reuseport", 0),
                *keepalive.server_options(),  # a half-open connection ends within 35 s
            ],
            interceptors=list(interceptors),
        )
        try:
            if credentials is not None:
                port = server.add_secure_port(bind, credentials)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError:  # gRPC's way of saying the bind failed
            port = 0
        if port == 0:
            server.stop(None)
            raise OSError(f"cannot bind the syncer to {bind}: the address is in use or invalid")
        return server, port

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        *,
        config: SyncerConfig | None = None,
        **kwargs,
    ) -> SyncerServer:
        """A syncer whose global model starts from ``model``'s parameters, cut into
        ``config.protocol.num_fragments`` fragments exactly as ``diloco.Learner`` cuts them
        (same layout hash).

        Other keyword arguments go to the constructor (``bind``, ``state_dir``, ...); P and H
        given here by the previous release's names are refused naming where they are now.
        """
        refuse_renamed(
            "SyncerServer.for_model",
            kwargs,
            {
                "num_fragments": moved_to_protocol("num_fragments"),
                "sync_every": moved_to_protocol("sync_every"),
            },
        )
        from diloco.algorithm.embeddings import embedding_parameter_names
        from diloco.algorithm.fragments import balanced_fragments
        from diloco.runtime.modules import plain_module

        model = plain_module(model)  # (after torch.compile: the module it wraps)
        config = config or SyncerConfig()
        layout = balanced_fragments(model.named_parameters(), config.protocol.num_fragments)
        named = dict(model.named_parameters())
        params = [layout.gather(p, named) for p in range(layout.num_fragments)]
        kwargs.setdefault("embeddings", embedding_parameter_names(model))
        return cls(layout, params, config, **kwargs)

    def _emit_start(self, restored: dict, taped: Taped) -> None:
        """The ``start`` record, after a ``recovered`` record for every restored commit whose
        round record a crash kept off the tape (so the tape accounts for every version and
        what it merged: the commit logs persisted with the fragment say it)."""
        if self.tape is None:
            return
        if self._rollback is not None:
            self.tape.append(rollback_record(self._rollback, clock.wall()), sync=True)
        recovered: list[dict] = []
        for p in sorted(restored):
            missing = [log for log in self.state.closing.history[p] if not taped.holds(log)]
            if missing or self.state.versions[p] > taped.versions.get(p, 0):
                digest = self._digests[p]
                recovered.append(recovered_record(self.state, p, taped, missing, digest))
                self.tape.append(recovered[-1])
        start = {
            "event": "start",
            "t": clock.wall(),
            "syncer_id": self.state.syncer_id,
            "shard": list(self.state.shard),
            "fragments": list(self.state.served),
            "restored_fragments": len(restored),
            "epoch": self.claim.epoch if self.claim is not None else None,
            "lineage": self.lineage,
            "versions": list(self.state.versions),
            "digests": [
                self._digests.get(p) or fragment_digest(t) for p, t in enumerate(self.state.params)
            ],
            "state_hash": state_hash(self.state.versions, self.state.params),
            # merged by weighted mean (None: the name rule of diloco.algorithm.merge)
            "embeddings": sorted(self.state.closing.embeddings)
            if self.state.closing.embeddings is not None
            else None,
        }
        self.tape.append(start, sync=True)
        for record in [*recovered, start]:  # (synced with the start record)
            self.tape_index.note(record, self.tape.end)
        self.service.committer.save_tape_index()  # (a restart reads the tape from here on)

    def state_dict(self, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The global model now (Θ of every owned fragment; the others at their initial
        value), as ``model.state_dict()`` after writing it into ``model``'s parameters (the
        model's own names, buffers and tied names: ``load_state_dict(strict=True)`` accepts
        it), or without a model as ``{parameter name: tensor}``. See
        ``diloco.syncer.export``; from a state directory: ``read_state_dirs``."""
        return self.global_model(model)[0]

    def global_model(
        self, model: torch.nn.Module | None = None
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``(state_dict(model), versions)``: the global model and the version of every
        fragment it holds, taken together under the lock (a commit lands before both or
        after both)."""
        from diloco.syncer.export import into_model, parameters_by_name

        with self.service.lock:
            params = [t.clone() for t in self.state.params]
            versions = list(self.state.versions)
        if model is None:
            return parameters_by_name(self.layout, params), versions
        return into_model(model, self.layout, params), versions

    @property
    def failure(self) -> BaseException | None:
        """Why this syncer cannot do its job (a commit it could not persist), or None. Once
        set, every call is refused ``UNAVAILABLE``: stop it and start it again from its state
        directory (``diloco syncer`` exits non-zero so its supervisor does that)."""
        return self.service.failure

    def check_claim(self) -> None:
        """Raise ``diloco.syncer.fencing.Superseded`` when another syncer has claimed this
        one's state directory since it started (nothing without a state directory): a
        program writing into the directory beside the store (a snapshot) checks first."""
        if self.claim is not None:
            self.claim.check()

    def status(self):
        """What the ``Status`` RPC answers (``diloco_pb2.StatusReply``), read in-process: the
        syncer's versions, rounds, traffic, health (``failure``) and one row per learner. A
        stable API (fields are only ever added): docs/own-model.md lists them, and ``diloco
        status HOST:PORT`` prints them."""
        from diloco.wire import diloco_pb2 as pb

        return self.service.Status(pb.StatusRequest(), None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> SyncerServer:
        """Start serving; calling it again (e.g. inside ``with``) does nothing."""
        if not self._started:
            self._started = True
            self.service.start()
            self._server.start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (bounded by ``grace`` seconds), end the pool's threads (waiting at most
        5 s more for handlers still returning), close the tape and release the state
        directory's lock (``check_claim`` still works: the epoch stays this syncer's until
        a successor claims the directory)."""
        self.service.stop()
        self._server.stop(grace).wait(grace + 5)
        ender = threading.Thread(
            target=self._pool.shutdown, kwargs={"cancel_futures": True}, daemon=True
        )
        ender.start()
        ender.join(timeout=5)
        if self.tape is not None:
            if self.service.failure is None:
                self.service.committer.save_tape_index()
            self.tape.try_append(
                {"event": "stop", "t": clock.wall(), "versions": list(self.state.versions)}
            )
            self.tape.close()
        if self.claim is not None:
            self.claim.release()

    def __enter__(self) -> SyncerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def recovered_record(
    state: SyncerState, fragment: int, taped: Taped, logs, digest: str | None = None
) -> dict:
    """The tape record of what a crash kept off the tape: commits persisted before it whose
    ``round`` record was not written (and dropped rounds whose ``dropped`` record was not):
    the restored version and digest, the persisted commit logs the tape lacks (``commits``:
    what each merged and left out), and the ``participants``, ``steps`` and ``uploads`` of
    the restored version (as a ``round`` record has them). ``digest``: ``fragment_digest``
    of its Θ_p, when known (the restore took it)."""
    version = state.versions[fragment]
    taped_version = taped.versions.get(fragment, 0)
    newest = next((log for log in reversed(logs) if log.version == version), None)
    merged = newest.merged if newest is not None else {}
    return {
        "event": "recovered",
        "t": clock.wall(),
        "fragment": fragment,
        "version": version,
        "taped_version": taped_version,
        "digest": digest or fragment_digest(state.params[fragment]),
        "reason": "persisted before the crash; its round record was not written",
        "participants": sorted(merged),
        "steps": [sum(u.steps for u in merged[lid]) for lid in sorted(merged)],
        "uploads": {lid: [u.to_json() for u in merged[lid]] for lid in sorted(merged)},
        "commits": [log.to_json() for log in logs],
    }


def _address_in_use(bind: str) -> str | None:
    """Why ``bind`` (``HOST:PORT`` with a fixed port) cannot be bound now, or None (port 0,
    a host name, or free: gRPC then binds it itself)."""
    import socket

    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # as gRPC binds: a port whose old connections linger (TIME_WAIT) is free, one
            # another socket listens on is not (a restarted syncer comes back on its address)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, int(port)))
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            return exc.strerror
        return None
    return None

"""One syncer process (``diloco syncer``): build the model's layout, serve, stop on a signal."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from diloco.config.common import ServerSecurityConfig
from diloco.config.service import ServiceConfig
from diloco.launch.syncer_stopping import StopRule


def server_security(security: ServerSecurityConfig) -> dict:
    """``SyncerServer`` keyword arguments (``token``, ``learner_tokens``, ``credentials``,
    ``allowed_learners``)."""
    from diloco.wire import auth

    kwargs: dict = {
        "token": auth.load_token(security.token_file),
        "learner_tokens": security.learner_tokens,
    }
    if security.tls_cert or security.tls_key:
        if not (security.tls_cert and security.tls_key):
            raise auth.AuthConfigError("TLS needs both --tls-cert and --tls-key")
        kwargs["credentials"] = auth.server_credentials(
            security.tls_cert, security.tls_key, security.tls_client_ca
        )
    elif security.tls_client_ca:
        raise auth.AuthConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if security.allow_learners:
        kwargs["allowed_learners"] = [
            x.strip() for x in security.allow_learners.split(",") if x.strip()
        ]
    return kwargs


FAILED = 3
"""Exit status of a syncer that failed while serving (a commit it could not persist)."""


def serve(config: ServiceConfig) -> int:
    """Serve until SIGTERM/SIGINT (or the parent's death with ``exit_with_parent``); returns
    the exit status (2: a bad configuration or state directory; ``FAILED``: it could not
    persist a commit and must be restarted from its state directory; both said on stderr)."""
    import torch

    from diloco.algorithm import chunk_threads
    from diloco.algorithm.embeddings import embedding_parameter_names
    from diloco.algorithm.fragments import balanced_fragments
    from diloco.algorithm.shards import ShardError, parse_shard
    from diloco.recipes import recipe_of
    from diloco.runtime.memory import tune_for_large_tensors
    from diloco.runtime.model_ref import ModelRefError, load_model
    from diloco.syncer.server import SyncerServer
    from diloco.syncer.store import StateError

    try:
        shard = parse_shard(config.shard)
    except ShardError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    tune_for_large_tensors()  # (before the model: large blocks freed go back, huge pages)
    try:
        model = (
            load_model(config.model)
            if config.model
            else recipe_of(config.recipe).build_model(config.recipe.seed)
        )
    except ModelRefError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    layout = balanced_fragments(model.named_parameters(), config.syncer.protocol.num_fragments)
    named = dict(model.named_parameters())
    params = [layout.gather(p, named) for p in range(layout.num_fragments)]
    embeddings = embedding_parameter_names(model)
    # The gathered copies are Θ_p's start: the model goes now (before the server copies them,
    # so that the start never holds three models), unless a snapshot is written into it.
    del named
    if not config.snapshot_path:
        model = None
    state_dir = config.state_dir
    tape = config.tape or (Path(state_dir) / "events.jsonl" if state_dir else None)
    try:
        outputs = open_dashboard(config, layout.num_fragments, tape)
    except (OSError, ValueError) as exc:  # busy, malformed, or a network address without token
        print(
            f"diloco syncer: cannot serve the dashboard on {config.dashboard}: {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        server = SyncerServer(
            layout,
            params,
            config.syncer,
            bind=config.bind,
            shard=shard,
            state_dir=state_dir,
            tape_path=tape,
            embeddings=embeddings,
            max_learners=config.max_learners,
            accept_rollback=config.accept_rollback,
            **server_security(config.security),
        )
    except (StateError, ValueError, OSError) as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        outputs.close()
        return 2
    del params  # (the server holds Θ_p: the gathered copies go)
    # (after the restore, whose threads, one per core, each replay passes of their own)
    chunk_threads.set_threads(config.commit_threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if config.exit_with_parent:
        from diloco.runtime.procs import exit_with_parent

        exit_with_parent(stop)
    server.start()
    if config.port_file:
        tmp = Path(str(config.port_file) + ".tmp")
        tmp.write_text(server.address)
        os.replace(tmp, config.port_file)
    owns = f"shard {shard[0]}/{shard[1]}: {len(server.state.served)} of " if shard[1] > 1 else ""
    print(
        f"diloco syncer serving on {server.address} ({owns}{layout.num_fragments} fragments, "
        f"versions from {state_dir or 'memory'})",
        flush=True,
    )
    if server.restart_times.fragments:  # (a restart: where its time went)
        print(f"diloco syncer: {server.restart_times.line()}", flush=True)
    if outputs.url:
        print(f"dashboard: {outputs.url}", flush=True)
    rule = StopRule(
        when_learners_leave=config.stop_when_learners_leave,
        linger_s=config.syncer.lease_s,
        max_tokens=config.max_tokens,
    )
    snapshots = Snapshots(config.snapshot_path, config.snapshot_every_s, server, model)
    while not stop.wait(0.5) and server.failure is None and snapshots.superseded is None:
        snapshots.maybe(time.monotonic())
        if outputs.watch is None and not rule.active:
            continue
        status = server.status()
        if outputs.watch is not None:  # only with --dashboard
            outputs.update(status_rows(status))
        if (over := rule.check(status, time.monotonic())) is not None:
            print(f"diloco syncer: the run is over: {over}", flush=True)
            break
    server.stop(grace=1.0 if server.failure is None else 0.0)  # (failed: every call refused)
    outputs.close()
    if server.failure is None:
        snapshots.write()  # the last global model, after the last commit
    failure = server.failure or snapshots.superseded
    if failure is not None:
        print(
            f"diloco syncer: failed, exiting to be restarted from {state_dir or 'memory'}: "
            f"{failure!r}",
            file=sys.stderr,
        )
        return FAILED
    return 0


def open_dashboard(config: ServiceConfig, fragments: int, tape):
    """The syncer's dashboard (``LiveOutputs``; serving nothing without ``--dashboard``),
    following its tape from the tape's first record. Raises ``OSError`` or ``ValueError``."""
    import time

    from diloco.dashboard.live import LiveOutputs
    from diloco.dashboard.server import DashboardServer
    from diloco.dashboard.watch import RunWatch
    from diloco.report.tally import JsonlFollower
    from diloco.wire import auth

    outputs = LiveOutputs()
    if config.dashboard is None:
        return outputs
    token = auth.load_token(config.security.token_file)
    outputs.server = DashboardServer(outputs.snapshot, bind=config.dashboard, token=token).start()
    earlier = JsonlFollower(tape).poll(max_bytes=1 << 16)
    origin = earlier[0]["t"] if earlier and "t" in earlier[0] else time.time()
    outputs.begin(RunWatch(tape=tape, fragments=fragments, started=origin, mode="syncer"))
    return outputs


def status_rows(reply) -> list[dict]:
    """The dashboard's learner rows from a ``StatusReply``."""
    return [
        {
            "id": ls.learner_id,
            "step": ls.step,
            "tokens": ls.tokens,
            "steps_per_s": ls.steps_per_s,
            "live": ls.live,
            "state": ls.state if ls.live else f"not live ({ls.state})",
            "bytes_up": ls.bytes_up,
            "bytes_down": ls.bytes_down,
        }
        for ls in reply.learners
    ]


class Snapshots:
    """The global model written as the model's own ``state_dict`` (safetensors, atomically)
    to ``path`` every ``every_s`` seconds (0: only when ``write`` is called); nothing
    without a path."""

    def __init__(self, path: str | None, every_s: float, server, model) -> None:
        self.path, self.every_s, self.server, self.model = path, every_s, server, model
        self._next = time.monotonic() + every_s
        self.superseded: Exception | None = None
        """Why no snapshot may be written: another syncer claimed the state directory."""

    def maybe(self, now: float) -> None:
        if self.path and self.every_s > 0 and now >= self._next:
            self._next = now + self.every_s
            self.write()

    def write(self) -> None:
        """Write one snapshot now: the global model and its versions, taken together
        (``SyncerServer.global_model``), written durably. A write error is said on stderr
        and serving goes on; a syncer another one superseded writes nothing and keeps why
        in ``superseded`` (it must stop)."""
        if not self.path or self.superseded is not None:
            return
        from diloco.syncer.export import save_state_dict
        from diloco.syncer.fencing import Superseded

        state, versions = self.server.global_model(self.model)
        try:
            save_state_dict(
                state,
                self.path,
                fence=self.server.check_claim,
                mode="syncer",
                versions=versions,
            )
        except OSError as exc:
            print(f"diloco syncer: snapshot {self.path}: {exc}", file=sys.stderr, flush=True)
        except Superseded as exc:
            self.superseded = exc

"""One syncer process (``diloco syncer``): build the model's layout, serve, stop on a signal."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from diloco.config.common import ServerSecurityConfig
from diloco.config.service import ServiceConfig


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

    from diloco.algorithm.embeddings import embedding_parameter_names
    from diloco.algorithm.fragments import balanced_fragments
    from diloco.algorithm.shards import ShardError, parse_shard
    from diloco.recipes import recipe_of
    from diloco.syncer.server import SyncerServer
    from diloco.syncer.store import StateError

    try:
        shard = parse_shard(config.shard)
    except ShardError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    recipe = recipe_of(config.recipe)
    model = recipe.build_model(config.recipe.seed)
    layout = balanced_fragments(model.named_parameters(), config.syncer.protocol.num_fragments)
    named = dict(model.named_parameters())
    params = [layout.gather(p, named) for p in range(layout.num_fragments)]
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
            embeddings=embedding_parameter_names(model),
            **server_security(config.security),
        )
    except (StateError, ValueError, OSError) as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        outputs.close()
        return 2
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
    if outputs.url:
        print(f"dashboard: {outputs.url}", flush=True)
    while not stop.wait(0.5) and server.failure is None:
        if outputs.watch is not None:  # only with --dashboard
            outputs.update(status_rows(server.status()))
    server.stop(grace=1.0 if server.failure is None else 0.0)  # (failed: every call refused)
    outputs.close()
    if server.failure is not None:
        print(
            f"diloco syncer: failed, exiting to be restarted from {state_dir or 'memory'}: "
            f"{server.failure!r}",
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

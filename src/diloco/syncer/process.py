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


def serve(config: ServiceConfig) -> int:
    """Serve until SIGTERM/SIGINT (or the parent's death with ``exit_with_parent``); returns
    the exit status (2: a bad configuration or state directory, said on stderr)."""
    import torch

    from diloco.algorithm.fragments import balanced_fragments
    from diloco.algorithm.shards import ShardError, parse_shard
    from diloco.recipes import get_recipe
    from diloco.syncer.server import SyncerServer
    from diloco.syncer.store import StateError

    try:
        shard = parse_shard(config.shard)
    except ShardError as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(config.threads)
    recipe = get_recipe(config.recipe.recipe, data_path=config.recipe.data)
    model = recipe.build_model(config.recipe.seed)
    layout = balanced_fragments(model.named_parameters(), config.protocol.fragments)
    named = dict(model.named_parameters())
    params = [layout.gather(p, named) for p in range(layout.num_fragments)]
    state_dir = config.state_dir
    try:
        server = SyncerServer(
            layout,
            params,
            config.syncer,
            bind=config.bind,
            shard=shard,
            state_dir=state_dir,
            tape_path=config.tape or (Path(state_dir) / "events.jsonl" if state_dir else None),
            **server_security(config.security),
        )
    except (StateError, ValueError, OSError) as exc:
        print(f"diloco syncer: {exc}", file=sys.stderr)
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
    while not stop.wait(0.5):
        pass
    server.stop(grace=1.0)
    return 0

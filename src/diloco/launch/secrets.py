"""The run's secrets: one shared token, and each learner's own token derived from it.

``diloco run`` always authenticates its processes, also on loopback (other users of the
machine can reach a loopback port): without ``--token-file`` (or ``$DILOCO_TOKEN``) a fresh
secret is written to ``<run_dir>/token``. The syncer is started with ``--learner-tokens``, and
each learner (and the evaluator) gets only its own token
(``diloco.wire.auth.learner_token``), written to ``<run_dir>/secrets/<id>.token``; the
supervisor's status client uses the shared one, which may only ask for ``Status``. Every file
is created with mode 0600.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from pathlib import Path

from diloco.config.run import RunConfig
from diloco.wire.auth import learner_token


def _write_private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def with_token(config: RunConfig, run_dir: Path) -> RunConfig:
    """``config`` with a token file: its own, or a fresh one written to ``run_dir/token``."""
    if config.token_file or os.environ.get("DILOCO_TOKEN"):
        return config
    path = _write_private(run_dir / "token", secrets.token_hex(32))
    return dataclasses.replace(config, token_file=str(path))


def learner_token_file(run_dir: Path, secret: str, learner_id: str) -> str:
    """Write learner ``learner_id``'s own token to ``run_dir/secrets/<id>.token`` (once)."""
    path = run_dir / "secrets" / f"{learner_id}.token"
    if not path.exists():
        _write_private(path, learner_token(secret, learner_id))
    return str(path)

"""Where a learner finds its syncer: ``HOST:PORT``, or ``@FILE``.

``@FILE`` names a file that holds the syncer's ``HOST:PORT`` (e.g. what the Slurm syncer job
writes to ``syncer.at``, or a syncer's ``--port-file`` when the host is the same). The link
reads it before every (re)connect, so a syncer restarted on another host (a requeued Slurm
job, a Ray actor restarted on another node) is found again once it has written its new
address there. What the learner knows the syncer by (its ledger's syncer instances, its
shard) stays the spec, ``@FILE``, not the address read.
"""

from __future__ import annotations

from pathlib import Path

FILE_PREFIX = "@"


def check_address(address: str) -> str:
    """``address`` if it is ``HOST:PORT`` (a port from 1 to 65535), else ``ValueError``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"syncer address {address!r} is not HOST:PORT (e.g. localhost:7000, [::1]:7000) "
            "or @FILE (a file that holds it)"
        )
    return address


def check_spec(spec: str) -> str:
    """``spec`` if it is ``HOST:PORT`` or ``@FILE`` with a non-empty path, else ``ValueError``
    (the file itself may not exist yet: its syncer may not have started)."""
    if spec.startswith(FILE_PREFIX):
        if not spec[len(FILE_PREFIX) :].strip():
            raise ValueError(f"syncer address {spec!r}: @ must be followed by a file name")
        return spec
    return check_address(spec)


def resolve(spec: str) -> str | None:
    """The ``HOST:PORT`` that ``spec`` means now: ``spec`` itself, or for ``@FILE`` the
    file's first line; ``None`` while the file is missing, empty or not ``HOST:PORT``
    (a syncer about to write it)."""
    if not spec.startswith(FILE_PREFIX):
        return spec
    try:
        text = Path(spec[len(FILE_PREFIX) :]).read_text()
    except OSError:
        return None
    lines = text.strip().splitlines()
    if not lines:
        return None
    try:
        return check_address(lines[0].strip())
    except ValueError:
        return None

"""Restoring a syncer's fragments from its state directory, in parallel (what
``SyncerServer`` does at start, before it serves).

Fragments are independent: each is its snapshot file read and checked, its journal read and
its records replayed (``FragmentStore.load``), then the digest of its Θ_p taken for the
``start`` record. ``restore_fragments`` runs them on ``restore_threads`` threads (the
SHA-256 of ``hashlib`` and torch's arithmetic let go of the interpreter's lock on large
buffers, so they run on as many cores); every fragment is restored exactly as a restore
one by one would restore it, and when one fails (a corrupt file) the error raised is that
of the first failing fragment in the order of their ids, as one by one, and the fragments
not begun are not begun.

Each thread holds, while it replays, one fragment's replay temporaries (the merged delta,
the new wire image and one tensor's span of an upload decoded for its norm: at most 3·4
bytes per value of a fragment; the uploads stay as the journal holds them, decoded where
the merge reads them); ``RESTORE_THREADS_MAX`` bounds that.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field

import torch

from diloco.algorithm.fragments import FragmentLayout, fragment_digest
from diloco.syncer.store import FragmentStore

_NOT_BEGUN = object()
"""What a job returns for a fragment it skipped after another one's failure."""
RESTORE_THREADS_MAX = 8
"""The most threads a restore runs on (one per core up to it)."""


def restore_threads(fragments: int) -> int:
    """Threads for restoring ``fragments`` fragments: one per core this process may run
    on, at most ``RESTORE_THREADS_MAX`` and at most one per fragment (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(cores, RESTORE_THREADS_MAX, fragments))


@dataclass
class Restored:
    """What the state directory held of the owned fragments: per fragment its version
    (all of ``versions``: 0 for one never committed), and for those restored their Θ_p
    (``params``), outer optimizer state (``optimizer``: ``"momentum"`` where kept), wire
    image (``wire``, where kept) and ``digests`` (``fragment_digest`` of Θ_p)."""

    versions: list[int]
    params: dict[int, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    wire: dict[int, torch.Tensor] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)


def restore_fragments(
    store: FragmentStore, layout: FragmentLayout, owned: Sequence[int], threads: int
) -> Restored:
    """Each fragment of ``owned`` as its snapshot and journal make it (``store.load``), on
    ``threads`` threads (the module docstring); raises what ``load`` raises for the first
    fragment in ``owned``'s order that fails."""
    restored = Restored(versions=[0] * layout.num_fragments)

    failed = threading.Event()  # (set by the first failure: fragments not begun are skipped)

    def restore(p: int):
        if failed.is_set():
            return _NOT_BEGUN
        try:
            loaded = store.load(p, layout.fragments[p].numel)
        except BaseException:
            failed.set()
            raise
        if loaded is None:
            return None
        digest = store.digests.get(p)
        if digest is None:
            with store.times.timing("digest"):
                digest = fragment_digest(loaded[1])
        return loaded, digest

    with futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="restore") as pool:
        jobs = [pool.submit(restore, p) for p in owned]
    # (the pool has ended every job: the first failure in ``owned``'s order is raised; the
    # jobs run in that order, so every fragment before it was begun)
    results = [job.result() for job in jobs]
    for p, result in zip(owned, results, strict=True):
        if result is None:
            continue
        (version, params, state), digest = result
        restored.versions[p], restored.params[p], restored.digests[p] = version, params, digest
        if "wire" in state:
            restored.wire[p] = state.pop("wire")
        restored.optimizer[p] = state
        store.times.fragments += 1
    return restored

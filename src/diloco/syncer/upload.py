"""Reassembling one upload stream, checked chunk by chunk before any of it touches state."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from threading import Lock

from diloco.algorithm import codecs
from diloco.syncer.state import Refused, SyncerState
from diloco.wire import diloco_pb2 as pb
from diloco.wire.protocol import CHUNK_BYTES


def receive_upload(
    chunks: Iterator[pb.UploadChunk],
    state: SyncerState,
    lock: Lock,
    who: dict[str, object],
    *,
    check_caller: Callable[[str], None] = lambda learner_id: None,
    on_header: Callable[[int], None] = lambda nbytes: None,
) -> tuple[pb.UploadChunk, bytes]:
    """Reassemble one upload, checking chunk order, header consistency and sizes.

    The first chunk's header is checked (the caller may act as its learner id: raises
    ``Refused`` otherwise; session, fragment, codec, numel, chunk count) before any more data
    is read, so a stranger or a bad header costs one chunk. The session is not checked for
    an upload id the receipts hold (a resend whose first reply was lost, sent before its
    learner rejoined): ``SyncerState.submit`` answers it with its admission. ``who`` gets
    the first chunk (``header``), its ``learner_id``, the ``chunks`` received so far and,
    when the stream ended before the upload was whole, ``ended_early`` (a client that half-
    closed too soon, or one that went away: the caller tells them apart by its call).
    ``on_header(nbytes)`` is told the upload's size once its header passed.
    """
    header = None
    parts: list[bytes] = []
    received = 0
    expected = 0
    for i, chunk in enumerate(chunks):
        if header is None:
            header = who["header"] = chunk
            who["learner_id"] = chunk.learner_id
            check_caller(chunk.learner_id)
            with lock:  # a resend the receipts hold is answered whatever session it carries
                held = state.receipts.admitted(chunk.learner_id, chunk.upload_id, chunk.fragment)
                info = (
                    state.roster.session_of(chunk.learner_id, chunk.session)
                    if held is None
                    else None
                )
            if info is not None and info.observer:
                raise Refused("PERMISSION_DENIED", "observers cannot contribute")
            if not 0 <= chunk.fragment < state.layout.num_fragments:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"fragment {chunk.fragment} out of range [0, {state.layout.num_fragments})",
                )
            state.check_owned(chunk.fragment)
            check_upload_codec(chunk.codec, state.config.up_codec, resend=chunk.resend)
            numel = state.layout.fragments[chunk.fragment].numel
            if chunk.numel != numel:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"fragment {chunk.fragment} has {numel} values, header says {chunk.numel}",
                )
            expected = codecs.encoded_nbytes(numel, chunk.codec)
            max_chunks = max(1, -(-expected // CHUNK_BYTES))
            if not 1 <= chunk.num_chunks <= max_chunks:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"num_chunks must be in [1, {max_chunks}], got {chunk.num_chunks}",
                )
            if len(chunk.final_fragments) > state.layout.num_fragments:
                raise Refused(
                    "INVALID_ARGUMENT",
                    f"{len(chunk.final_fragments)} final_fragments for "
                    f"{state.layout.num_fragments} fragments",
                )
            on_header(expected)
        elif _header_fields(chunk) != _header_fields(header):
            raise Refused("INVALID_ARGUMENT", f"chunk {i} header differs from chunk 0")
        if len(chunk.data) > CHUNK_BYTES:
            raise Refused(
                "INVALID_ARGUMENT", f"chunk {i} carries {len(chunk.data)} > {CHUNK_BYTES} bytes"
            )
        if chunk.chunk_index != i or i >= header.num_chunks:
            raise Refused(
                "INVALID_ARGUMENT",
                f"chunk {chunk.chunk_index} arrived at position {i} of {header.num_chunks}",
            )
        received += len(chunk.data)
        if received > expected:
            raise Refused(
                "INVALID_ARGUMENT", f"upload exceeds the {expected} bytes its header implies"
            )
        parts.append(chunk.data)
        who["chunks"] = len(parts)
    if header is None or len(parts) != header.num_chunks or received != expected:
        who["ended_early"] = True
    if header is None:
        raise Refused("INVALID_ARGUMENT", "empty upload: the stream ended before its first chunk")
    if len(parts) != header.num_chunks or received != expected:
        raise Refused(
            "INVALID_ARGUMENT",
            f"upload truncated: the stream ended after {len(parts)}/{header.num_chunks} "
            f"chunks, {received}/{expected} bytes",
        )
    return header, b"".join(parts)


def cancelled_upload_reason(who: dict[str, object]) -> str:
    """Why an upload whose call was cancelled before all of it arrived was not received, as
    ``receive_upload`` and the deadlines left ``who``: its deadline passed (``deadline_s``,
    set by the watchdog that cancelled it), or else the client cancelled the call or its
    connection closed. Never admitted either way."""
    got = f"after {who.get('chunks', 0)} chunks"
    if "deadline_s" in who:
        return f"the upload did not arrive within its deadline of {who['deadline_s']:.3g} s ({got})"
    return f"the client cancelled the upload or its connection closed ({got})"


def check_upload_codec(codec: str, up_codec: str, *, resend: bool) -> None:
    """Raise ``Refused("INVALID_ARGUMENT")`` unless an upload in ``codec`` may be read: the
    syncer's ``up_codec`` (sent at join), or for a resend any codec ``codecs.CODECS`` names. A
    resend carries the bytes of its first send as they were (its learner recorded them as
    sent), perhaps to a syncer restarted with another ``--up-codec``: it is answered from the
    commit logs, or merged, as decoded from its own codec (at most the size of that codec's
    encoding; the norm guard checks it as any other)."""
    if codec == up_codec or (resend and codec in codecs.CODECS):
        return
    raise Refused(
        "INVALID_ARGUMENT",
        f"codec {codec[:16]!r} is not the syncer's up codec {up_codec!r} (sent at join)",
    )


def _header_fields(chunk: pb.UploadChunk) -> tuple:
    """Fields every chunk of one upload must repeat unchanged (``final_fragments``: read from
    the first chunk only)."""
    return (
        chunk.learner_id,
        chunk.session,
        chunk.fragment,
        chunk.base_version,
        chunk.steps,
        chunk.tokens,
        chunk.codec,
        chunk.numel,
        chunk.num_chunks,
        chunk.step_time_s,
        chunk.final,
        chunk.upload_id,
    )


def check_unsettled(
    reported: Sequence[int], num_fragments: int, claimed: int | None = None
) -> list[int]:
    """A learner's ``unsettled_from`` as sent: empty (nothing reported) or one version per
    fragment, each >= -1 (-1: it holds none). ``Refused("INVALID_ARGUMENT")`` otherwise.
    ``claimed``: the fragments the learner says the model has (its Join's); a report of
    another fragmentation is ignored (``[]``), so that the join's own refusal, which names
    both, is what the learner reads."""
    if claimed is not None and claimed != num_fragments:
        return []
    floors = [int(v) for v in reported]
    if floors and (len(floors) != num_fragments or min(floors) < -1):
        raise Refused(
            "INVALID_ARGUMENT",
            f"unsettled_from must be empty or one version >= -1 per fragment "
            f"({num_fragments}); got {len(floors)} values, least {min(floors)}",
        )
    return floors

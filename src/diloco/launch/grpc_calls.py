"""Which gRPC call a relayed byte belongs to: enough HTTP/2 to tell an answer by its method.

A relay (``diloco.launch.relay``) copies a connection's bytes unchanged. To lose the reply
to an *upload* and nothing else, it must know which HTTP/2 stream carries an upload: the
client names the method in its request's ``:path`` header (``/diloco.v1.Syncer/Upload``),
compressed with HPACK (whose table spans the connection, so every header block is decoded,
in order), and the server answers on the same stream id. :class:`CallWatch` follows both
directions of one plain-text (h2c) connection, frame by frame across reads: the client's
header blocks name the streams of the watched method, the server's frames on those streams
are the answers. Nothing is changed or buffered beyond the frame being parsed.
"""

from __future__ import annotations

import threading

import hpack

from diloco.wire import diloco_pb2 as pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first, before any frame."""
HEADERS, CONTINUATION = 0x1, 0x9
ANSWER_FRAMES = (0x0, 0x1, 0x3)
"""The server's frames that start an answer on a stream: DATA, HEADERS, RST_STREAM (not
WINDOW_UPDATE or PRIORITY, which a server sends while the request still arrives)."""
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20
UPLOAD = f"/{pb.DESCRIPTOR.services_by_name['Syncer'].full_name}/Upload"
"""The ``:path`` of the syncer's Upload call."""


class FrameReader:
    """Splits a byte stream into HTTP/2 frames ``(type, flags, stream id, payload)``, across
    reads (``preface``: the stream starts with the client's connection preface)."""

    def __init__(self, preface: bool) -> None:
        self._skip = len(PREFACE) if preface else 0
        self._buffer = b""

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        if self._skip:
            cut = min(self._skip, len(data))
            self._skip -= cut
            data = data[cut:]
        self._buffer += data
        frames = []
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            frames.append((kind, flags, stream, self._buffer[9 : 9 + length]))
            self._buffer = self._buffer[9 + length :]
        return frames


class CallWatch:
    """Follows one relayed connection and tells the server's answers to ``method``'s calls.

    ``client_sent(data)`` before forwarding the client's bytes; ``first_answers(data)``
    before forwarding the server's: the watched streams whose answer starts in ``data``
    (each one is reported once). A connection that is not HTTP/2 (or that the decoder cannot
    follow) is simply never watched."""

    def __init__(self, method: str = UPLOAD) -> None:
        self.method = method
        self._up = FrameReader(preface=True)
        self._down = FrameReader(preface=False)
        self._decoder = hpack.Decoder()
        self._block: dict[int, bytes] = {}
        self._watched: set[int] = set()
        self._broken = False
        self._lock = threading.Lock()

    def client_sent(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            for kind, flags, stream, payload in self._up.feed(data):
                if kind == HEADERS:
                    self._block[stream] = _header_fragment(flags, payload)
                elif kind == CONTINUATION and stream in self._block:
                    self._block[stream] += payload
                else:
                    continue
                if flags & END_HEADERS:
                    self._headers(stream, self._decoder.decode(self._block.pop(stream)))
        except (hpack.HPACKError, ValueError, IndexError):
            self._broken = True  # (not HTTP/2 as expected: watch nothing from now on)

    def first_answers(self, data: bytes) -> set[int]:
        if self._broken:
            return set()
        answered = set()
        with self._lock:
            for kind, _flags, stream, _payload in self._down.feed(data):
                if stream in self._watched and kind in ANSWER_FRAMES:
                    self._watched.discard(stream)
                    answered.add(stream)
        return answered

    def _headers(self, stream: int, headers) -> None:
        path = dict((_text(k), _text(v)) for k, v in headers).get(":path")
        if path == self.method:
            with self._lock:
                self._watched.add(stream)


def _header_fragment(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's header block fragment (without its padding and priority)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        start, end = 1, len(payload) - payload[0]
    if flags & PRIORITY:
        start += 5
    if start > end:
        raise ValueError("malformed HEADERS frame")
    return payload[start:end]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

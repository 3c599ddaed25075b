"""The dashboard's HTTP server: the page, the snapshot as JSON, Prometheus ``/metrics``.

Routes (GET and HEAD only):

- ``/``: the dashboard page (one self-contained HTML file: its script and styles inline, no
  request leaves the page's origin);
- ``/api/snapshot``: the run's snapshot as JSON (``diloco.dashboard.watch``);
- ``/metrics``: the snapshot in Prometheus's text format;
- ``/healthz``: ``ok`` (no token needed, nothing disclosed).

Access follows the gRPC port's rules: with a token (the shared secret, or the read-only
viewer token derived from it, ``diloco.wire.auth.viewer_token``) every route but
``/healthz`` needs it, as ``Authorization: Bearer TOKEN`` (Prometheus's
``authorization`` setting), as ``?token=TOKEN`` (the printed link; the page then keeps it in
an HTTP-only cookie and drops it from the address bar), or as that cookie; without a token
the server refuses to bind anything but a loopback address (``auth.check_bind``).

``/healthz`` answers anyone, so the server bounds what any client can hold: at most
``MAX_CONNECTIONS`` connections are served at once (one thread each; one more is answered
503 and closed on the accepting thread, without a thread of its own), and each connection is
cut ``CONNECTION_DEADLINE_S`` after it was accepted, however slowly it sends its request or
reads its answer.
"""

from __future__ import annotations

import hmac
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from diloco.runtime.watchdog import Watchdog
from diloco.wire import auth

COOKIE = "diloco_token"
MAX_CONNECTIONS = 32
"""Connections served at once, each on a thread of its own; more are answered 503 at once. A
page polls once a second and Prometheus scrapes every few seconds, each with a short
connection: room for many viewers, while a flood of connections holds at most this many."""
CONNECTION_DEADLINE_S = 10.0
"""A connection is closed this long after it was accepted, whatever it is doing: a request
is a few hundred bytes and an answer fits the socket's buffers, while a timeout per read
would let a client that sends a byte every 9 s hold its thread forever."""
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 22\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    b"busy: try again later\n"
)
"""The whole answer to a connection over ``MAX_CONNECTIONS``."""
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; frame-ancestors 'none'"
    ),
}


class DashboardServer:
    """Serves ``snapshot()`` (a callable returning the latest snapshot) on ``bind``.

    Raises ``auth.AuthConfigError`` for a network address without a token, ``ValueError`` for
    an address that is not ``HOST:PORT`` and ``OSError`` when it cannot be bound (busy).
    :meth:`start` serves from a background thread; :meth:`stop` ends it and closes the socket.
    """

    def __init__(
        self,
        snapshot: Callable[[], dict],
        *,
        bind: str = "127.0.0.1:0",
        token: str | None = None,
        deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        """``deadline_s``: a connection is cut this long after it was accepted."""
        host, port = auth.split_address(bind, what="the dashboard address")
        auth.check_bind(bind, token)
        self._accepted = [] if token is None else [token, auth.viewer_token(token)]
        self.viewer_token = auth.viewer_token(token) if token else None
        handler = _handler(snapshot, self._accepted)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (_BoundedServer,), {"address_family": family})
        self._httpd = server_class((host, port), handler)
        self._httpd.deadline_s = deadline_s
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The page's address, with the viewer token when one is needed."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = f"?token={self.viewer_token}" if self.viewer_token else ""
        return f"http://{host}:{self.port}/{query}"

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            daemon=True,
            name="dashboard-http",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port (bounded: open requests time out)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5.0)
            self._thread = None
        self._httpd.server_close()
        self._httpd.watchdog.close()


class _BoundedServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with at most ``MAX_CONNECTIONS`` handler threads, each
    connection cut at its deadline (see the module docstring)."""

    daemon_threads = True
    allow_reuse_address = False
    deadline_s = CONNECTION_DEADLINE_S
    request_queue_size = MAX_CONNECTIONS  # a burst waits to be accepted, its SYNs not dropped

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # binds first: a busy port leaves no thread behind
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.watchdog = Watchdog()

    def process_request(self, request, client_address) -> None:
        """On the accepting thread: a free slot gets a handler thread and a deadline, a
        connection over the cap is answered ``BUSY`` and closed."""
        if not self._slots.acquire(blocking=False):
            request.setblocking(False)
            try:
                request.send(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        deadline = self.watchdog.arm(time.monotonic() + self.deadline_s, partial(_cut, request))
        threading.Thread(
            target=self._serve,
            args=(request, client_address, deadline),
            name="dashboard-request",
            daemon=True,
        ).start()

    def handle_error(self, request, client_address) -> None:
        """A connection cut at its deadline or by its client (a failed read or write) is not
        an error worth a traceback on the run's terminal; anything else is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def _serve(self, request, client_address, deadline: int) -> None:
        try:
            self.process_request_thread(request, client_address)  # handles, then closes
        finally:
            self.watchdog.disarm(deadline)
            self._slots.release()


def _cut(request: socket.socket) -> None:
    """End a connection at its deadline: its handler's blocked read or write fails now."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


def page() -> bytes:
    """The dashboard page (package data ``page.html``)."""
    return resources.files("diloco.dashboard").joinpath("page.html").read_bytes()


def _handler(snapshot: Callable[[], dict], accepted: list[str]):
    class Handler(BaseHTTPRequestHandler):
        timeout = CONNECTION_DEADLINE_S  # per read or write; the deadline bounds the total
        server_version = "diloco-dashboard"
        sys_version = ""

        def log_message(self, *args) -> None:  # no access log on the run's terminal
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, *, body: bool) -> None:
            url = urlsplit(self.path)
            if url.path == "/healthz":
                return self._send(200, b"ok\n", "text/plain; charset=utf-8", body)
            presented = self._presented(url.query)
            if accepted and not any(
                hmac.compare_digest(presented.encode(), t.encode()) for t in accepted
            ):
                reason = b"missing token" if not presented else b"wrong token"
                return self._send(
                    401,
                    reason + b": open the link diloco printed, or send "
                    b"'Authorization: Bearer TOKEN'\n",
                    "text/plain; charset=utf-8",
                    body,
                    extra={"WWW-Authenticate": 'Bearer realm="diloco"'},
                )
            cookie = {}
            if accepted and "token=" in url.query:
                cookie = {"Set-Cookie": f"{COOKIE}={presented}; HttpOnly; SameSite=Strict; Path=/"}
            if url.path == "/":
                return self._send(200, page(), "text/html; charset=utf-8", body, extra=cookie)
            if url.path == "/api/snapshot":
                data = json.dumps(json_safe(snapshot()), allow_nan=False).encode()
                return self._send(200, data, "application/json", body)
            if url.path == "/metrics":
                from diloco.dashboard.prometheus import exposition

                data, kind = exposition(snapshot())
                return self._send(200, data, kind, body)
            return self._send(404, b"not found\n", "text/plain; charset=utf-8", body)

        def _presented(self, query: str) -> str:
            header = self.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                return header[len("Bearer ") :].strip()
            token = parse_qs(query).get("token")
            if token:
                return token[0]
            for part in self.headers.get("Cookie", "").split(";"):
                key, _, value = part.strip().partition("=")
                if key == COOKIE:
                    return value
            return ""

        def _send(self, code: int, data: bytes, kind: str, body: bool, extra=None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in {**SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        setattr(Handler, f"do_{method}", _refuse_method)
    return Handler


def _refuse_method(self) -> None:
    self._send(
        405,
        b"read-only: GET or HEAD\n",
        "text/plain; charset=utf-8",
        True,
        extra={"Allow": "GET, HEAD"},
    )


def json_safe(value):
    """``value`` with every non-finite float (a diverged loss) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value

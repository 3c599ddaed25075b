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
"""

from __future__ import annotations

import hmac
import json
import math
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from diloco.wire import auth

COOKIE = "diloco_token"
REQUEST_TIMEOUT_S = 10.0
"""A client that sends nothing for this long is disconnected."""
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
    ) -> None:
        host, port = auth.split_address(bind, what="the dashboard address")
        auth.check_bind(bind, token)
        self._accepted = [] if token is None else [token, auth.viewer_token(token)]
        self.viewer_token = auth.viewer_token(token) if token else None
        handler = _handler(snapshot, self._accepted)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (ThreadingHTTPServer,), {"address_family": family})
        server_class.daemon_threads = True
        server_class.allow_reuse_address = False
        self._httpd = server_class((host, port), handler)
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


def page() -> bytes:
    """The dashboard page (package data ``page.html``)."""
    return resources.files("diloco.dashboard").joinpath("page.html").read_bytes()


def _handler(snapshot: Callable[[], dict], accepted: list[str]):
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
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

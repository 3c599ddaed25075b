"""Who may talk to the syncer: a shared token, TLS and mutual TLS, on both ends of the wire.

**Token.** Every call carries the metadata ``authorization: Bearer <token>``. The server
compares it in constant time (``hmac.compare_digest``) in an interceptor that runs before a
request is even deserialized; a call without the right token gets ``UNAUTHENTICATED`` and
reaches no handler. The token comes from a file (``--token-file``) or, when no file is
given, from the environment variable ``DILOCO_TOKEN``; an explicit file always wins. A syncer
that binds anything but a loopback address refuses to start without a token
(:func:`check_bind`): on a network nobody may be let in by default.

**TLS.** The server presents a certificate (``--tls-cert`` / ``--tls-key``); clients verify it
against a CA bundle (``--tls-ca``). With ``--tls-client-ca`` the server also demands a client
certificate signed by that CA (mutual TLS); clients then pass ``--tls-cert`` / ``--tls-key``.
Without TLS the token travels in clear text: use TLS whenever the network is not trusted.

**Learner tokens.** A learner's own token is derived from the syncer's secret and its id
(:func:`learner_token`: ``dl1.<id>.<HMAC-SHA256(secret, id)>``), so the syncer stores nothing
per learner and an operator hands each site only its own token (``diloco learner-token ID``).
The interceptor lets such a token in like the shared one; the handlers then check that every
call names the id the token was made for (:func:`caller_identity`), and a syncer started with
``--learner-tokens`` accepts the shared secret itself only for ``Status``: one leaked or
hostile learner cannot act under another learner's id.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

TOKEN_ENV = "DILOCO_TOKEN"
"""Environment variable read for the token when no token file is given."""
METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they can be guessed."""
LEARNER_TOKEN_PREFIX = "dl1."
"""Marks a learner's own token (:func:`learner_token`)."""
SHARED = ""
"""``caller_identity`` of a call made with the shared secret (it may name any id)."""


class AuthConfigError(ValueError):
    """Bad security settings (missing token on a network address, unreadable file, ...)."""


def load_token(
    token_file: str | os.PathLike | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The shared token from ``token_file`` if given, else from ``$DILOCO_TOKEN``, else None.

    Surrounding whitespace (a trailing newline) is stripped. Raises :class:`AuthConfigError`
    if the file cannot be read or the token is shorter than ``MIN_TOKEN_CHARS``.
    """
    env = os.environ if env is None else env
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"cannot read the token file {token_file}: {exc}") from None
        source = str(token_file)
    else:
        token = env.get(TOKEN_ENV, "").strip()
        source = f"${TOKEN_ENV}"
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable():
        raise AuthConfigError(
            f"the token in {source} must be at least {MIN_TOKEN_CHARS} printable characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return token


def bind_host(bind: str) -> str:
    """The host part of ``host:port`` (``[::1]:7000`` -> ``::1``)."""
    host = bind.rsplit(":", 1)[0] if ":" in bind else bind
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def split_address(address: str, *, what: str = "the address") -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[::1]:7000`` for IPv6; port 0 picks a free one);
    ``ValueError`` naming ``what`` for anything else.

    >>> split_address("[::1]:0")
    ('::1', 0)
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} must be HOST:PORT, e.g. 127.0.0.1:0 (got {address!r})")
    return bind_host(address), int(port)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses; any other name or address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, token: str | None) -> None:
    """Refuse (``AuthConfigError``) to serve a non-loopback address without a token."""
    if token is None and not is_loopback(bind_host(bind)):
        raise AuthConfigError(
            f"refusing to bind {bind} without a shared token: anyone who can reach that address "
            f"could change the global model. Put a secret in a file and pass --token-file PATH "
            f"(or set {TOKEN_ENV}); give learners the same token. Or bind 127.0.0.1."
        )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every call (empty without a token)."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def _read(path: str | os.PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the {what} {path}: {exc}") from None


def server_credentials(
    cert_file: str | os.PathLike,
    key_file: str | os.PathLike,
    client_ca_file: str | os.PathLike | None = None,
) -> grpc.ServerCredentials:
    """TLS for the syncer; with ``client_ca_file`` clients must present a certificate it signed."""
    pair = (_read(key_file, "TLS key"), _read(cert_file, "TLS certificate"))
    if client_ca_file:
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=_read(client_ca_file, "client CA"),
            require_client_auth=True,
        )
    return grpc.ssl_server_credentials([pair])


def channel_credentials(
    ca_file: str | os.PathLike | None,
    cert_file: str | os.PathLike | None = None,
    key_file: str | os.PathLike | None = None,
) -> grpc.ChannelCredentials:
    """TLS for a client: verify the server against ``ca_file`` (None: the system roots) and,
    for mutual TLS, present ``cert_file`` / ``key_file``."""
    if bool(cert_file) != bool(key_file):
        raise AuthConfigError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "TLS CA") if ca_file else None,
        private_key=_read(key_file, "TLS key") if key_file else None,
        certificate_chain=_read(cert_file, "TLS certificate") if cert_file else None,
    )


def client_link_options(
    *,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls: bool = False,
) -> dict:
    """Keyword arguments for ``SyncerLink`` (``credentials``, ``metadata``) from the client's
    settings. TLS is used when ``tls`` is set or any TLS file is given."""
    options: dict = {"metadata": call_metadata(token)}
    if tls or tls_ca or tls_cert or tls_key:
        options["credentials"] = channel_credentials(tls_ca, tls_cert, tls_key)
    return options


def open_channel(address: str, options: Mapping, channel_options=()) -> grpc.Channel:
    """A channel to ``address`` with ``client_link_options``' credentials (if any)."""
    creds = options.get("credentials")
    if creds is not None:
        return grpc.secure_channel(address, creds, options=list(channel_options))
    return grpc.insecure_channel(address, options=list(channel_options))


def learner_token(secret: str, learner_id: str) -> str:
    """Learner ``learner_id``'s own token for a syncer whose shared secret is ``secret``."""
    mac = hmac.new(secret.encode(), f"diloco learner {learner_id}".encode(), hashlib.sha256)
    return f"{LEARNER_TOKEN_PREFIX}{learner_id}.{mac.hexdigest()}"


VIEWER_TOKEN_PREFIX = "dv1."
"""Marks a viewer token (:func:`viewer_token`)."""


def viewer_token(secret: str) -> str:
    """The read-only token of the dashboard and ``/metrics`` of a syncer or run whose shared
    secret is ``secret``: it opens the pages and nothing else (the gRPC service refuses it)."""
    mac = hmac.new(secret.encode(), b"diloco viewer", hashlib.sha256)
    return f"{VIEWER_TOKEN_PREFIX}{mac.hexdigest()}"


def identity_of(presented: str, secret: str) -> str | None:
    """Who a presented token speaks for: ``SHARED`` for the shared secret, the learner id for
    a valid learner token, ``None`` for anything else (compared in constant time)."""
    if hmac.compare_digest(presented.encode(), secret.encode()):
        return SHARED
    if presented.startswith(LEARNER_TOKEN_PREFIX) and "." in presented[len(LEARNER_TOKEN_PREFIX) :]:
        learner_id = presented[len(LEARNER_TOKEN_PREFIX) :].rsplit(".", 1)[0]
        if learner_id and hmac.compare_digest(
            presented.encode(), learner_token(secret, learner_id).encode()
        ):
            return learner_id
    return None


def presented_token(metadata) -> str:
    """The bearer token in a call's metadata (empty when there is none)."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            text = value if isinstance(value, str) else bytes(value).decode("latin-1")
            return text[len("Bearer ") :] if text.startswith("Bearer ") else ""
    return ""


def caller_identity(metadata, secret: str | None) -> str | None:
    """``identity_of`` the call's token; ``SHARED`` when the syncer has no secret at all."""
    return SHARED if secret is None else identity_of(presented_token(metadata), secret)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if it carries ``authorization: Bearer <token>`` with the
    shared token or a learner token derived from it (:func:`learner_token`).

    A refused call is answered ``UNAUTHENTICATED`` without deserializing its request or
    running any handler; ``on_refuse(method, reason)`` is called (to write the event tape).
    """

    def __init__(self, token: str, on_refuse: Callable[[str, str], None] = lambda m, r: None):
        self._secret = token
        self._on_refuse = on_refuse

    def intercept_service(self, continuation, handler_call_details):
        metadata = handler_call_details.invocation_metadata or ()
        token = presented_token(metadata)
        if token and identity_of(token, self._secret) is not None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        reason = "wrong token" if any(k == METADATA_KEY for k, _ in metadata) else "missing token"
        self._on_refuse(handler_call_details.method, reason)
        return _refusing_handler(handler, f"{reason}: pass the syncer's shared token")


def _refusing_handler(handler, message: str):
    code = grpc.StatusCode.UNAUTHENTICATED

    def unary(_request, context):
        context.abort(code, message)

    def streaming(_request, context):
        context.abort(code, message)
        yield  # never reached; makes this a generator like the handler it replaces

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)

"""gRPC keepalive on both ends: how the syncer and a learner notice that the other is gone.

A peer that vanishes without closing its connection (a preempted VM, a NAT that dropped its
entry, a pulled cable) sends no FIN or RST: without pings its connection looks open until
TCP gives up retransmitting (about 15 minutes on Linux), and meanwhile the syncer keeps that
learner's stream and its thread, and the learner waits on a dead syncer. With keepalive each
end pings the other after ``PING_INTERVAL_MS`` without hearing from it and closes the
connection when a ping is not answered within ``PING_TIMEOUT_MS``: a dead peer is noticed
within 35 s, its calls fail and the learner reconnects (its backoff, ``docs/deploy.md`` "The
timeout model").

Pings go out also while no call is open and without data in between (a learner's control
connection is idle between heartbeats only for a second; its subscription may carry nothing
for minutes). A gRPC server answers pings that come more often than it allows with GOAWAY
``too_many_pings``, so the syncer allows them every ``MIN_PING_INTERVAL_MS``, well below the
learners' interval.
"""

from __future__ import annotations

PING_INTERVAL_MS = 15_000
"""Each end pings the other after this long without a ping (ms): 15 s costs a few bytes per
connection and finds a dead peer in time for the learner's lease-based recovery to matter
(the syncer already counts a silent learner out after its 5 s lease)."""
PING_TIMEOUT_MS = 20_000
"""An unanswered ping closes the connection after this long (ms). It applies to every ping,
also those gRPC sends to size its flow-control window while data flows, whose answer may
queue behind a full window of data on a slow link: far above a WAN round trip, so a slow
but live link is not cut."""
MIN_PING_INTERVAL_MS = 10_000
"""The syncer accepts pings this often (ms) without data between them: below the learners'
``PING_INTERVAL_MS`` with room for timer jitter, so it never answers GOAWAY too_many_pings."""


def client_options() -> list[tuple[str, int]]:
    """Channel options of a learner's connections to the syncer."""
    return [
        ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
        # how long gRPC waits for any ping's ack, the keepalive's included (measured with
        # grpcio 1.85: the keepalive timeout alone left a frozen peer's connection open 60 s)
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # no limit: the subscription may idle
    ]


def server_options() -> list[tuple[str, int]]:
    """Server options of the syncer: it pings its learners as they ping it, and accepts
    their pings (see the module docstring)."""
    return [
        *client_options(),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]

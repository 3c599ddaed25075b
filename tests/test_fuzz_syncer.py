"""Fuzz a running syncer (real gRPC, port 0) with hostile messages.

Every message here is invalid by construction: malformed, truncated, oversized, out of order,
from the future, non-finite, far too large, or carrying a wrong token. For each one the
syncer must answer (bounded wait) with the documented status (docs/security.md), write a
``refused`` record naming the code to its tape, and keep its state digest unchanged (versions,
Θ, outer state, the open round's contributions, the norm guard's history, the learner table).
"""

from __future__ import annotations

import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import Peer, join_request, upload_chunks
from torch import nn

from diloco.algorithm import balanced_fragments, codecs
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import CHUNK_BYTES, SyncerServer
from diloco.syncer.store import read_tape
from diloco.wire import auth
from diloco.wire import diloco_pb2 as pb

P = 3
TOKEN = "fuzz-token-0123456789abcdef"
MD = auth.call_metadata(TOKEN)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
Code = grpc.StatusCode
ASCII = st.characters(min_codepoint=32, max_codepoint=126)


LIDS = ("a", "b", "eval")
"""The harness's learners and its observer."""


class Harness:
    """A running syncer with two joined learners and one open round (so the digest covers
    a contribution), plus the helpers to send it things."""

    def __init__(self, tmp_path) -> None:
        torch.manual_seed(0)
        # Big enough that fragment 0 needs three ~1 MB chunks in fp32.
        model = nn.Sequential(nn.Linear(1024, 1600), nn.Linear(1600, 4))
        self.layout = balanced_fragments(model.named_parameters(), P)
        named = dict(model.named_parameters())
        params = [self.layout.gather(p, named) for p in range(P)]
        # The learners' schedule: the upload below opens a round, and no clock changes the
        # state between a hostile request and the digest taken after it.
        config = SyncerConfig(
            quorum=3,
            up_codec="fp32",
            lease_s=600,
            heartbeat_s=1,
            max_learner_ids=4,
            schedule="learner",
        )
        self.tape_path = tmp_path / "events.jsonl"
        self.server = SyncerServer(
            self.layout,
            params,
            config,
            state_dir=tmp_path / "state",
            tape_path=self.tape_path,
            token=TOKEN,
        ).start()
        size = 8 * CHUNK_BYTES
        options = [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
        ]
        self.peers = {lid: Peer(self.server, lid, token=TOKEN, options=options) for lid in LIDS}
        self.sessions = {
            lid: peer.join(observer=lid == "eval").session for lid, peer in self.peers.items()
        }
        self.channel, self.stub = self.peers["b"].channel, self.peers["b"].stub  # hostile calls
        ok = self.stub.Upload(iter(self.chunks(0, "a")), timeout=10, metadata=MD)
        assert ok.accepted and self.server.state.rounds  # a round is open, waiting for b

    def join_request(self, lid: str, observer: bool = False) -> pb.JoinRequest:
        return join_request(self.layout, lid, observer=observer)

    def payload(self, fragment: int, scale: float = 1e-4) -> bytes:
        n = self.layout.fragments[fragment].numel
        gen = torch.Generator().manual_seed(fragment)
        return codecs.encode(scale * torch.randn(n, generator=gen), "fp32")

    def chunks(self, frag: int, lid: str = "b", data: bytes | None = None, **override):
        header = dict(
            learner_id=lid,
            session=self.sessions.get(lid, "nope"),
            fragment=frag,
            base_version=0,
            steps=24,
            tokens=24 * 64,
            codec="fp32",
            numel=self.layout.fragments[frag].numel,
            step_time_s=0.1,
        )
        data = self.payload(frag) if data is None else data
        return upload_chunks(data, chunk_bytes=CHUNK_BYTES, **{**header, **override})

    def refused_codes(self) -> list[str]:
        return [r["code"] for r in read_tape(self.tape_path) if r["event"] == "refused"]

    def expect_refusal(self, call, codes: set[grpc.StatusCode]) -> None:
        """``call`` fails with one of ``codes``, the tape says so, and nothing changed."""
        before = self.server.service.state_digest()
        taped = len(self.refused_codes())
        with pytest.raises(grpc.RpcError) as info:
            call()
        code = info.value.code()
        assert code in codes, (code, info.value.details())
        assert info.value.details()  # a message that says why
        assert self.server.service.state_digest() == before
        if code != Code.INTERNAL:  # INTERNAL: gRPC could not parse the bytes; no handler ran
            assert self.refused_codes()[taped:] == [code.name]
        # Still serving, promptly.
        status = self.stub.Status(pb.StatusRequest(), timeout=5, metadata=MD)
        assert len(status.versions) == P

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.server.stop()


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.close()


def upload(h: Harness, chunks, metadata=MD):
    return lambda: h.stub.Upload(iter(chunks), timeout=10, metadata=metadata)


def _put(data: bytes, index: int, value: bytes) -> bytes:
    index = index % (len(data) // 4) * 4
    return data[:index] + value + data[index + 4 :]


# Each mutation turns a valid upload of fragment ``p`` by learner b into an invalid one and
# names the status the syncer must answer with.
int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
MUTATIONS = st.one_of(
    st.tuples(st.just("fragment"), int32.filter(lambda f: not 0 <= f < P)),
    st.tuples(st.just("numel"), int64),
    st.tuples(st.just("codec"), st.text(max_size=20).filter(lambda c: c != "fp32")),
    st.tuples(
        st.just("steps"), st.one_of(st.integers(-(2**63), 0), st.integers(2**24 + 1, 2**63 - 1))
    ),
    st.tuples(
        st.just("tokens"), st.one_of(st.integers(-(2**63), 0), st.integers(2**48, 2**63 - 1))
    ),
    st.tuples(
        st.just("step_time_s"),
        st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=3600), st.just(float("nan"))),
    ),
    st.tuples(
        st.just("base_version"),
        st.one_of(st.integers(-(2**63), -1), st.integers(1, 2**63 - 1)),
    ),
    st.tuples(st.just("session"), st.text(max_size=40)),
    st.tuples(st.just("learner_id"), st.text(max_size=80)),
    st.tuples(st.just("observer"), st.none()),
    st.tuples(st.just("truncate"), st.integers(1, 10_000)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(
        st.just("non_finite"),
        st.tuples(st.integers(0, 10**6), st.sampled_from(["nan", "inf", "-inf"])),
    ),
    st.tuples(st.just("huge"), st.floats(1e3, 1e30)),
    st.tuples(st.just("num_chunks"), st.integers(-5, 100)),
    st.tuples(st.just("reorder"), st.permutations(range(3))),
    st.tuples(st.just("duplicate"), st.integers(0, 2)),
    st.tuples(
        st.just("header_drift"), st.sampled_from(["steps", "tokens", "base_version", "fragment"])
    ),
    st.tuples(st.just("oversized_chunk"), st.integers(1, 1024)),
    st.tuples(st.just("final_fragments"), st.lists(int32, min_size=1, max_size=40)),
    st.tuples(st.just("empty"), st.none()),
    st.tuples(st.just("token"), st.text(alphabet=ASCII, max_size=40)),
)


def mutate(h: Harness, kind: str, value):
    """(chunks, metadata, expected codes) for one mutation of fragment 0's upload by b."""
    p = 0  # fragment 0 spans several chunks
    codes = {Code.INVALID_ARGUMENT}
    chunks = h.chunks(p)
    if kind in ("fragment", "numel", "codec", "steps", "tokens", "step_time_s", "base_version"):
        if kind == "numel" and value == chunks[0].numel:
            value += 1
        if kind == "base_version" and value == 0:
            value = -1
        chunks = h.chunks(p, **{kind: value})
    elif kind == "session":
        chunks = h.chunks(p, session=value if value != h.sessions["b"] else value + "x")
        codes = {Code.FAILED_PRECONDITION}
    elif kind == "learner_id":
        lid = value if value != "b" else "c"
        chunks = h.chunks(p, lid=lid, session=h.sessions["b"])
        codes = {Code.FAILED_PRECONDITION}
    elif kind == "observer":
        chunks = h.chunks(p, lid="eval")
        codes = {Code.PERMISSION_DENIED}
    elif kind == "truncate":
        data = h.payload(p)
        chunks = h.chunks(
            p, data=data[: max(0, len(data) - value)], num_chunks=chunks[0].num_chunks
        )
    elif kind == "extend":
        chunks = h.chunks(p, data=h.payload(p) + value, num_chunks=chunks[0].num_chunks)
    elif kind == "non_finite":
        index, what = value
        bad = struct.pack("<f", float(what))
        chunks = h.chunks(p, data=_put(h.payload(p), index, bad))
    elif kind == "huge":
        chunks = h.chunks(p, data=h.payload(p, scale=value))
        codes = {Code.OUT_OF_RANGE, Code.INVALID_ARGUMENT}  # INVALID: overflowed to Inf
    elif kind == "num_chunks":
        if value == chunks[0].num_chunks:
            value += 1
        chunks = [pb.UploadChunk(**{**_fields(c), "num_chunks": value}) for c in chunks]
    elif kind == "reorder":
        order = list(value) if list(value) != sorted(value) else [1, 0, 2]
        chunks = [chunks[i] for i in order if i < len(chunks)]
    elif kind == "duplicate":
        chunks = chunks[: value + 1] + chunks[value : value + 1] + chunks[value + 1 :]
    elif kind == "header_drift":
        last = _fields(chunks[-1])
        last[value] = last[value] + 1
        chunks = chunks[:-1] + [pb.UploadChunk(**last)]
    elif kind == "oversized_chunk":
        data = h.payload(p)
        first = data[: CHUNK_BYTES + value]
        rest = data[CHUNK_BYTES + value :]
        pieces = [first] + [rest[i : i + CHUNK_BYTES] for i in range(0, len(rest), CHUNK_BYTES)]
        head = {k: v for k, v in _fields(chunks[0]).items() if k not in ("data", "chunk_index")}
        chunks = [
            pb.UploadChunk(**{**head, "chunk_index": i, "data": piece, "num_chunks": len(pieces)})
            for i, piece in enumerate(pieces)
        ]
    elif kind == "final_fragments":  # names out of range, twice, too many, or not final
        valid = len(set(value)) == len(value) <= P and all(0 <= f < P for f in value)
        chunks = h.chunks(p, final=not valid, final_fragments=value)
    elif kind == "empty":
        chunks = []
    elif kind == "token":
        return chunks, (("authorization", value),), {Code.UNAUTHENTICATED}
    return chunks, MD, codes


def _fields(chunk: pb.UploadChunk) -> dict:
    return {f.name: getattr(chunk, f.name) for f in chunk.DESCRIPTOR.fields}


@pytest.mark.timeout(240)
@FUZZ
@given(mutation=MUTATIONS)
def test_hostile_uploads_are_refused_and_change_nothing(syncer, mutation):
    chunks, metadata, codes = mutate(syncer, *mutation)
    syncer.expect_refusal(upload(syncer, chunks, metadata), codes)


JOIN_MUTATIONS = st.one_of(
    st.tuples(st.just("learner_id"), st.text(max_size=100)),
    st.tuples(st.just("layout_hash"), st.text(max_size=64)),
    st.tuples(st.just("num_fragments"), int32),
    st.tuples(st.just("drop_tensor"), st.integers(0, 3)),
    st.tuples(st.just("shape"), st.lists(st.integers(-(2**40), 2**40), max_size=5)),
    st.tuples(st.just("dtype"), st.text(max_size=12)),
    st.tuples(st.just("name"), st.text(max_size=2000)),
    st.tuples(st.just("new_ids"), st.integers(3, 6)),
)


@pytest.mark.timeout(240)
@FUZZ
@given(mutation=JOIN_MUTATIONS)
def test_hostile_joins_are_refused_and_change_nothing(syncer, mutation):
    kind, value = mutation
    req = syncer.join_request("z")
    codes = {Code.FAILED_PRECONDITION}
    if kind == "learner_id":
        req.learner_id = value
        # Bad ids are INVALID_ARGUMENT; a good one still carries the wrong layout below.
        req.layout_hash = "0" * 16
        codes = {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}
    elif kind == "layout_hash":
        req.layout_hash = value if value != syncer.layout.hash else value + "0"
    elif kind == "num_fragments":
        req.num_fragments = value if value != P else P + 1
    elif kind == "drop_tensor":
        del req.tensors[value % len(req.tensors)]
    elif kind == "shape":
        if list(req.tensors[0].shape) == value:
            value = [*value, 1]
        req.tensors[0].shape[:] = value
    elif kind == "dtype":
        req.tensors[0].dtype = value if value != req.tensors[0].dtype else value + "x"
    elif kind == "name":
        req.tensors[1].name = value if value != req.tensors[1].name else value + "x"
    elif kind == "new_ids":
        # The table is full (max_learner_ids = 4: a, b, eval + one spare): a valid join of a
        # brand-new id beyond it is refused, a rejoin of a known id is not (not sent here).
        if len(syncer.server.state.learners) < 4:
            syncer.stub.Join(syncer.join_request("spare"), timeout=5, metadata=MD)
        req = syncer.join_request(f"new-{value}")
        codes = {Code.RESOURCE_EXHAUSTED}
    syncer.expect_refusal(lambda: syncer.stub.Join(req, timeout=5, metadata=MD), codes)


@pytest.mark.timeout(240)
@FUZZ
@given(
    session=st.text(max_size=40),
    have=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=P + 1, max_size=50),
)
def test_hostile_subscriptions_are_refused(syncer, session, have):
    if session == syncer.sessions["b"]:
        session += "x"

    def subscribe(req):
        return lambda: list(syncer.stub.Subscribe(req, timeout=5, metadata=MD))

    unknown = pb.SubscribeRequest(learner_id="b", session=session)
    syncer.expect_refusal(subscribe(unknown), {Code.FAILED_PRECONDITION})
    too_many = pb.SubscribeRequest(learner_id="b", session=syncer.sessions["b"], have_versions=have)
    syncer.expect_refusal(subscribe(too_many), {Code.INVALID_ARGUMENT})


METHODS = ["Join", "Upload", "Subscribe", "Heartbeat", "Leave", "Status"]


@pytest.mark.timeout(240)
@FUZZ
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=512), good_token=st.booleans())
def test_raw_bytes_never_crash_or_change_anything(syncer, method, raw, good_token):
    """Arbitrary bytes as a request of any method: a documented status, never a crash."""
    path = f"/diloco.v1.Syncer/{method}"
    identity = lambda b: b  # noqa: E731
    md = MD if good_token else ()
    before = syncer.server.service.state_digest()
    if method == "Upload":
        call = syncer.channel.stream_unary(path, request_serializer=identity)
        do = lambda: call(iter([raw, raw]), timeout=5, metadata=md)  # noqa: E731
    elif method == "Subscribe":
        call = syncer.channel.unary_stream(path, request_serializer=identity)
        do = lambda: list(call(raw, timeout=5, metadata=md))  # noqa: E731
    else:
        call = syncer.channel.unary_unary(path, request_serializer=identity)
        do = lambda: call(raw, timeout=5, metadata=md)  # noqa: E731
    allowed = {
        Code.INTERNAL,  # not a protobuf message of that type: gRPC refuses it, no handler runs
        Code.INVALID_ARGUMENT,
        Code.FAILED_PRECONDITION,
        Code.UNAUTHENTICATED,
        Code.PERMISSION_DENIED,
    }
    try:
        do()
    except grpc.RpcError as exc:
        assert exc.code() in allowed, (exc.code(), exc.details())
        if not good_token:
            assert exc.code() == Code.UNAUTHENTICATED
    else:
        # Only requests that are harmless when well-formed may succeed: an unknown session's
        # heartbeat (answered known=False), its leave (ignored) and the read-only status.
        assert good_token and method in ("Heartbeat", "Leave", "Status"), method
    assert syncer.server.service.state_digest() == before
    assert syncer.stub.Status(pb.StatusRequest(), timeout=5, metadata=MD).versions


def test_a_valid_upload_does_change_the_digest(syncer):
    """The digest is not blind: the same harness sees a real contribution."""
    before = syncer.server.service.state_digest()
    reply = syncer.stub.Upload(iter(syncer.chunks(2, "b")), timeout=10, metadata=MD)
    assert reply.accepted
    assert syncer.server.service.state_digest() != before

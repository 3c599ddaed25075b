"""What a syncer's stream queues for its learner: deltas while it keeps up, a chain of deltas
while it is a little behind, one keyframe when the chain would outweigh it."""

from __future__ import annotations

import torch

from diloco.algorithm import codecs
from diloco.syncer.broadcast import KEYFRAME_CODEC, Keyframe, Subscriber

NUMEL = 100  # a keyframe is 400 bytes
DELTA = b"d" * 103  # an int8 delta of 100 values: 100 codes and one block scale


def offer(sub: Subscriber, version: int, who: str = "a") -> None:
    sub.offer(
        0,
        version,
        keyframe=Keyframe(torch.full((NUMEL,), float(version))),
        delta=DELTA,
        delta_codec="int8",
        contributors=frozenset({who}),
    )


def sent(sub: Subscriber) -> list[tuple[int, int]]:
    """(version, base version) of each fragment-0 item the stream sends now."""
    _, items = sub.take(timeout=0)
    return [(item.version, item.base_version) for item in items]


def test_a_stream_that_keeps_up_gets_every_version_as_its_delta():
    sub = Subscriber("l0", "s", False, held={0: 0})
    for v in (1, 2, 3):
        offer(sub, v)
        assert sent(sub) == [(v, v - 1)]
    assert sub.held[0] == 3


def test_a_stream_behind_gets_a_chain_of_deltas_then_one_keyframe():
    sub = Subscriber("l0", "s", False, held={0: 0})
    for v, who in ((1, "a"), (2, "b"), (3, "c")):
        offer(sub, v, who)
    _, items = sub.take(timeout=0)  # 3 deltas (309 bytes) weigh less than a keyframe (400)
    assert [(i.version, i.base_version, i.codec) for i in items] == [
        (1, 0, "int8"),
        (2, 1, "int8"),
        (3, 2, "int8"),
    ]
    assert [i.contributors for i in items] == [{"a"}, {"b"}, {"c"}]
    assert sub.held[0] == 3
    for v, who in ((4, "a"), (5, "b"), (6, "c"), (7, "d")):
        offer(sub, v, who)  # the fourth delta would make 412 bytes: the keyframe of 7
    _, items = sub.take(timeout=0)
    assert len(items) == 1
    keyframe = items[0]
    assert (keyframe.version, keyframe.base_version, keyframe.codec) == (7, -1, KEYFRAME_CODEC)
    assert keyframe.contributors == {"a", "b", "c", "d"}  # the skipped versions' merges
    assert torch.equal(
        codecs.decode(keyframe.payload, NUMEL, KEYFRAME_CODEC), torch.full((NUMEL,), 7.0)
    )


def test_a_pending_keyframe_is_superseded_by_the_next_one():
    sub = Subscriber("l0", "s", False, held={})  # holds nothing of fragment 0: keyframes only
    offer(sub, 1, "a")
    offer(sub, 2, "b")
    assert sent(sub) == [(2, -1)]
    offer(sub, 3, "c")  # it holds 2 now: a delta
    assert sent(sub) == [(3, 2)]


def test_a_delta_follows_a_confirmation_and_a_gap_needs_a_keyframe():
    sub = Subscriber("l0", "s", False, held={})
    sub.confirm(0, 4)  # it holds version 4's value already
    offer(sub, 5)
    _, items = sub.take(timeout=0)
    assert [(i.version, i.base_version, i.unchanged) for i in items] == [
        (4, -1, True),
        (5, 4, False),
    ]
    assert items[0].payload == b""
    offer(sub, 7)  # version 6 never reached this stream: only a keyframe fits
    assert sent(sub) == [(7, -1)]


def test_a_keyframe_is_encoded_once_and_only_when_asked_for():
    values = torch.arange(NUMEL, dtype=torch.float32)
    keyframe = Keyframe(values)
    assert keyframe._payload is None and keyframe.nbytes == 4 * NUMEL
    payload = keyframe.payload
    assert keyframe.payload is payload and len(payload) == keyframe.nbytes
    assert torch.equal(codecs.decode(payload, NUMEL, KEYFRAME_CODEC), values)

"""A commit's passes split over threads (diloco.algorithm.chunk_threads) give the bits of
one thread: the merge, the outer step and the down step, against the whole-tensor
functions, at 1, 2 and 3 threads."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.algorithm import chunk_threads, codecs, streaming
from diloco.algorithm.fragments import balanced_fragments
from diloco.algorithm.merge import is_embedding_name, merge_contributions
from diloco.algorithm.outer import NesterovOuter

CHUNK = 2 * codecs.ALIGN_VALUES
"""Small chunks: a few thousand values make many of them, and a partial last one."""


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    chunk_threads.set_threads(request.param)
    try:
        yield request.param
    finally:
        chunk_threads.set_threads(1)


def whole_tensor_outer_step(params, delta, buf, lr, mu):
    """The outer step on whole tensors, as it was written before it was chunked."""
    if mu == 0.0:
        params.sub_(delta, alpha=lr)
        return
    buf.mul_(mu).add_(delta)
    params.sub_(delta, alpha=lr).sub_(buf, alpha=lr * mu)


def test_every_chunk_is_visited_once_and_the_groups_run_at_once(threads):
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    size = -(-11 // threads)  # chunks per group
    together = threading.Barrier(threads, timeout=60)

    def visit(a, b):
        if a % (size * 1000) == 0:
            together.wait()  # every group's first chunk: all the groups are running at once
        with lock:
            seen.append((a, b))

    chunk_threads.for_each_chunk(10_001, 1000, visit)
    assert sorted(seen) == [(a, min(10_001, a + 1000)) for a in range(0, 10_001, 1000)]
    assert chunk_threads.map_whole(lambda x: x * x, [1, 2, 3, 4, 5]) == [1, 4, 9, 16, 25]


def test_the_first_failing_chunk_is_raised_whatever_the_thread_count(threads):
    def fail(a, b):
        raise ValueError(f"chunk {a}")

    with pytest.raises(ValueError, match=r"chunk 0$"):
        chunk_threads.for_each_chunk(6000, 1000, fail)

    def fail_late(a, b):
        if a >= 4000:
            raise ValueError(f"chunk {a}")

    with pytest.raises(ValueError, match=r"chunk 4000$"):
        chunk_threads.for_each_chunk(6000, 1000, fail_late)


def test_a_pass_running_while_the_count_changes_ends_whole():
    chunk_threads.set_threads(3)
    started, go = threading.Event(), threading.Event()
    seen = []

    def visit(a, b):
        if a == 0:
            started.set()
            go.wait(30)
        seen.append(a)

    try:
        runner = threading.Thread(target=chunk_threads.for_each_chunk, args=(6000, 1000, visit))
        runner.start()
        assert started.wait(30)
        chunk_threads.set_threads(1)
        go.set()
        runner.join(30)
        assert sorted(seen) == list(range(0, 6000, 1000))
    finally:
        chunk_threads.set_threads(1)


def test_a_failing_chunk_raises_after_every_group_has_ended(threads):
    ended = []

    def visit(a, b):
        if a == 0:
            raise ValueError("chunk 0")
        ended.append(a)

    with pytest.raises(ValueError, match="chunk 0"):
        chunk_threads.for_each_chunk(6000, 1000, visit)
    # the caller's group (the first chunks) stops at its failure; the others ran to their end
    first_group = -(-6 // threads)
    assert set(ended) == set(range(first_group * 1000, 6000, 1000))


@pytest.mark.parametrize("mu", [0.0, 0.7])
@pytest.mark.parametrize("numel", [1, 4099, 3 * streaming.CHUNK_VALUES + 17])
def test_the_outer_step_split_over_threads_is_the_whole_tensor_step(threads, mu, numel):
    gen = torch.Generator().manual_seed(numel)
    params = torch.randn(numel, generator=gen)
    outer = NesterovOuter(lr=0.6, momentum=mu)
    want, want_buf = params.clone(), torch.zeros(numel)
    for _ in range(3):
        delta = torch.randn(numel, generator=gen)
        outer.step(0, params, delta)
        whole_tensor_outer_step(want, delta, want_buf, 0.6, mu)
        assert torch.equal(params, want)
    if mu:
        assert torch.equal(outer.buffer(0), want_buf)


def test_the_merge_split_over_threads_is_the_whole_tensor_merge(threads):
    shapes = {"emb.weight": (301, 17), "a.weight": (1000, 9), "b.weight": (4099,), "c.bias": (7,)}
    layout = balanced_fragments([(n, torch.empty(s, device="meta")) for n, s in shapes.items()], 3)
    gen = torch.Generator().manual_seed(5)
    for fragment in layout.fragments:
        deltas = [torch.randn(fragment.numel, generator=gen) for _ in range(4)]
        weights = [float(w) for w in torch.rand(4, generator=gen) + 0.1]
        want = merge_contributions(deltas, weights, fragment) * 0.37
        got = streaming.merge_into(
            torch.empty(fragment.numel), deltas, weights, 0.37, fragment, is_embedding_name,
            chunk=CHUNK,
        )  # fmt: skip
        assert torch.equal(got, want)


@pytest.mark.parametrize("codec", ["int2", "int8", "sign1", "fp32"])
def test_the_down_step_split_over_threads_gives_the_whole_tensor_bytes(threads, codec):
    gen = torch.Generator().manual_seed(11)
    numel = 5 * CHUNK + 300
    params, wire = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    payload, after = streaming.down_step(params, wire, codec, chunk=CHUNK)
    want = codecs.encode(params - wire, codec)
    assert payload == want
    assert torch.equal(after, wire + codecs.decode(want, numel, codec))


def test_a_bad_thread_count_is_refused():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="whole number"):
            chunk_threads.set_threads(bad)
    assert chunk_threads.threads() == 1

"""What the syncer holds beyond Θ_p, its momentum and W_p (docs/architecture.md, "What the
syncer holds, per parameter")."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from kit import Peer, join_state, local_syncer, syncer_state, tiny_model

from diloco.algorithm import codecs
from diloco.algorithm.encoded_delta import EncodedDelta
from diloco.runtime.memory import HUGE_PAGES_ENV, release_large_frees
from diloco.syncer.broadcast import Keyframe
from diloco.syncer.config import SyncerConfig
from diloco.syncer.records import copied


@pytest.mark.skipif(sys.byteorder != "little", reason="a view needs the wire's byte order")
def test_a_keyframe_payload_is_the_wire_image_itself_not_a_copy():
    values = torch.randn(1 << 20)
    keyframe = Keyframe(values)
    tracemalloc.start()
    try:
        payload = keyframe.payload
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < values.numel()  # (a copy would be 4 bytes per value)
    assert bytes(payload) == codecs.encode(values, "fp32")
    assert len(payload) == keyframe.nbytes
    assert keyframe.payload is payload  # made once


def test_a_keyframe_of_non_finite_values_is_refused_as_the_codec_refuses_it():
    with pytest.raises(codecs.NonFiniteError):
        Keyframe(torch.tensor([1.0, float("nan")])).payload  # noqa: B018


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_frees_go_back_to_the_system_on_linux():
    assert release_large_frees() is True


def transparent_huge_pages_mode() -> str:
    """The kernel's mode (``always``, ``madvise`` or ``never``; ``""`` without the file)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


@pytest.mark.skipif(
    transparent_huge_pages_mode() != "madvise",
    reason="only a kernel in madvise mode tells whether torch asked for huge pages",
)
def test_the_syncers_large_tensors_are_backed_by_huge_pages():
    """A fresh fragment-sized buffer costs one page fault per 4 KB without them (see
    ``runtime.memory.huge_pages_for_large_tensors``): what ``diloco syncer`` sets up before
    it builds anything gives a 64 MB tensor huge pages."""
    child = (
        "import sys, torch\n"
        "from diloco.runtime.memory import tune_for_large_tensors\n"
        "if sys.argv[1] == 'tuned': tune_for_large_tensors()\n"
        "held = torch.ones(16 << 20)\n"
        "rollup = open('/proc/self/smaps_rollup').read()\n"
        "print(int(rollup.split('AnonHugePages:')[1].split()[0]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV}

    def huge_kb(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", child, mode], env=env, text=True,
                              capture_output=True, timeout=120, check=True)  # fmt: skip
        return int(done.stdout.split()[-1])

    assert huge_kb("tuned") >= 32 << 10, "the 64 MB tensor has under 32 MB of huge pages"
    assert huge_kb("untuned") == 0  # (the test can tell)


def test_a_commit_carries_the_models_own_values_not_copies():
    """A commit hands the committer Θ_p and its momentum themselves (a copy per commit is
    8 bytes per value of the fragment); a background snapshot gets copies."""
    config = SyncerConfig(schedule="learner", norm_guard_k=0.0, outer_momentum=0.7, quorum=1)
    state, layout, _ = syncer_state(tiny_model(0, (4, 4, 2), tanh=False), config, num_fragments=2)
    session = join_state(state, "a")
    n = layout.fragments[0].numel
    state.submit(
        "a",
        session,
        fragment=0,
        base_version=0,
        steps=2,
        tokens=10,
        delta=torch.full((n,), 0.5),
        step_time_s=1.0,
        nbytes=4 * n,
        now=1.0,
    )
    (commit,) = state.poll(5.0, wait_for_finals=False)[0]
    assert commit.params.data_ptr() == state.params[0].data_ptr()
    assert commit.momentum["momentum"].data_ptr() == state.outer.buffer(0).data_ptr()
    copy = copied(commit)
    assert copy.params.data_ptr() != commit.params.data_ptr()
    assert torch.equal(copy.params, commit.params)
    assert torch.equal(copy.momentum["momentum"], commit.momentum["momentum"])


def test_an_admitted_upload_waits_for_its_commit_as_it_arrived_not_decoded():
    """The syncer holds each upload of an open round as its payload (``EncodedDelta``: 0.156
    bytes per value in sign1), not decoded (4 bytes per value): at 1B parameters, P = 24
    and M = 4 the open rounds held 8 to 12 decoded uploads, 1.3-2 bytes per parameter."""
    config = SyncerConfig(schedule="learner", wait_for_all=2, norm_guard_k=0.0, up_codec="sign1")
    server = local_syncer(tiny_model(0, (64, 64, 4), tanh=False), config, num_fragments=2)
    peer = Peer(server, "a")
    try:
        peer.join()
        n = server.layout.fragments[0].numel
        delta = torch.randn(n, generator=torch.Generator().manual_seed(0))
        assert peer.upload(0, delta, upload_id=1).accepted  # (b never sends: the round waits)
        with server.service.lock:
            held = server.state.rounds[0].contributions["a"]
        assert isinstance(held.delta, EncodedDelta)
        assert held.delta.nbytes == codecs.encoded_nbytes(n, "sign1") < n
        want = codecs.decode(codecs.encode(delta, "sign1"), n, "sign1")
        assert torch.equal(held.delta.decoded(), want)
        assert held.norm == pytest.approx(float(want.norm()), rel=1e-6)
    finally:
        peer.close()
        server.stop()


def test_an_encoded_upload_is_refused_as_its_decoded_tensor_was_even_without_the_norm_guard():
    """Kept as it arrived, an upload is still refused where its decoded tensor was: a norm
    past float32's range (the decoded tensor's norm overflowed to inf, which the guard
    refuses even when it is off) and a payload that does not decode (``Refused``, not a
    codec error, when the caller left the norm to ``submit``)."""
    from diloco.syncer.records import Refused

    config = SyncerConfig(schedule="learner", norm_guard_k=0.0, quorum=2)
    state, layout, _ = syncer_state(tiny_model(0, (64, 64, 4), tanh=False), config, num_fragments=2)
    session = join_state(state, "a")
    n = layout.fragments[0].numel
    huge = codecs.encode(torch.full((n,), 3e18), "sign1")  # ‖·‖ ≈ 3e18·√n: past 1.8e19
    assert float(codecs.decode(huge, n, "sign1").norm()) == float("inf")
    bad = bytearray(codecs.encode(torch.ones(n), "sign1"))
    bad[0:4] = bytes.fromhex("0000c07f")  # a NaN scale
    for payload, why in ((huge, "norm"), (bytes(bad), "cannot decode")):
        delta = EncodedDelta([("sign1", payload)], n)
        with pytest.raises(Refused, match=why):
            state.submit("a", session, fragment=0, base_version=0, steps=2, tokens=10,
                         delta=delta, step_time_s=1.0, nbytes=len(payload), now=1.0)  # fmt: skip
    assert state.rounds.get(0) is None or not state.rounds[0].contributions

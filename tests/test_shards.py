"""Syncer shards: the assignment rule, and S = 2 real syncer servers with 2 learners (loopback).

The servers are real ``SyncerServer`` instances (gRPC on 127.0.0.1:0) in this process; the
learners are real ``Learner`` objects on the tiny recipe, trained in threads.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from kit import current_fragments, join_request, run_diloco_json, train_in_threads, wait_until

from diloco.algorithm import balanced_fragments, codecs
from diloco.algorithm.shards import (
    ShardError,
    ShardInfo,
    check_cover,
    parse_shard,
    shard_fragments,
    shard_of,
)
from diloco.cli import main as cli_main
from diloco.launch.evaluator import Evaluator
from diloco.learner.learner import Learner
from diloco.learner.shards import parse_syncer_addresses
from diloco.recipes import get_recipe
from diloco.report.audit_files import audit_directories
from diloco.syncer.config import SyncerConfig
from diloco.syncer.server import SyncerServer
from diloco.syncer.store import FragmentStore, StateError, read_tape
from diloco.wire import diloco_pb2 as pb
from diloco.wire import diloco_pb2_grpc as pb_grpc

P = 4
H = 4
RECIPE = get_recipe("tiny")


# ------------------------------------------------------------------ pure functions
@pytest.mark.parametrize("num_fragments", [1, 2, 5, 24])
def test_assignment_covers_every_fragment_exactly_once(num_fragments):
    for S in range(1, num_fragments + 1):
        owned = [shard_fragments(num_fragments, i, S) for i in range(S)]
        flat = sorted(p for frags in owned for p in frags)
        assert flat == list(range(num_fragments)), S
        assert all(frags for frags in owned)  # no shard is empty
        assert max(map(len, owned)) - min(map(len, owned)) <= 1  # balanced counts
        for i, frags in enumerate(owned):
            assert all(shard_of(p, S) == i for p in frags)
        infos = [ShardInfo(f"h{i}", tuple(f), i, S) for i, f in enumerate(owned)]
        owner = check_cover(num_fragments, infos)
        assert [shard_of(p, S) for p in range(num_fragments)] == owner


def test_assignment_refuses_bad_shards():
    with pytest.raises(ShardError, match=r"\[1, P=4\]"):
        shard_fragments(4, 0, 5)
    with pytest.raises(ShardError, match="shard index"):
        shard_fragments(4, 2, 2)
    assert parse_shard("1/3") == (1, 3)
    for bad in ["", "1", "2/2", "-1/2", "a/b", "0/0", "1/2/3"]:
        with pytest.raises(ShardError, match="expected I/S"):
            parse_shard(bad)


def test_check_cover_says_what_is_wrong():
    s0 = ShardInfo("a:1", (0, 2), 0, 2)
    s1 = ShardInfo("b:2", (1, 3), 1, 2)
    with pytest.raises(ShardError, match=r"missing shard\(s\) \[1\] of 2.*--syncer"):
        check_cover(P, [s0])
    with pytest.raises(ShardError, match="owned by both"):
        check_cover(P, [s0, s1, ShardInfo("c:3", (0, 2), 0, 2)])
    with pytest.raises(ShardError, match="different shard splits"):
        check_cover(P, [s0, ShardInfo("c:3", (1,), 1, 3)])
    with pytest.raises(ShardError, match="outside"):
        check_cover(P, [ShardInfo("a:1", (0, 1, 2, 3, 4), 0, 1)])
    assert check_cover(P, [s1, s0]) == [1, 0, 1, 0]


def test_address_lists_are_validated():
    assert parse_syncer_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert parse_syncer_addresses(["a:1"]) == ["a:1"]
    for bad in ["", "a:1,", ["a:1", " "], []]:
        with pytest.raises(ValueError, match="empty entry"):
            parse_syncer_addresses(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_syncer_addresses("a:1,a:1")
    assert parse_syncer_addresses("[::1]:7000") == ["[::1]:7000"]
    for bad in ["localhost", "localhost:", ":7000", "h:0", "h:65536", "h:x"]:
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            parse_syncer_addresses(bad)


# ------------------------------------------------------------------- real servers
def make_shard(tmp_path, shard: tuple[int, int], *, fragments: int = P) -> SyncerServer:
    model = RECIPE.build_model(0)
    layout = balanced_fragments(model.named_parameters(), fragments)
    named = dict(model.named_parameters())
    params = [layout.gather(p, named) for p in range(layout.num_fragments)]
    config = SyncerConfig(
        quorum=1, up_codec="fp32", down_codec="fp32", lease_s=2.0, heartbeat_s=0.2
    )
    name = f"shard{shard[0]}of{shard[1]}" + (f"-p{fragments}" if fragments != P else "")
    return SyncerServer(
        layout,
        params,
        config,
        shard=shard,
        state_dir=tmp_path / name,
        tape_path=tmp_path / f"{name}.jsonl",
    )


def train(learner: Learner, model, index: int, steps: int) -> None:
    stream = RECIPE.stream(learner_id=index, seed=0)
    opt = RECIPE.build_optimizer(model)
    for _ in range(steps):
        x, y = stream.next_batch()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        learner.step(tokens=x.numel())


@pytest.mark.timeout(60)
def test_two_shards_two_learners_end_with_the_union_of_the_shards(tmp_path):
    shards = [make_shard(tmp_path, (i, 2)).start() for i in range(2)]
    learners: list[Learner] = []
    evaluator = None
    try:
        addresses = [s.address for s in shards]
        models = [RECIPE.build_model(seed=10 + i) for i in range(2)]
        learners = [
            Learner(m, syncer=addresses if i == 0 else ",".join(addresses), num_fragments=P,
                    learner_id=f"l{i}")
            for i, m in enumerate(models)
        ]  # fmt: skip
        for lr in learners:
            assert lr.wait_for_global(timeout=15)

        def owner(p: int) -> SyncerServer:
            return shards[p % 2]

        # The global model (the union of the shards) replaced each learner's own init.
        for m in models:
            named = dict(m.named_parameters())
            for p in range(P):
                assert torch.equal(owner(p).layout.gather(p, named), owner(p).state.params[p])
        train_in_threads(train, learners, models, 24)
        for lr in learners:
            assert lr.flush(timeout=10)
        wait_until(
            lambda: (
                all(owner(p).state.versions[p] >= 1 for p in range(P))
                and not any(s.state.rounds for s in shards)
            ),
            10,
            "every fragment to commit on its owner",
        )

        def synced() -> bool:
            for lr in learners:
                lr.apply_arrived()
            want = [owner(p).state.versions[p] for p in range(P)]
            return all(lr.versions == want for lr in learners)

        wait_until(synced, 10, "learners to receive the final versions")
        for lr, m in zip(learners, models, strict=True):
            named = dict(m.named_parameters())
            for p in range(P):  # what learners hold is the wire image, bit for bit
                assert torch.equal(
                    owner(p).layout.gather(p, named), owner(p).service.committer.wire(p)
                )
            assert lr.stats["bytes_up"] > 0 and lr.stats["uploads_refused"] == 0
        # A fragment a shard does not own never moves there.
        for i, s in enumerate(shards):
            assert all(s.state.versions[p] == 0 for p in range(P) if p % 2 != i)
        # An observer reading both shards sees the same global model.
        evaluator = Evaluator(RECIPE, addresses, seed=0, num_fragments=P)
        want = [owner(p).state.versions[p] for p in range(P)]
        assert evaluator.wait_for_versions(want, timeout=10)
        loss, versions = evaluator.evaluate()
        assert versions == want and loss > 0
        named = dict(evaluator.model.named_parameters())
        for p in range(P):
            assert torch.equal(owner(p).layout.gather(p, named), owner(p).service.committer.wire(p))
    finally:
        if evaluator is not None:
            evaluator.close()
        for lr in learners:
            lr.close(flush=False)
        for s in shards:
            s.stop()
    for i in range(2):
        tape = read_tape(tmp_path / f"shard{i}of2.jsonl")
        rounds = [r for r in tape if r["event"] == "round"]
        assert rounds, f"shard {i} never advanced"
        assert {r["fragment"] for r in rounds} == {p for p in range(P) if p % 2 == i}
        assert tape[0]["shard"] == [i, 2] and tape[0]["fragments"] == [i, i + 2]
    # The audit reads a sharded syncer from every shard's state directory and tape: the union
    # of their versions on disk is the syncer's.
    state_dirs = [tmp_path / f"shard{i}of2" for i in range(2)]
    tapes = [tmp_path / f"shard{i}of2.jsonl" for i in range(2)]
    verdict = audit_directories(state_dirs, {}, tape=tapes)
    assert verdict.ok, verdict.problems
    assert verdict.commits == sum(1 for t in tapes for r in read_tape(t) if r["event"] == "round")


def _error_of(learner: Learner, timeout: float = 10) -> str:
    wait_until(lambda: learner.link.error is not None, timeout, "the learner's error")
    with pytest.raises(RuntimeError) as info:
        learner.step(tokens=1)
    return str(info.value)


@pytest.mark.timeout(60)
def test_wrong_sets_of_shards_are_clear_errors(tmp_path):
    s0, s1 = make_shard(tmp_path, (0, 2)).start(), make_shard(tmp_path, (1, 2)).start()
    s1of3 = make_shard(tmp_path, (1, 3)).start()
    learners: list[Learner] = []

    def learner(syncer, name):
        lr = Learner(RECIPE.build_model(1), syncer=syncer, num_fragments=P, learner_id=name)
        learners.append(lr)
        return lr

    try:
        only_one = learner(s0.address, "only-one")
        msg = _error_of(only_one)
        assert "missing shard(s) [1] of 2" in msg and "--syncer" in msg, msg
        with pytest.raises(RuntimeError, match="missing shard"):
            only_one.wait_for_global(timeout=5)
        same_twice = learner([s0.address, make_alias(s0)], "twice")
        assert "owned by both" in _error_of(same_twice)
        mixed = learner([s0.address, s1of3.address], "mixed")
        assert "is one of 3 shards, but 2 syncer addresses" in _error_of(mixed)
        too_many = learner([s0.address, s1.address, s1of3.address], "three")
        assert "is one of 2 shards, but 3" in _error_of(too_many)
        with pytest.raises(ValueError, match="given twice"):
            Learner(RECIPE.build_model(1), syncer=[s0.address, s0.address], num_fragments=P)
        # A different fragmentation (P) on one shard is refused by that shard itself.
        other_p = make_shard(tmp_path, (1, 2), fragments=6).start()
        try:
            odd = learner([s0.address, other_p.address], "odd")
            assert "6 fragments" in _error_of(odd)
        finally:
            other_p.stop()
    finally:
        for lr in learners:
            lr.close(flush=False)
        for s in (s0, s1, s1of3):
            s.stop()


def make_alias(server: SyncerServer) -> str:
    """The same server under another spelling of its address (so the list check passes)."""
    return f"localhost:{server.port}"


@pytest.mark.timeout(30)
def test_a_shard_refuses_fragments_it_does_not_own(tmp_path):
    server = make_shard(tmp_path, (0, 2)).start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.SyncerStub(channel)
        layout = server.layout
        reply = stub.Join(join_request(layout, "raw"), timeout=10)
        assert list(reply.fragments) == [0, 2] and (reply.shard, reply.num_shards) == (0, 2)
        status = stub.Status(pb.StatusRequest(), timeout=10)
        assert list(status.fragments) == [0, 2] and status.num_shards == 2
        numel = layout.fragments[1].numel
        payload = codecs.encode(torch.zeros(numel), "fp32")
        chunk = pb.UploadChunk(
            learner_id="raw", session=reply.session, fragment=1, base_version=0, steps=1,
            tokens=1, codec="fp32", numel=numel, chunk_index=0, num_chunks=1, data=payload,
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            stub.Upload(iter([chunk]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not served by this syncer (shard 0/2 owns 0, 2)" in info.value.details()
    finally:
        channel.close()
        server.stop()
    # Its state directory belongs to shard 0/2: starting shard 1/2 on it is refused.
    with pytest.raises(StateError, match="shard 0/2"):
        SyncerServer(
            server.layout,
            list(server.state.params),
            shard=(1, 2),
            state_dir=tmp_path / "shard0of2",
        )


# ------------------------------------------------------------------ real processes
def test_bad_shard_flags_are_refused(tmp_path, capsys):
    """The commands' own entry point, in this process: each refuses before starting anything."""
    for argv, message in [
        (["syncer", "--recipe=tiny", "--fragments=4", "--shard=2/2"], "expected I/S"),
        (["run", "--recipe=tiny", "--fragments=4", "--shards=5"], "[1, P=4]"),
        (["run", "--recipe=tiny", "--shards=2", "--chaos=syncer-kill:at=5s"], "not supported"),
        (["learner", "--id=x", "--recipe=tiny", "--syncer=a:1,,b:2"], "empty entry"),
    ]:
        extra = [f"--runs-dir={tmp_path}"] if argv[0] == "run" else []
        assert cli_main([*argv, *extra]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_diloco_run_with_two_shards(tmp_path):
    proc = run_diloco_json(
        "run",
        "--recipe=tiny",
        "--shards=2",
        "--learners=2",
        "--steps=48",
        f"--fragments={P}",
        f"--sync-every={H}",
        "--down-codec=fp32",
        "--eval-every=0",
        "--minutes=1.5",
        f"--runs-dir={tmp_path}",
        "--name=sh",
        "--json",
        timeout=140,
    )
    summary = proc
    assert summary["stopped_by"] == "learners finished" and summary["shards"] == 2
    run_dir = tmp_path / "sh"
    tape = read_tape(run_dir / "syncer" / "events.jsonl")
    rounds = [r for r in tape if r["event"] == "round"]
    assert {r["fragment"] for r in rounds} == set(range(P)) and len(rounds) == summary["rounds"]
    starts = sorted(tuple(r["shard"]) for r in tape if r["event"] == "start")
    assert starts == [(0, 2), (1, 2)]
    layout = balanced_fragments(RECIPE.build_model(0).named_parameters(), P)
    final = {}
    for i in range(2):  # each shard stored exactly its own fragments
        store_dir = run_dir / f"syncer-{i}"
        names = [f.name for f in (store_dir / "fragments").iterdir()]
        assert sorted(n for n in names if n.endswith(".safetensors")) == [
            f"p{p:03d}.safetensors" for p in range(i, P, 2)
        ]
        # (and the commit journals after each fragment's snapshot: of its own fragments only)
        journals = {int(n[1:4]) for n in names if n.endswith(".journal")}
        assert journals <= set(range(i, P, 2)) and len(names) == P // 2 + sum(
            n.endswith(".journal") for n in names
        ), names
        for p in range(i, P, 2):
            final[p] = FragmentStore(store_dir).load(p, layout.fragments[p].numel)
    matched, closes = 0, {}
    for i in range(2):
        workdir = run_dir / "learners" / f"learner-{i}"
        held, current = current_fragments(workdir, final)
        closes[i] = held.get("close", {})
        matched += current
    # Each learner's close flushed and drained (bounded waits); a learner whose drain
    # reported success holds every fragment it flushed at the version merged with it, so
    # the learner that finished last holds every fragment's final value.
    for i, report in closes.items():
        assert report.get("flush_ok") and report.get("drained"), (i, closes)
    assert matched >= P, closes


def test_merge_status_takes_each_fragment_from_its_owner():
    from diloco.launch.syncers import merge_status

    a = pb.StatusReply(
        syncer_id="a", versions=[5, 0, 7, 0], rounds=12, bytes_up=100, fragments=[0, 2],
        shard=0, num_shards=2, uptime_s=9.0, waiting=2,
        learners=[pb.LearnerStatus(learner_id="x", live=True, step=10, contributions=3,
                                   bytes_up=40)],
    )  # fmt: skip
    b = pb.StatusReply(
        syncer_id="b", versions=[0, 4, 0, 6], rounds=10, bytes_up=50, fragments=[1, 3],
        shard=1, num_shards=2, uptime_s=8.0, waiting=1,
        learners=[pb.LearnerStatus(learner_id="x", live=False, step=11, contributions=2,
                                   bytes_up=10)],
    )  # fmt: skip
    m = merge_status([a, b])
    assert list(m.versions) == [5, 4, 7, 6] and list(m.fragments) == [0, 1, 2, 3]
    assert (m.rounds, m.bytes_up, m.uptime_s, m.num_shards, m.waiting) == (22, 150, 8.0, 2, 3)
    (x,) = m.learners
    assert (x.step, x.contributions, x.bytes_up, x.live) == (11, 5, 50, False)
    assert list(a.learners)[0].contributions == 3  # the inputs are not modified


def test_a_learner_given_a_host_without_a_port_stops_with_one_line(tmp_path, capsys):
    from diloco.cli import main

    workdir = tmp_path / "w"
    argv = ["learner", "--syncer=localhost", "--recipe=tiny", "--id=a", f"--workdir={workdir}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'localhost' is not HOST:PORT" in err and "Traceback" not in err
    assert not workdir.exists()

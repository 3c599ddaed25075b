"""The syncer side of ``diloco run``: start one syncer process or ``S`` shards, read their status.

With ``--shards S`` the supervisor starts ``S`` ``diloco syncer --shard i/S`` processes
(slots ``syncer-0`` .. ``syncer-{S-1}``, state in ``runs/<name>/syncer-i/``), all appending to
the one event tape ``runs/<name>/syncer/events.jsonl`` (the tape is written with single
``O_APPEND`` writes, so processes can share it; shards own disjoint fragments, so the union
of their records reads like one syncer's). Learners and the evaluator get every address.
:class:`StatusClient` asks every shard and merges the replies with :func:`merge_status`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diloco.learner.address import resolve
from diloco.wire import diloco_pb2 as pb


def syncer_names(shards: int) -> list[str]:
    """Supervisor slot names: ``["syncer"]`` unsharded, else ``syncer-0`` .. ``syncer-{S-1}``."""
    return ["syncer"] if shards <= 1 else [f"syncer-{i}" for i in range(shards)]


def is_syncer(name: str) -> bool:
    """Whether a supervisor slot (or a tape ``target``) is a syncer process or shard."""
    return name == "syncer" or name.startswith("syncer-")


def syncer_commands(
    run_dir: Path, shards: int, flags: Sequence[str], host: str = "127.0.0.1"
) -> list[tuple[str, list]]:
    """``(slot name, diloco syncer arguments)`` for each syncer process of a run, each bound
    to a free port on ``host``."""
    tape = run_dir / "syncer" / "events.jsonl"
    out = []
    for i, name in enumerate(syncer_names(shards)):
        shard = [] if shards <= 1 else [f"--shard={i}/{shards}", f"--tape={tape}"]
        out.append(
            (
                name,
                [
                    f"--bind={host}:0",
                    f"--port-file={run_dir / (name + '.addr')}",
                    f"--state-dir={run_dir / name}",
                    "--exit-with-parent",
                    *shard,
                    *flags,
                ],
            )
        )
    return out


def merge_status(replies: Sequence[pb.StatusReply]) -> pb.StatusReply:
    """One ``StatusReply`` for the whole (sharded) syncer, from every shard's reply.

    Each fragment's version comes from the shard that owns it (a reply without ``fragments``,
    from a syncer older than shards, owns all); rounds, bytes, refusals and the contributions
    waiting add up; uptime is the shortest; failures are joined. A learner's counters
    (contributions, bytes) add up over the shards, its progress (step, tokens, speed, state)
    is the most recent any shard heard, and it is live only if it is live on every shard
    that knows it.
    """
    if not replies:
        raise ValueError("no status replies to merge")
    if len(replies) == 1:
        return replies[0]
    versions = list(replies[0].versions)
    for r in replies:
        for p in r.fragments or range(len(r.versions)):
            if p < len(r.versions) and p < len(versions):
                versions[p] = r.versions[p]
    learners: dict[str, pb.LearnerStatus] = {}
    for r in replies:
        for ls in r.learners:
            have = learners.get(ls.learner_id)
            if have is None:
                learners[ls.learner_id] = pb.LearnerStatus()
                learners[ls.learner_id].CopyFrom(ls)
                continue
            newest = ls if ls.step > have.step else have
            have.live = have.live and ls.live
            have.step, have.tokens = newest.step, newest.tokens
            have.steps_per_s, have.state = newest.steps_per_s, newest.state
            have.contributions += ls.contributions
            have.bytes_up += ls.bytes_up
            have.bytes_down += ls.bytes_down
    return pb.StatusReply(
        syncer_id=",".join(r.syncer_id for r in replies),
        versions=versions,
        rounds=sum(r.rounds for r in replies),
        bytes_up=sum(r.bytes_up for r in replies),
        bytes_down=sum(r.bytes_down for r in replies),
        learners=list(learners.values()),
        uptime_s=min(r.uptime_s for r in replies),
        refused=sum(r.refused for r in replies),
        waiting=sum(r.waiting for r in replies),
        failure="; ".join(r.failure for r in replies if r.failure),
        fragments=sorted({p for r in replies for p in r.fragments}),
        shard=0,
        num_shards=len(replies),
    )


class StatusClient:
    """Polls the Status RPC of every syncer shard (bounded, 2 s per call) and merges them."""

    def __init__(self, address: str | Sequence[str], token: str | None = None) -> None:
        from diloco.learner.shards import parse_syncer_addresses
        from diloco.wire import auth
        from diloco.wire import diloco_pb2_grpc as pb_grpc

        self.addresses = parse_syncer_addresses(address)
        self._targets = [resolve(a) or a for a in self.addresses]
        self._channels = [auth.open_channel(t, {}) for t in self._targets]
        self._metadata = auth.call_metadata(token)
        self._stubs = [pb_grpc.SyncerStub(c) for c in self._channels]
        self.refusal: str | None = None
        """Why the last ``fetch`` got no status from a shard that answered and refused the
        call (a missing or wrong token, an id not allowed); None when it was not refused."""

    def _follow(self, i: int) -> None:
        """For an ``@FILE`` address: reopen the channel when the file names another syncer
        address (it restarted elsewhere)."""
        from diloco.wire import auth
        from diloco.wire import diloco_pb2_grpc as pb_grpc

        target = resolve(self.addresses[i])
        if target is not None and target != self._targets[i]:
            self._channels[i].close()
            self._targets[i] = target
            self._channels[i] = auth.open_channel(target, {})
            self._stubs[i] = pb_grpc.SyncerStub(self._channels[i])

    def fetch(self) -> pb.StatusReply | None:
        """The merged status, or None if any shard does not answer (the syncer as a whole is
        then not fully up)."""
        import grpc

        replies = []
        self.refusal = None
        for i in range(len(self._stubs)):
            self._follow(i)
            stub = self._stubs[i]
            try:
                replies.append(
                    stub.Status(pb.StatusRequest(), timeout=2.0, metadata=self._metadata)
                )
            except grpc.RpcError as exc:
                refused = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                if exc.code() in refused:
                    self.refusal = f"{self.addresses[i]} answered and refused: {exc.details()}"
                return None
        return merge_status(replies)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

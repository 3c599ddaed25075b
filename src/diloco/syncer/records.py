"""What the syncer's state machine keeps and returns: learner records, contributions, rounds,
the clock's requests and commits (plain records; the decisions are in ``state.py``)."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from diloco.algorithm import codecs
from diloco.algorithm.codecs import all_finite
from diloco.algorithm.encoded_delta import Encoded, EncodedDelta
from diloco.algorithm.merge import token_weight
from diloco.syncer.pace import StepPace
from diloco.syncer.receipts import UPLOADS_PER_ROUND, CommitLog, UploadPart
from diloco.syncer.replay import RoundInputs, merged_delta

SUSPECT_WINDOW = 8
"""Checked contributions the direction check's verdicts are remembered for, per learner."""


def is_suspect(verdicts) -> bool:
    """A learner whose contributions the direction check left out in at least half of its
    last ``SUSPECT_WINDOW`` checked rounds (at least 3 of them) is suspect: its deltas are
    also left out of the rounds too small to check (one or two contributions).

    >>> is_suspect([True, True, False])
    True
    >>> is_suspect([True, False, False, False]) or is_suspect([True, True])
    False
    """
    return len(verdicts) >= 3 and 2 * sum(verdicts) >= len(verdicts)


MAX_STEP_TIME_S = 3600.0
"""Upper bound (exclusive) of a step time a learner may report, in uploads and heartbeats."""
UNDECLARED_SLACK = 4
"""A learner that declared no tokens per step at join may claim at most this many times the
tokens per step of its first accepted contribution (``tokens_per_step_bound``): room for
batches whose token count varies (unpadded sequences), while a claim 100 times its first
one, which would multiply its merge weight by 10,000, is refused."""


class Refused(Exception):
    """A request that is invalid; ``code`` names the gRPC status the server answers with."""

    def __init__(self, code: str, message: str, metadata: tuple[tuple[str, str], ...] = ()):
        """``metadata``: trailing metadata the refusal carries (``wire.protocol`` keys)."""
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


@dataclass
class LearnerInfo:
    learner_id: str
    session: str
    joined_at: float
    last_seen: float
    observer: bool = False
    connected: bool = True
    live: bool = True
    step: int = 0
    tokens: int = 0
    steps_per_s: float = 0.0
    state: str = "joined"
    stopping: bool = False
    """It sent a *final* contribution: it is flushing before it stops and answers no more
    requests, so the clock neither asks it nor waits for it (a late answer of its own then
    merges with the others' answers; when nobody is live, with the finals still on their
    way, ``finals_due``)."""
    finals_due: set[int] = field(default_factory=set)
    """The fragments its final uploads named (``final_fragments``: the finals its link still
    had to send) that have not been admitted yet: on the syncer's clock with nobody live,
    their rounds wait for them (``finals_due``)."""
    finals_delivered: set[int] = field(default_factory=set)
    """The fragments whose final this session has delivered (admitted, or refused for good)."""
    stopping_since: float | None = None
    """When its first final upload arrived."""
    contributions: int = 0
    last_tokens: int | None = None
    """Tokens of this learner's last accepted contribution (the round share's fallback)."""
    bytes_up: int = 0
    bytes_down: int = 0
    tokens_per_step: int = 0
    """Declared at join (batch × sequence); 0: not declared. Claims above it are refused."""
    learned_tokens_per_step: int = 0
    """Without a declared value: the bound learned from this id's first accepted
    contribution (``learn_tokens_per_step``; kept across rejoins); 0 before it."""
    step_s: float | None = None
    """Its step time as the clock believes it: its claim (heartbeats, uploads) clamped around
    its measured one (``pace.believed_step_s``)."""
    pace: StepPace = field(default_factory=StepPace)
    """Its step time measured on the syncer's clock (kept across rejoins)."""
    tokens_per_s: float | None = None
    """Its measured throughput (EMA over heartbeats): the round share of an absent learner."""
    accepted_at: dict[int, float] = field(default_factory=dict)
    """When the syncer last accepted a delta of each fragment from this id (kept across
    rejoins): the learners a round's share counts (``recent_contributors``)."""
    first_joined_at: float | None = None
    """When this id first joined this syncer (kept across rejoins)."""
    steps_from: dict[int, float] = field(default_factory=dict)
    """Per fragment, when the steps of its next delta can have begun (``pace.steps_since``):
    the commit time of the version its last accepted delta was taken against, where this
    syncer committed it (kept across rejoins): the guard's bound on claimed steps."""
    verdicts: deque[bool] = field(default_factory=lambda: deque(maxlen=SUSPECT_WINDOW))
    """Whether the direction check left each of its last checked contributions out."""
    rate_mark: tuple[float, int] | None = None
    """``(now, tokens)`` of the heartbeat the token rate was last measured from
    (``update_rate``); None before the first."""


@dataclass
class Contribution:
    learner_id: str
    delta: torch.Tensor | EncodedDelta
    """Its uploads as they arrived (the syncer's service: an ``EncodedDelta``, 26 times
    smaller than decoded in ``sign1``, decoded where the merge reads it), or a delta given
    decoded (e.g. by a test)."""
    base_version: int
    steps: int
    tokens: int
    discount: float
    arrived_at: float
    nbytes: int
    increments: int = 1
    """Uploads summed into this contribution (a late one and the answer to this round)."""
    final: bool = False
    uploads: list[UploadPart] = field(default_factory=list)
    """The uploads summed into it (id, steps, tokens each): persisted with the commit."""
    norm: float = 0.0
    """``‖delta‖``; summed from increments, the sum of their norms (an upper bound)."""
    credited: int = 0
    """The steps the norm guard credited it with (``roster.credited_steps``), summed from
    increments: a later increment is judged on the sum's size over the sum's credit."""

    def as_arrived(self) -> list[Encoded]:
        """Its uploads as they arrived (codec, bytes), in the order they were summed: what
        the commit journal keeps to make the merge again; for a delta given decoded, the
        summed delta in fp32."""
        if isinstance(self.delta, EncodedDelta):
            return list(self.delta.parts)
        return [("fp32", codecs.encode(self.delta, "fp32"))]

    @property
    def weight(self) -> float:
        return token_weight(self.tokens, self.steps) * self.discount

    def add(self, other: Contribution) -> None:
        """Sum a later increment of the same learner into this one: deltas and counters add,
        the older base version and the smaller discount stay (the increment is no fresher
        than its oldest part)."""
        if isinstance(self.delta, EncodedDelta) and isinstance(other.delta, EncodedDelta):
            self.delta = self.delta.plus(other.delta)
        else:  # (a delta given decoded: the sum decoded)
            self.delta = decoded(self.delta) + decoded(other.delta)
        self.steps += other.steps
        self.tokens += other.tokens
        self.base_version = min(self.base_version, other.base_version)
        self.discount = min(self.discount, other.discount)
        self.arrived_at = other.arrived_at
        self.nbytes += other.nbytes
        self.increments += other.increments
        self.norm += other.norm
        self.credited += other.credited
        self.final = self.final or other.final
        self.uploads = self.uploads + other.uploads


def decoded(delta: torch.Tensor | EncodedDelta) -> torch.Tensor:
    """A contribution's delta as a tensor (an ``EncodedDelta`` decoded into a new one)."""
    return delta.decoded() if isinstance(delta, EncodedDelta) else delta


@dataclass
class FragmentRound:
    opened_at: float | None
    """When the round opened (a tick, or the first arrival on the learners' schedule);
    ``None``: contributions wait here for the fragment's next tick."""
    contributions: dict[str, Contribution] = field(default_factory=dict)
    quorum_at: float | None = None
    asked: frozenset[str] | None = None
    """Learners the tick asked (``None`` on the learners' schedule)."""
    first_opened_at: float | None = None
    """When a tick first opened it (a round asked again keeps it): its longest wait counts
    from here (``rounds.held_deadline``)."""

    def busy(self, now: float, just_s: float) -> bool:
        """Whether the clock's next turn passes over it: open and answered (it closes within
        its grace window), or opened less than ``just_s`` before ``now`` (asked just now)."""
        if self.opened_at is None:
            return False
        return bool(self.answered()) or now - self.opened_at < just_s

    def answered(self) -> frozenset[str]:
        """Learners with a contribution that arrived since the round opened: a late one from
        the previous round rides along but does not answer this round's request (a final one,
        from a learner that stopped, does)."""
        if self.opened_at is None:
            return frozenset()
        if self.asked is None:
            return frozenset(self.contributions)
        return frozenset(
            lid
            for lid, c in self.contributions.items()
            if c.arrived_at >= self.opened_at or c.final
        )


@dataclass(frozen=True)
class RoundRequest:
    """A round the syncer's clock opened: ask ``asked`` for ``fragment``'s contribution."""

    fragment: int
    version: int
    asked: frozenset[str]


@dataclass
class Closing:
    """A round that closed and still has to be merged: what the merge needs, decided under
    the syncer's lock (``SyncerState.close_rounds``), so that the merge itself, the costly
    part, can run without it (``merge``), before ``SyncerState.apply`` makes the commit."""

    fragment: int
    round: FragmentRound
    reason: str
    contributions: list[Contribution]
    """What the merge keeps (the direction check's verdict applied); empty when it left every
    contribution out (nothing is committed: a *dropped* round)."""
    left_out: list[Contribution]
    """What the direction check left out (never merged; their learners are told)."""
    weights: list[float]
    excluded: dict
    cosines: dict
    share: float
    is_embedding: Callable[[str], bool]
    piece_layout: object
    """The fragment's ``fragments.Fragment`` (which tensor each span of the vector is)."""

    def merge(
        self,
        empty: Callable[[int], torch.Tensor] = codecs.new_vector,
        scratch: Callable[[int], torch.Tensor] = codecs.new_vector,
    ) -> torch.Tensor | None:
        """The round's merged delta, scaled by its share (a pure function of the above), in
        a tensor from ``empty(n)`` (a new one by default; ``scratch``: where its uploads'
        tensor spans are decoded, ``streaming.merge_into``); None for a dropped round."""
        if not self.contributions:
            return None
        deltas = [c.delta for c in self.contributions]
        return merged_delta(
            deltas, self.weights, self.share, self.piece_layout, self.is_embedding, empty, scratch
        )


@dataclass(frozen=True)
class Commit:
    """A closed round: the new value of one fragment, to persist and then broadcast.

    ``log`` is what the round did with its uploads and ``history`` the fragment's last
    commit logs (this one last, as JSON): both are persisted with the value (and the
    fragment's running total of merged tokens), so a restarted syncer knows what every
    recent commit merged. A dropped round (``changed`` False) keeps
    the version and the value; only its log is persisted, and nothing is broadcast.

    ``params`` and ``momentum`` are the global model's own Θ_p and momentum buffer, not
    copies (a copy per commit is 8 bytes per value of the fragment): they hold this
    commit's values until the fragment's next commit, which only the committer makes, after
    it has published this one. What keeps them longer, on another thread (a background
    snapshot), copies them (``records.copied``)."""

    fragment: int
    version: int
    params: torch.Tensor
    momentum: dict[str, torch.Tensor]
    record: dict
    log: CommitLog
    history: list[dict]
    merged_tokens: int
    """The fragment's ``RoundClosing.merged_tokens`` with this commit: persisted with it."""
    changed: bool = True
    inputs: RoundInputs | None = None
    """What makes the commit again (``diloco.syncer.replay``): its commit journal record
    (the committer adds the digest of Θ_p)."""


def copied(commit: Commit) -> Commit:
    """``commit`` with copies of its Θ_p and momentum (see ``Commit``)."""
    momentum = {k: v.clone() for k, v in commit.momentum.items()}
    return replace(commit, params=commit.params.clone(), momentum=momentum)


def update_rate(info: LearnerInfo, now: float, tokens: int, decay: float) -> None:
    """EMA of a learner's tokens per second from the cumulative counts its heartbeats carry
    (a count that went down, e.g. after a restart, restarts the measurement)."""
    mark = info.rate_mark
    info.rate_mark = (now, tokens)
    if mark is None or tokens < mark[1] or now <= mark[0]:
        return
    rate = (tokens - mark[1]) / (now - mark[0])
    info.tokens_per_s = (
        rate if info.tokens_per_s is None else (decay * info.tokens_per_s + (1 - decay) * rate)
    )


def tokens_per_step_bound(info: LearnerInfo) -> int:
    """The most tokens per step ``info``'s learner may claim beyond the syncer-wide
    ``max_tokens_per_step`` (0: none yet): what it declared at join, else what it learned.

    A learner that declares nothing (``LearnerConfig.tokens_per_step`` 0) is bounded by its
    own first accepted contribution: ``UNDECLARED_SLACK`` × that contribution's tokens per
    step, fixed for its id from then on (a rejoin keeps it), so it cannot raise its claims,
    and with them its merge weight ``tokens²/steps``, once it has contributed. A learner
    with a constant batch always claims the same tokens per step and is never refused.
    """
    return info.tokens_per_step or info.learned_tokens_per_step


def learn_tokens_per_step(info: LearnerInfo, *, tokens: int, steps: int) -> None:
    """After an accepted contribution: an undeclared learner without a bound yet gets one
    (``tokens_per_step_bound``)."""
    if not info.tokens_per_step and not info.learned_tokens_per_step:
        info.learned_tokens_per_step = UNDECLARED_SLACK * -(-tokens // steps)


def check_counters(
    info: LearnerInfo,
    config,
    *,
    numel: int,
    fragment: int,
    steps: int,
    tokens: int,
    delta: torch.Tensor | EncodedDelta,
    step_time_s: float,
) -> None:
    """Raise ``Refused`` unless a contribution's shape, counters, step time and values are
    within bounds: the length of its fragment, ``1 <= steps``, ``1 <= tokens``, the sanity
    bounds of ``config`` (a ``SyncerConfig``), at most the tokens per step ``info``'s learner
    may claim (``tokens_per_step_bound``), finite values (an ``EncodedDelta``'s were read
    for its norm, which refuses a non-finite one: the service reads it before it submits)."""
    expected = numel
    if len(delta.shape) != 1 or delta.numel() != expected:
        raise Refused(
            "INVALID_ARGUMENT",
            f"fragment {fragment} has {expected} values, got {delta.numel()}",
        )
    if not 1 <= steps <= config.max_steps_per_contribution:
        raise Refused(
            "INVALID_ARGUMENT",
            f"steps must be in [1, {config.max_steps_per_contribution}], got {steps}",
        )
    if not 1 <= tokens <= steps * config.max_tokens_per_step:
        raise Refused(
            "INVALID_ARGUMENT",
            f"tokens must be in [1, steps*{config.max_tokens_per_step}], got {tokens}",
        )
    bound = tokens_per_step_bound(info)
    if bound and tokens > steps * bound:
        why = (
            "this learner declared at join"
            if info.tokens_per_step
            else f"this learner may claim ({UNDECLARED_SLACK} x its first contribution's; "
            "declare tokens_per_step at join for batches that vary more)"
        )
        raise Refused(
            "INVALID_ARGUMENT",
            f"{tokens} tokens in {steps} steps is more than the {bound} tokens per step {why}",
        )
    if not (step_time_s >= 0 and step_time_s < MAX_STEP_TIME_S):
        raise Refused(
            "INVALID_ARGUMENT",
            f"step_time_s must be in [0, {MAX_STEP_TIME_S:g}), got {step_time_s}",
        )
    if isinstance(delta, torch.Tensor) and not all_finite(delta):
        raise Refused("INVALID_ARGUMENT", "delta has non-finite values")


def norm_of(delta: torch.Tensor | EncodedDelta) -> float:
    """``‖delta‖``; ``Refused`` (INVALID_ARGUMENT) for an ``EncodedDelta`` whose payload does
    not decode (``EncodedDelta.norm`` reads it all)."""
    try:
        return float(delta.norm())
    except codecs.CodecError as exc:
        raise Refused("INVALID_ARGUMENT", f"cannot decode the delta: {exc}") from None


def check_room_in_round(earlier: Contribution | None, *, fragment: int) -> None:
    """Raise ``Refused("FAILED_PRECONDITION")`` when ``earlier``, a learner's contribution
    to ``fragment``'s open round (None: it has none), already sums ``UPLOADS_PER_ROUND``
    uploads. The learner takes the refusal as "not accepted": the progress stays its own and
    goes out with its next upload of the fragment, into the next round."""
    if earlier is not None and earlier.increments >= UPLOADS_PER_ROUND:
        raise Refused(
            "FAILED_PRECONDITION",
            f"fragment {fragment}: this learner's contribution to the open round already "
            f"holds {earlier.increments} uploads, the most one round takes "
            f"({UPLOADS_PER_ROUND}); send it again after the round's commit",
        )


def check_id(learner_id: str) -> None:
    """Raise ``Refused`` unless the id is 1-64 characters of letters, digits, ``-_.:``."""
    if (
        not learner_id
        or len(learner_id) > 64
        or not all(c.isalnum() or c in "-_.:" for c in learner_id)
    ):
        raise Refused(
            "INVALID_ARGUMENT",
            "learner id must be 1-64 characters of letters, digits, '-', '_', '.', ':'",
        )


def state_digest(state) -> str:
    """A ``SyncerState``'s digest: SHA-256 over everything that shapes the global model:
    versions, Θ_p, the outer optimizer's state, every open round's contributions, the norm
    guard's history and the learner table (ids, sessions, membership). Liveness times, byte and refusal counters
    are left out: they change on every heartbeat. Equal digests mean a request changed
    nothing that matters (the fuzz tests compare them around refused requests)."""
    h = hashlib.sha256(repr(state.versions).encode())
    for t in state.params:
        h.update(t.contiguous().numpy().tobytes())
    outer = state.outer.state_dict()
    for p in sorted(outer["buffers"]):
        h.update(f"momentum{p}".encode())
        h.update(outer["buffers"][p].contiguous().numpy().tobytes())
    for p in sorted(state.rounds):
        r = state.rounds[p]
        h.update(repr((p, r.opened_at, r.quorum_at, sorted(r.asked or ()))).encode())
        for lid in sorted(r.contributions):
            c = r.contributions[lid]
            h.update(repr((lid, c.base_version, c.steps, c.tokens, c.discount)).encode())
            if isinstance(c.delta, EncodedDelta):  # (its bytes as they arrived)
                for codec, payload in c.delta.parts:
                    h.update(codec.encode())
                    h.update(payload)
            else:
                h.update(c.delta.contiguous().numpy().tobytes())
    for p in range(state.layout.num_fragments):
        h.update(repr(state.norms.of(p)).encode())  # per learner
    for lid in sorted(state.learners):
        i = state.learners[lid]
        h.update(repr((lid, i.session, i.observer, i.connected, i.stopping)).encode())
        h.update(repr(sorted(i.finals_due)).encode())
    return h.hexdigest()


def span(fragments: list[int]) -> str:
    """Short text for a list of fragments (the first few, then how many more)."""
    head = ", ".join(map(str, fragments[:6]))
    return head + (f", ... ({len(fragments)} in all)" if len(fragments) > 6 else "")

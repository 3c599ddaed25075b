"""The wide-area bandwidth data-parallel and Decoupled DiLoCo need (``diloco plan``), and the
syncer shards the exchange needs (``diloco.plan.syncer``).

The model (docs/plan.md has it written out with a worked example). Bandwidth is per site, one
direction of a full-duplex wide-area link, in bits per second; N parameters, step time t,
D sites, target compute utilization u.

Data-parallel, one replica group spread over the D sites: every step all-reduces the N
gradients of ``dp_bits`` bits. Hierarchically (reduce inside each site first, then a ring
across the sites), each site's link carries ``2(D−1)/D · N · dp_bits`` bits per step.
Transfer worth a fraction ``o`` of a step can hide behind other work (the backward pass, the
all-reduce's own reductions); the rest is exposed and stretches the step. Utilization
``t / (t + exposed) ≥ u`` gives a time budget of ``t · (1/u − 1 + o)``:

    BW_dp = 2(D−1)/D · N · dp_bits / (t · (1/u − 1 + o))

Decoupled DiLoCo, one learner per site: each fragment (N/P parameters) leaves every H steps,
so a learner sends N/H parameters per step (``up_bits`` each) and receives as many merged
ones (``down_bits``); a fragment has τ steps to arrive before it is needed, so a burst of
N/P parameters must also cross within τ·t. Communication overlaps compute entirely, so u
does not enter as long as the link carries:

    BW_dec = N · max(up_bits, down_bits) / t · max(1/H, 1/(P·τ))

This is the bandwidth of a learner's site; a central syncer's site receives D − 1 such
streams (a syncer sharded across the sites spreads that load).

Each named communication setting (``--comms``, ``diloco.wire.comms``) fixes H and the two
codecs; :func:`comms_bandwidths` prices each with the codec's real bytes per value (block
scales and offsets included), and :func:`recommend` picks the densest one a link carries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from diloco.plan.syncer import Exchange, SyncerPlanInputs, codec_for_bits, shards_needed
from diloco.runtime.schema import option, same_option
from diloco.wire.comms import COMMS, bytes_per_value
from diloco.wire.protocol import ProtocolConfig

PAPER_SYNC_EVERY = 24
"""The paper's H, which the plan's own inputs model (with its P = 24, τ = 2 and int4 both
ways); our default H is ``--comms default``'s."""


def parse_count(text: str) -> float:
    """``12e9``, ``12B``, ``350M``, ``70b`` → a parameter count (``ValueError`` otherwise).

    >>> parse_count("350M")
    350000000.0
    """
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    if scale != 1.0:
        t = t[:-1]
    try:
        return float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a parameter count (e.g. 12B, 350M)") from None


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What ``diloco plan`` prices: the model, the step, the sites, the exchange and the
    syncer's machines (each field is also its flag). The exchange's defaults are the paper's setting (H = 24, P = 24,
    τ = 2, 4-bit values both ways), not the project's default exchange: ``--comms
    default`` prices that."""

    params: float = option(type=parse_count, metavar="N")
    """N, the model's parameter count, e.g. 12B or 350M."""
    step_time_s: float = option(flag="--step-time", metavar="SECONDS")
    """t, seconds per optimizer step at full compute."""
    sites: int = option(8)
    """D, data centres (learners or data-parallel sites; one learner per site for Decoupled
    DiLoCo)."""
    dp_bits: int = option(16, metavar="BITS")
    """Bits per gradient value data-parallel sends (16: bf16, 32: fp32)."""
    up_bits: float = option(4, flag="--bits", type=int, metavar="BITS")
    """Bits per value of a learner's outer gradient, its upload (4: int4, the paper's
    choice)."""
    down_bits: float = option(4, type=int, metavar="BITS")
    """Bits per value of a merged fragment the syncer sends back to the learners."""
    num_fragments: int = same_option(ProtocolConfig, "num_fragments")
    """P, the fragments the model is cut into."""
    sync_every: int = option(PAPER_SYNC_EVERY, metavar="H")
    """H: each fragment is sent every H steps (the paper's, with its 4-bit codecs above;
    ``--comms NAME`` prices a named setting instead, ``with_comms``)."""
    tau: float = option(2.0)
    """τ: steps a fragment may take to arrive (the overlap, in steps)."""
    utilization: float = option(0.9)
    """u: target fraction of wall time the chips compute (data-parallel), in (0, 1)."""
    dp_overlap: float = option(0.0)
    """o, in [0, 1]: transfer time, as a fraction of a step, that hides behind other work
    (the backward pass, the all-reduce's own reductions; docs/plan.md says how to measure
    it)."""
    syncer: SyncerPlanInputs = field(default_factory=SyncerPlanInputs)
    """The syncer's side: learners served, one shard's machine (``diloco.plan.syncer``)."""

    def __post_init__(self) -> None:
        if not self.params > 0 or not self.step_time_s > 0:
            raise ValueError("params and step time must be > 0")
        if self.sites < 2:
            raise ValueError(
                f"sites must be >= 2 (one site needs no wide-area link), got {self.sites}"
            )
        if not self.up_bits > 0 or not self.down_bits > 0:
            raise ValueError(f"bits must be > 0, got {self.up_bits} up, {self.down_bits} down")
        for name in ("dp_bits", "num_fragments", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {self.tau}")
        if not 0 < self.utilization < 1:
            raise ValueError(f"utilization must be in (0, 1), got {self.utilization}")
        if not 0 <= self.dp_overlap <= 1:
            raise ValueError(f"dp_overlap must be in [0, 1], got {self.dp_overlap}")


def ring_factor(sites: int) -> float:
    """Bytes each member of a ring all-reduce sends, per byte reduced: ``2(D−1)/D``."""
    return 2.0 * (sites - 1) / sites


def dp_bits_per_step(p: PlanInputs) -> float:
    """Bits each site's link carries per data-parallel step."""
    return ring_factor(p.sites) * p.params * p.dp_bits


def dp_time_budget_s(p: PlanInputs) -> float:
    """Seconds per step the all-reduce may take at utilization u: ``t·(1/u − 1 + o)``."""
    return p.step_time_s * (1.0 / p.utilization - 1.0 + p.dp_overlap)


def dp_bandwidth_bps(p: PlanInputs) -> float:
    """``BW_dp`` in bits/s (module docstring)."""
    return dp_bits_per_step(p) / dp_time_budget_s(p)


def decoupled_bandwidth_bps(p: PlanInputs) -> float:
    """``BW_dec`` in bits/s (module docstring)."""
    per_step = max(1.0 / p.sync_every, 1.0 / (p.num_fragments * p.tau))
    return p.params * max(p.up_bits, p.down_bits) / p.step_time_s * per_step


def with_comms(p: PlanInputs, name: str) -> PlanInputs:
    """``p`` with H and the codecs' bits (their real bytes per value) of setting ``name``,
    and τ at least ``H/P``: on the syncer's clock a fragment is asked for once per ``H/P``
    steps, so an upload has until the next one (a long H spreads its bursts out; with the
    paper's τ = 2 the burst term would price every H above ``2P`` as ``2P``)."""
    s = COMMS[name]
    return replace(
        p,
        sync_every=s.sync_every,
        up_bits=8 * bytes_per_value(s.up_codec),
        down_bits=8 * bytes_per_value(s.down_codec),
        tau=max(p.tau, s.sync_every / p.num_fragments),
    )


def comms_bandwidths(p: PlanInputs) -> dict[str, float]:
    """``BW_dec`` in bits/s of every named setting, densest first (P, τ, N, t from ``p``)."""
    return {name: decoupled_bandwidth_bps(with_comms(p, name)) for name in COMMS}


def recommend(p: PlanInputs, link_bps: float) -> str | None:
    """The densest named setting whose ``BW_dec`` fits a link of ``link_bps`` (None: none
    does; a longer H, ``--sync-every``, is the next lever). Pure.

    >>> recommend(PlanInputs(params=1e9, step_time_s=1.0), 1e12)
    'default'
    """
    if not link_bps > 0:
        raise ValueError(f"link bandwidth must be > 0, got {link_bps}")
    fits = [name for name, bps in comms_bandwidths(p).items() if bps <= link_bps]
    return fits[0] if fits else None


def syncer_exchange(p: PlanInputs) -> Exchange:
    """What the syncer's load depends on, from the plan's inputs: M learners (default one per
    site), and the codecs the plan's bits name (:func:`diloco.plan.syncer.codec_for_bits`)."""
    return Exchange(
        params=p.params,
        num_fragments=p.num_fragments,
        sync_every=p.sync_every,
        step_time_s=p.step_time_s,
        learners=p.syncer.learners or p.sites,
        up_codec=codec_for_bits(p.up_bits),
        down_codec=codec_for_bits(p.down_bits),
        commits_per_snapshot=p.syncer.commits_per_snapshot,
    )


def plan(p: PlanInputs, link_bps: float | None = None) -> dict:
    """The plan as JSON-able data; with ``link_bps``, the named setting it recommends."""
    dp, dec = dp_bandwidth_bps(p), decoupled_bandwidth_bps(p)
    extra = {} if link_bps is None else {"link_gbps": link_bps / 1e9}
    if link_bps is not None:
        extra["recommended_comms"] = recommend(p, link_bps)
    return {
        "inputs": asdict(p),
        "dp_gbps": dp / 1e9,
        "decoupled_gbps": dec / 1e9,
        "ratio": dp / dec,
        "dp_bits_per_step": dp_bits_per_step(p),
        "dp_time_budget_s": dp_time_budget_s(p),
        "comms_gbps": {name: bps / 1e9 for name, bps in comms_bandwidths(p).items()},
        "syncer": shards_needed(syncer_exchange(p), p.syncer),
        **extra,
    }

"""How many syncer shards a model, a fleet and a step need (``diloco plan``'s syncer section).

The model (docs/plan.md, "Syncer shards", has it with a worked example). N parameters in P
fragments of ``v = N/P`` values, M learners, H, step time t, the exchange's up and down
codecs (``u`` and ``d`` bytes per value), a full snapshot every K commits (by default K
follows the bytes: ``diloco.syncer.snapshot_interval``). On the syncer's
clock every fragment is merged once per H fleet steps, so the whole model makes ``P/(H·t)``
commits a second; shard i of S serves fragments ``p mod S = i`` (docs/algorithm.md, "Syncer
shards"), the busiest ``f = ⌈P/S⌉`` of them, and makes ``f/(H·t)`` commits a second. Each
commit merges M uploads of its fragment and sends its delta to M learners. Per shard:

    CPU s/s  = commits/s · v · (M·(decode_up + merge + u·wire) + outer + encode_down
                                + d·M·wire + durable·persist)
    disk B/s = commits/s · v · durable,     durable = M·u·journal + snapshot/K
    memory   = f·v·held + M·(min(v, W)·decoded + v·u)   (every served value; one round's
               uploads, and the merge's spans of them: W = merge_sizes.WHOLE_SPAN_VALUES)
    network  = commits/s · v · M · u  in,   commits/s · v · M · d  out

The costs (:class:`SyncerCosts`) are measured on the project's 2-core reference machine, one
torch thread, each with its source below; a shard needs the fewest S in ``[1, P]`` for which
every resource fits (:func:`shards_needed`). Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from diloco.algorithm.codec_sizes import CODECS
from diloco.algorithm.merge_sizes import WHOLE_SPAN_VALUES
from diloco.runtime.schema import option, same_option
from diloco.runtime.units import GBIT_S, parse_rate, parse_size
from diloco.syncer import snapshot_interval
from diloco.syncer.config import SyncerConfig
from diloco.syncer.snapshot_interval import records_per_snapshot
from diloco.wire.comms import bytes_per_value

REFERENCE_MACHINE = "the project's 2-core reference machine (one torch thread)"
"""Where every cost below was measured; a faster core needs proportionally fewer seconds."""

CODEC_CPU_MS_PER_25M_VALUES: dict[str, tuple[float, float]] = {
    "fp32": (51.1, 24.0),
    "bf16": (52.5, 37.3),
    "int8": (79.4, 16.7),
    "int4": (74.5, 37.7),
    "int2": (73.3, 23.5),
    "sign1": (72.9, 8.5),
    "sign1w": (75.2, 8.7),
    "topk2": (1277.8, 41.2),
}
"""(encode, read) CPU milliseconds of 25M float32 values per codec, one torch thread:
benchmarks/RESULTS.md, "Algorithm core", the CPU-time row (`bench_algorithm.py --cpu-time`,
reference machine, 2026-11-29). The syncer encodes every commit's delta (down codec) and
reads every upload (up codec) twice: on arrival for its norm (``norm_chunked_ms``: a sign
codec's from its scales alone) and at the merge, decoded into a buffer used before
(``decode_reused_ms``); the read is their sum."""

MERGE_SECONDS_PER_VALUE_PER_CONTRIBUTION = 0.236e-9
"""CPU seconds the merge (token-weighted RDA) spends per value per contribution: the slope of
the merge's CPU time over M = 2, 4, 8, 16 contributions of 25.7M parameters (0.0366, 0.0491,
0.0744, 0.1217 s; RESULTS "Algorithm core", CPU-time row, reference machine, 2026-11-28)."""

OUTER_SECONDS_PER_VALUE = 0.968e-9
"""CPU seconds per value per commit the merge costs whatever M (its fixed work and the outer
Nesterov step): the intercept of the same fit (0.0249 s for 25.7M values)."""

PERSIST_SECONDS_PER_BYTE = 3.63e-9
"""CPU seconds per byte made durable (serialising and checksumming): issue 48's measurement
of one 504 MB commit of a 1B model's fragment through ``FragmentStore`` on the reference
machine (SHA-256 0.35 s + serialisation 1.48 s; the write and fsync, 1.64 s, are the disk's)."""

WIRE_SECONDS_PER_BYTE = 1.33e-9
"""CPU seconds per byte received or sent (gRPC in Python, validation): what is left of the
syncer's measured CPU once the stages above are priced, fitted (least squares) to the three
rows of RESULTS "Syncer capacity" of 2026-11-29 (100M parameters, P = H = 24, 0.5 s steps,
int4 up, int8 down, the journal and a snapshot every 8 commits; M = 16, 24, 32: 0.88, 1.04
and 1.00 cores, the last two the whole of the syncer's interpreter lock). With it the model
gives those rows within 7% (``tests/test_plan_syncer.py``)."""

JOURNAL_BYTES_PER_UPLOAD_BYTE = 1.0
"""Bytes a commit's journal record writes per compressed upload byte it merged: 6.25 MB for
four sign1 uploads of a 10.0M-value fragment (issue 48's notes, reference machine,
2026-11-28; the record holds the admitted uploads as they arrived, its other fields are a
few hundred bytes)."""

SNAPSHOT_BYTES_PER_VALUE = float(snapshot_interval.SNAPSHOT_BYTES_PER_VALUE)
"""Bytes a full snapshot writes per value: Θ_p, its momentum and the wire image in fp32
(measured: 120.0 MB for the same 10.0M-value fragment)."""

SYNCER_BYTES_PER_PARAM = 14.0
"""Memory the syncer process holds per parameter it serves, beyond the interpreter: Θ,
momentum and the wire image need 12; measured 13.8 with ``benchmarks/bench_syncer_memory.py
--params 50e6 --commits 24`` on the reference machine (2026-11-28; docs/architecture.md,
"What the syncer holds, per parameter"), rounded up. A round's uploads and the merge's
decoded spans are counted apart (``DECODED_BYTES_PER_VALUE``)."""

DECODED_BYTES_PER_VALUE = 4.0
"""Bytes a value of an upload holds decoded (fp32): the syncer keeps its uploads as they
arrived (``u`` bytes per value each) and its merge decodes one tensor's span of each at a
time, at most ``merge_sizes.WHOLE_SPAN_VALUES`` values (``syncer/committer.py``)."""

DEFAULT_SYNCER_MEMORY = parse_size("24GiB")
"""The reference machine's memory (23.5 GiB), rounded."""
DEFAULT_DISK_MB_S = 300.0
"""Write + fsync throughput measured on the reference machine's disk (issue 48: 504 MB in
1.64 s)."""
DEFAULT_SYNCER_NETWORK_BPS = 10e9
"""10 Gbit/s each way: an assumption (a data-centre NIC), not a measurement."""

PROCESS_CORES = 1.0
"""Cores one syncer process keeps busy at most, whatever its machine has: its handlers and its
committer share one interpreter lock. The capacity benchmark's rows that did not keep up
(RESULTS "Syncer capacity", 2026-11-29: M = 24 and 32) used 1.04 and 1.00 of the 2 cores
there were. A shard is one process (``diloco syncer --shard I/S``)."""

RESOURCES = ("cores", "memory", "disk", "network")
"""What a shard must fit, in the order the plan reports them."""


def network_rate(text: str) -> float:
    """``--syncer-network``: bits per second as ``--link`` reads them (``10Gbps``, ``800mbit``;
    a bare number is Gbit/s)."""
    return parse_rate(text, bare_bps=GBIT_S)


@dataclass(frozen=True, kw_only=True)
class SyncerPlanInputs:
    """The syncer's side: how many learners it serves and what one shard's machine has (its
    shards needed are priced with costs measured on the 2-core reference machine)."""

    learners: int | None = option(None, metavar="M")
    """M, learners the syncer serves (each sends every fragment once per H steps); default:
    one per site (--sites)."""
    syncer_cores: float = option(2.0, metavar="CORES")
    """Cores one syncer shard can keep busy, as fast as the reference machine's (the default
    is that machine's)."""
    syncer_memory: int = option(DEFAULT_SYNCER_MEMORY, type=parse_size, metavar="SIZE")
    """Memory one syncer shard may hold (24GiB, 512GB, bytes; the default, in bytes, is the
    reference machine's)."""
    syncer_disk_mbps: float = option(DEFAULT_DISK_MB_S, metavar="MB_PER_S")
    """Megabytes per second one shard's disk writes and fsyncs (the default is measured on the
    reference machine)."""
    syncer_network: float = option(DEFAULT_SYNCER_NETWORK_BPS, type=network_rate, metavar="RATE")
    """One shard's network, each way, in bits per second (10Gbps, 800mbit; a bare number is
    Gbps; the default is assumed, not measured)."""
    commits_per_snapshot: int = same_option(SyncerConfig, "commits_per_snapshot")
    """K: a shard writes a full snapshot of a fragment every K commits (its 12 bytes per value
    amortised over them; 0: by bytes, ``diloco.syncer.snapshot_interval``) and journals the
    uploads of the others."""

    def __post_init__(self) -> None:
        if self.learners is not None and self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if not self.syncer_cores > 0 or not self.syncer_disk_mbps > 0:
            raise ValueError("syncer cores and disk MB/s must be > 0")
        if not self.syncer_memory > 0 or not self.syncer_network > 0:
            raise ValueError("syncer memory and network must be > 0")
        if self.commits_per_snapshot < 0:
            raise ValueError(f"commits_per_snapshot must be >= 0, got {self.commits_per_snapshot}")


@dataclass(frozen=True)
class SyncerCosts:
    """The costs one shard's load is priced with (defaults: the measured constants above)."""

    codec_cpu_ms_per_25m: dict[str, tuple[float, float]] = field(
        default_factory=lambda: dict(CODEC_CPU_MS_PER_25M_VALUES)
    )
    merge_s_per_value_per_contribution: float = MERGE_SECONDS_PER_VALUE_PER_CONTRIBUTION
    outer_s_per_value: float = OUTER_SECONDS_PER_VALUE
    persist_s_per_byte: float = PERSIST_SECONDS_PER_BYTE
    wire_s_per_byte: float = WIRE_SECONDS_PER_BYTE
    journal_bytes_per_upload_byte: float = JOURNAL_BYTES_PER_UPLOAD_BYTE
    snapshot_bytes_per_value: float = SNAPSHOT_BYTES_PER_VALUE
    held_bytes_per_param: float = SYNCER_BYTES_PER_PARAM
    decoded_bytes_per_value: float = DECODED_BYTES_PER_VALUE

    def encode_s(self, codec: str) -> float:
        """CPU seconds per value to encode with ``codec``."""
        return self.codec_cpu_ms_per_25m[codec][0] / 1e3 / 25e6

    def decode_s(self, codec: str) -> float:
        """CPU seconds per value to decode ``codec``."""
        return self.codec_cpu_ms_per_25m[codec][1] / 1e3 / 25e6


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """What the syncer's load depends on: the model, the fleet, the step and the codecs."""

    params: float
    """N."""
    num_fragments: int
    """P."""
    sync_every: int
    """H: each fragment is merged once per H fleet steps."""
    step_time_s: float
    """t, seconds per fleet step."""
    learners: float
    """M, uploads each commit merges (and learners its delta goes to); a measured mean may
    be fractional."""
    up_codec: str
    down_codec: str
    commits_per_snapshot: int
    """K."""


def codec_for_bits(bits: float) -> str:
    """The codec whose real bits per value (scales included) are nearest ``bits``: 4 → int4,
    1.25 → sign1, 2.25 → int2 (the plan's bits name the codec its syncer runs; ties: the
    first of ``CODECS``).

    >>> codec_for_bits(4), codec_for_bits(1.25), codec_for_bits(16)
    ('int4', 'sign1', 'bf16')
    """
    return min(CODECS, key=lambda c: abs(8 * bytes_per_value(c) - bits))


def durable_bytes_per_value(x: Exchange, costs: SyncerCosts) -> float:
    """Bytes a commit makes durable per value of its fragment, snapshots amortised over
    their interval: ``M·u·journal + snapshot/K`` (K: ``snapshot_every``)."""
    return journal_bytes_per_value(x, costs) + costs.snapshot_bytes_per_value / snapshot_every(
        x, costs
    )


def journal_bytes_per_value(x: Exchange, costs: SyncerCosts) -> float:
    """Bytes a commit's journal record writes per value of its fragment: ``M·u·journal``."""
    return x.learners * bytes_per_value(x.up_codec) * costs.journal_bytes_per_upload_byte


def snapshot_every(x: Exchange, costs: SyncerCosts) -> int:
    """K: the commits of a fragment between its snapshots (by bytes when the exchange's K is
    0: ``snapshot_interval.records_per_snapshot``)."""
    return records_per_snapshot(
        journal_bytes_per_value(x, costs), costs.snapshot_bytes_per_value, x.commits_per_snapshot
    )


def commit_cpu_s_per_value(
    x: Exchange, costs: SyncerCosts, durable_bytes: float | None = None
) -> float:
    """CPU seconds a commit costs per value of its fragment: M uploads received, decoded and
    merged, the outer step, the delta encoded and sent to M learners, ``durable_bytes`` per
    value made durable (default: :func:`durable_bytes_per_value`)."""
    up, down = bytes_per_value(x.up_codec), bytes_per_value(x.down_codec)
    durable = durable_bytes_per_value(x, costs) if durable_bytes is None else durable_bytes
    per_upload = (
        costs.decode_s(x.up_codec)
        + costs.merge_s_per_value_per_contribution
        + up * costs.wire_s_per_byte
    )
    return (
        x.learners * per_upload
        + costs.outer_s_per_value
        + costs.encode_s(x.down_codec)
        + x.learners * down * costs.wire_s_per_byte
        + durable * costs.persist_s_per_byte
    )


@dataclass(frozen=True)
class ShardLoad:
    """What the busiest of S shards needs (each rate per second, network in bits)."""

    shards: int
    fragments: int
    commits_per_s: float
    cores: float
    memory_bytes: float
    disk_bytes_per_s: float
    network_in_bps: float
    network_out_bps: float


def shard_load(x: Exchange, shards: int, costs: SyncerCosts | None = None) -> ShardLoad:
    """The load of the busiest of ``shards`` shards (it serves ``⌈P/S⌉`` fragments)."""
    if not 1 <= shards <= x.num_fragments:
        raise ValueError(f"shards must be in [1, P={x.num_fragments}], got {shards}")
    costs = costs or SyncerCosts()
    served = -(-x.num_fragments // shards)
    values = x.params / x.num_fragments
    commits = served / (x.sync_every * x.step_time_s)
    flow = commits * values  # values committed per second
    return ShardLoad(
        shards=shards,
        fragments=served,
        commits_per_s=commits,
        cores=flow * commit_cpu_s_per_value(x, costs),
        memory_bytes=served * values * costs.held_bytes_per_param
        + x.learners
        * (
            min(values, WHOLE_SPAN_VALUES) * costs.decoded_bytes_per_value
            + values * bytes_per_value(x.up_codec)
        ),
        disk_bytes_per_s=flow * durable_bytes_per_value(x, costs),
        network_in_bps=8 * flow * x.learners * bytes_per_value(x.up_codec),
        network_out_bps=8 * flow * x.learners * bytes_per_value(x.down_codec),
    )


def usable_cores(machine: SyncerPlanInputs) -> float:
    """The cores one shard can keep busy: the machine's, at most ``PROCESS_CORES``."""
    return min(machine.syncer_cores, PROCESS_CORES)


def use(load: ShardLoad, machine: SyncerPlanInputs) -> dict[str, float]:
    """Each resource's share of one shard's machine that ``load`` takes (network: the busier
    direction); a resource fits at most 1."""
    return {
        "cores": load.cores / usable_cores(machine),
        "memory": load.memory_bytes / machine.syncer_memory,
        "disk": load.disk_bytes_per_s / (machine.syncer_disk_mbps * 1e6),
        "network": max(load.network_in_bps, load.network_out_bps) / machine.syncer_network,
    }


def shards_needed(x: Exchange, machine: SyncerPlanInputs, costs: SyncerCosts | None = None) -> dict:
    """The fewest shards S in ``[1, P]`` whose busiest shard fits ``machine``, per resource
    and overall, and the resource that binds: of those that need S, the most used at S (when
    no S up to P fits a resource, ``shards`` is None and ``binds`` names it: one fragment is then too
    much for one shard's machine).

    Never fewer for more parameters, learners or a faster step (every load grows with
    them)."""
    costs = costs or SyncerCosts()
    loads = [shard_load(x, s, costs) for s in range(1, x.num_fragments + 1)]
    uses = [use(ld, machine) for ld in loads]
    per_resource: dict[str, int | None] = {
        r: next((ld.shards for ld, u in zip(loads, uses, strict=True) if u[r] <= 1), None)
        for r in RESOURCES
    }
    short = [r for r, s in per_resource.items() if s is None]
    overall = None if short else max(per_resource.values())
    at = (overall or x.num_fragments) - 1
    needing_most = [r for r in RESOURCES if per_resource[r] == overall]
    binding = short[0] if short else max(needing_most, key=lambda r: uses[at][r])
    return {
        "shards": overall,
        "binds": binding,
        "shards_per_resource": per_resource,
        "commits_per_s": x.num_fragments / (x.sync_every * x.step_time_s),
        "values_per_fragment": x.params / x.num_fragments,
        "durable_bytes_per_commit": durable_bytes_per_value(x, costs) * x.params / x.num_fragments,
        "snapshot_every": snapshot_every(x, costs),
        "whole": asdict(loads[0]),
        "per_shard": asdict(loads[at]),
        "per_shard_use": uses[at],
        "exchange": asdict(x),
        "machine": asdict(machine),
        "measured_on": REFERENCE_MACHINE,
    }


def syncer_lines(section: dict) -> list[str]:
    """The plan's syncer section (:func:`shards_needed`'s dict) as the lines ``diloco plan``
    prints."""
    x, machine = section["exchange"], SyncerPlanInputs(**section["machine"])
    whole, shard = section["whole"], section["per_shard"]
    period = 1.0 / section["commits_per_s"]
    need = section["shards_per_resource"]
    counts = ", ".join(f"{r} {need[r] if need[r] is not None else 'none'}" for r in RESOURCES)
    lines = [
        f"  syncer (M={x['learners']} learners, {x['up_codec']} up / {x['down_codec']} down, "
        f"P={x['num_fragments']}, H={x['sync_every']}, a snapshot every "
        f"{section['snapshot_every']} commits{'' if x['commits_per_snapshot'] else ', by bytes'}):",
        f"    due: {section['commits_per_s']:.3g} commits/s (a fragment of "
        f"{_count(section['values_per_fragment'])} values every {period:.3g} s), "
        f"{_bytes(section['durable_bytes_per_commit'])} made durable per commit",
        f"    one process would need {whole['cores']:.3g} cores, {_bytes(whole['memory_bytes'])}, "
        f"{_bytes(whole['disk_bytes_per_s'])}/s to disk, "
        f"{whole['network_in_bps'] / 1e9:.3g} Gbps in / {whole['network_out_bps'] / 1e9:.3g} out",
    ]
    if section["shards"] is None:
        lines.append(
            f"    shards needed: none of 1..{x['num_fragments']} fits ({counts}): one fragment "
            f"is too much for one shard's {section['binds']}; give each shard more, or raise "
            "--fragments or --sync-every"
        )
    else:
        lines.append(
            f"    shards needed: {section['shards']} ({counts}); {section['binds']} binds "
            f"({section['per_shard_use'][section['binds']]:.0%} of a shard's)"
        )
        who = (
            f"each of {shard['shards']} shards ({shard['fragments']} fragments at most)"
            if shard["shards"] > 1
            else f"one shard ({shard['fragments']} fragments)"
        )
        lines.append(
            f"    {who}: "
            f"{shard['cores']:.3g} of {_cores(machine)}, "
            f"{_bytes(shard['memory_bytes'])} of {_bytes(machine.syncer_memory)}, "
            f"{shard['disk_bytes_per_s'] / 1e6:.3g} of {machine.syncer_disk_mbps:g} MB/s, "
            f"{max(shard['network_in_bps'], shard['network_out_bps']) / 1e9:.3g} of "
            f"{machine.syncer_network / 1e9:g} Gbps"
        )
    lines.append(
        f"    costs measured on {REFERENCE_MACHINE}: CPU scales with your cores' speed; memory "
        f"at {SYNCER_BYTES_PER_PARAM:g} bytes/parameter, what a syncer holds today"
    )
    return lines


def _cores(machine: SyncerPlanInputs) -> str:
    """``2 cores``, or ``1 core (one process's, of 2)`` where the process limit binds."""
    usable = usable_cores(machine)
    if usable < machine.syncer_cores:
        return f"{usable:g} core (one process's, of {machine.syncer_cores:g})"
    return f"{usable:g} cores"


def _count(n: float) -> str:
    """``41.7M``, ``4.17B``: a count to three digits."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _bytes(n: float) -> str:
    """``88.5 MB``, ``27.7 GB``: bytes to three digits, decimal units."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"

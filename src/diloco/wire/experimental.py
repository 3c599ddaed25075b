"""Experiments: exchanges we measured that are not a named ``--comms`` setting.

No configuration picks one by default or by name (``diloco.wire.comms`` holds those); a run
reaches one only when its H and codecs are given by hand (``--up-codec topk2``). They stay
for the benchmarks that compare against them and for further experiments; what each costs
is in benchmarks/RESULTS.md ("Beyond the paper: Muon and sparse exchanges").
"""

from __future__ import annotations

from diloco.wire.comms import CommsSetting

FORMER_DEFAULT = CommsSetting(24, "int4", "int8")
"""The default until 2026-11-27 (``--sync-every 24 --up-codec int4 --down-codec int8``: 87×
fewer bytes per token than data-parallel): the measurements made before the change, and the
bench sweep's reference, start from it so that they stay comparable."""

EXPERIMENTAL_CODECS: dict[str, str] = {
    "topk2": "sparse: each chunk of 1,024 values sends its 32 largest, 2 bits each (0.078 "
    "bytes per value); both ways at H = 24 its held-out loss is 47% above the former "
    "default's (847x fewer bytes than data-parallel); up only, with int4 down, 7.5% above",
}
"""The codecs no named setting uses, and what they were measured to cost. A run may still
name one (``diloco.algorithm.codecs.CODECS`` has them all)."""

SPARSE = CommsSetting(FORMER_DEFAULT.sync_every, "topk2", "topk2")
"""topk2 both ways on the former default's H (bench_quality's ``sparse``)."""
SPARSE_UP = CommsSetting(FORMER_DEFAULT.sync_every, "topk2", "int4")
"""topk2 up, int4 down (bench_quality's ``sparse-up``)."""

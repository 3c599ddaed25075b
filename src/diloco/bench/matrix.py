"""The benchmark matrix as data: which ``diloco run`` invocations ``diloco bench`` makes. Pure.

Conditions (every mode sees the same recipe, seeds, learners and batch sizes):

* ``clean``: no faults, every learner trains ``steps`` steps, so every mode trains the same
  number of tokens (M × steps × batch × context) on the same lr schedule: loss at equal tokens.
* ``chaos``: ``minutes`` of wall time under the chaos spec (kills by default, which every mode
  can carry out): goodput and loss at equal wall time.
* ``slow``: ``minutes`` of wall time with learner 1 three times slower: tokens/s.

The sweep runs decoupled mode, clean, over H × upload codec: the quality/bandwidth trade-off,
plus a few low-bandwidth settings beyond that grid (``LOW_BANDWIDTH``: int4 both ways at
H = 96, decoupled and synchronous), where downloads, not uploads, dominate the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.runtime.schema import option
from diloco.wire.experimental import FORMER_DEFAULT

MODES = ("decoupled", "sync", "dp")
CONDITIONS = ("clean", "chaos", "slow")
PEERS = ("torchft",)
DEFAULT_CHAOS = "kill:mtbf=60s,down=5-15s"
SWEEP_H = (24, 48, 96)
SWEEP_CODECS = ("fp32", "bf16", "int4")
SWEEP_KEYS = ("mode", "H", "up_codec", "down_codec")
"""What identifies a sweep row (the sweep settings plus the mode)."""
LOW_BANDWIDTH = (("decoupled", 96, "int4", "int4"), ("sync", 96, "int4", "int4"))
"""(mode, H, up codec, down codec) runs added to the sweep's grid."""
SWEEP_REFERENCE = {
    "mode": "decoupled",
    "H": FORMER_DEFAULT.sync_every,
    "up_codec": FORMER_DEFAULT.up_codec,
    "down_codec": FORMER_DEFAULT.down_codec,
}
"""The configuration the sweep's losses are compared with: the default until 2026-11-27
(H = 24, int4 up, int8 down; on the sweep's grid), so its rows stay comparable with the
measurements before the default changed."""


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How much each run trains: ``steps`` per learner (clean) or ``minutes`` (chaos, slow).
    Each option is also a flag of ``diloco bench``."""

    learners: int = option(4, short="-m", metavar="M")
    """M, learners (or data-parallel ranks) per run."""
    steps: int = option(800)
    """Clean condition: steps per learner."""
    minutes: float = option(4.0)
    """Chaos and slow conditions: wall time per run, minutes."""
    recipe: str = option("shakespeare")
    """Model and data of every run (``diloco run --recipe``)."""
    chaos: str = option(DEFAULT_CHAOS, metavar="SPEC")
    """The chaos condition's failures (``diloco run --chaos`` spec)."""
    slow_factor: float = 3.0
    """Slow condition: learner 1 takes this many times as long per step."""
    eval_every: float = option(10.0, metavar="SECONDS")
    """Seconds between evaluations of the global model."""
    wan: tuple[str, ...] = option((), metavar="SPEC")
    """Every run on shaped links, as ``diloco run --wan`` (every learner on a shaped link;
    repeatable; root only)."""


@dataclass(frozen=True)
class RunSpec:
    """One ``diloco run`` of the matrix (or of the torchft peer when ``peer`` is set)."""

    name: str
    mode: str
    condition: str
    seed: int
    flags: tuple[str, ...]
    sweep: dict = field(default_factory=dict, compare=False, hash=False)
    peer: str = ""


def condition_flags(condition: str, budget: Budget) -> tuple[str, ...]:
    if condition == "clean":
        # generous wall-clock cap: the run ends when every learner did its steps
        return (f"--steps={budget.steps}", f"--minutes={max(budget.minutes, 1.0) * 10}")
    if condition == "chaos":
        return (f"--minutes={budget.minutes}", f"--chaos={budget.chaos}")
    if condition == "slow":
        return (f"--minutes={budget.minutes}", f"--slow=1={budget.slow_factor}")
    raise ValueError(f"unknown condition {condition!r}; choose from {', '.join(CONDITIONS)}")


def common_flags(budget: Budget, seed: int) -> tuple[str, ...]:
    return (
        f"--recipe={budget.recipe}",
        f"--learners={budget.learners}",
        f"--seed={seed}",
        f"--eval-every={budget.eval_every}",
        *(f"--wan={spec}" for spec in budget.wan),
    )


def matrix(
    modes: list[str], conditions: list[str], seeds: list[int], budget: Budget, peers=()
) -> list[RunSpec]:
    """Every (mode, condition, seed) run, in an order that finishes whole seeds first."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for peer in peers:
        if peer not in PEERS:
            raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    if budget.learners < 2 and "slow" in conditions:
        raise ValueError("the slow condition needs at least 2 learners")
    runs = []
    for seed in seeds:
        for condition in conditions:
            for mode in modes:
                flags = (f"--mode={mode}", *common_flags(budget, seed))
                flags += condition_flags(condition, budget)
                runs.append(RunSpec(f"{mode}-{condition}-s{seed}", mode, condition, seed, flags))
            for peer in peers:
                if condition != "chaos":  # the peer has no fault injection of ours
                    runs.append(
                        RunSpec(f"{peer}-{condition}-s{seed}", peer, condition, seed, (), peer=peer)
                    )
    return runs


def parse_setting(text: str) -> tuple[str, int, str, str]:
    """``mode:H:up:down`` (e.g. ``sync:96:int4:int4``) as a sweep setting; ``ValueError`` if
    it is not one."""
    parts = text.strip().split(":")
    if len(parts) != 4 or parts[0] not in MODES[:2]:
        raise ValueError(f"a sweep setting is decoupled|sync:H:up:down, got {text!r}")
    mode, h, up, down = parts
    if not h.isdigit() or int(h) < 1:
        raise ValueError(f"H must be a positive integer in {text!r}")
    return mode, int(h), up, down


def sweep(budget: Budget, seed: int, hs=SWEEP_H, codecs=SWEEP_CODECS, only=None) -> list[RunSpec]:
    """Clean runs: decoupled over (H, upload codec) with bf16 downloads, then
    ``LOW_BANDWIDTH``; with ``only`` (a collection of ``(mode, H, up, down)``), just those
    settings (which need not be on the grid)."""
    down = SWEEP_REFERENCE["down_codec"]
    settings = [("decoupled", h, codec, down) for h in hs for codec in codecs]
    settings += list(LOW_BANDWIDTH)
    if only is not None:
        settings = list(only)
    runs = []
    for mode, h, up, down in settings:
        flags = (f"--mode={mode}", *common_flags(budget, seed))
        flags += condition_flags("clean", budget)
        flags += (f"--sync-every={h}", f"--up-codec={up}", f"--down-codec={down}")
        grid = (mode, down) == ("decoupled", "bf16")
        name = f"sweep-H{h}-{up}-s{seed}" if grid else f"sweep-{mode}-H{h}-{up}-{down}-s{seed}"
        runs.append(
            RunSpec(
                name,
                mode,
                "clean",
                seed,
                flags,
                sweep={"H": h, "up_codec": up, "down_codec": down},
            )
        )
    return runs

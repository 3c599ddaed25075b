"""Named communication settings: ``--comms default|low|lowest``, picked by the link a site has.

Only the named settings live here; exchanges measured beside them (the former default, the
sparse ``topk2`` codec) are experiments, in ``diloco.wire.experimental``.

A setting fixes the three things that size the exchange: H (each fragment leaves every H inner
steps), the codec of the learners' outer gradients (up) and that of the merged changes the
syncer broadcasts (down), and with the latter whether the syncer keeps the down codec's
rounding for the next delta (down feedback). ``ProtocolConfig.comms`` names one; any of them
given explicitly beside it wins (``--comms lowest --sync-every 64``). The measurements behind each
(held-out loss against data-parallel, bytes per token) are in benchmarks/RESULTS.md
("Named communication settings"); ``diloco plan`` says which one a link needs.

A learner given ``--comms NAME`` by hand treats it as its link's budget: it refuses (exits
non-zero, one line) a syncer whose exchange costs more bytes per parameter per step than
NAME's (:func:`check_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.algorithm.codec_sizes import check_codec, encoded_nbytes


@dataclass(frozen=True)
class CommsSetting:
    sync_every: int
    """H."""
    up_codec: str
    """The learners' outer gradients (``diloco.algorithm.codecs``)."""
    down_codec: str
    """The merged changes the syncer broadcasts."""
    down_feedback: bool = True
    """Whether the syncer keeps the down codec's rounding for the next delta
    (``SyncerConfig.down_feedback``)."""

    def describe(self) -> str:
        """``H=16, sign1 up, int2 down`` (``, no down feedback`` when it is off)."""
        feedback = "" if self.down_feedback else ", no down feedback"
        return f"H={self.sync_every}, {self.up_codec} up, {self.down_codec} down{feedback}"


COMMS: dict[str, CommsSetting] = {
    "default": CommsSetting(16, "sign1", "int2"),
    "low": CommsSetting(24, "sign1", "sign1", down_feedback=False),
    "lowest": CommsSetting(128, "sign1w", "sign1w", down_feedback=False),
}
"""The named settings, densest first (``diloco plan`` recommends the first that fits)."""
DEFAULT_COMMS = "default"
"""What a configuration that names none uses."""
DEFAULT_SETTING = COMMS[DEFAULT_COMMS]
"""Its values: ``DEFAULT_SETTING.sync_every`` is the default H everywhere.

Until 2026-11-27 the default was H = 24, int4 up, int8 down (87× fewer bytes per token than
data-parallel); the default now sends about 211× fewer at the same held-out loss within the
noise (benchmarks/RESULTS.md, "The default at 200×"). ``diloco.wire.experimental`` keeps
those values (``FORMER_DEFAULT``) with the other measured exchanges that are no named
setting."""


COMMS_FIELDS = frozenset({"sync_every", "up_codec", "down_codec", "down_feedback"})
"""The configuration fields a named setting gives a value (``ProtocolConfig.sync_every``,
``SyncerConfig.up_codec``, ``down_codec`` and ``down_feedback``) when they are not given
themselves."""


def comms_setting(name: str | None) -> CommsSetting:
    """The setting called ``name`` (None: the default one); ``ValueError`` names the choices."""
    key = DEFAULT_COMMS if name is None else name
    if key not in COMMS:
        raise ValueError(f"--comms must be one of {', '.join(COMMS)} (got {name!r})")
    return COMMS[key]


def bytes_per_value(codec: str) -> float:
    """Wire bytes per parameter of ``codec`` for a large tensor (headers and scales included).

    >>> bytes_per_value("int4")
    0.53125
    """
    n = 1 << 20
    return encoded_nbytes(n, check_codec(codec)) / n


def exchange_bytes(sync_every: int, up_codec: str, down_codec: str) -> float:
    """Bytes one learner's link carries per parameter per inner step, both ways together:
    every fragment goes up and comes back once per H steps.

    >>> round(exchange_bytes(24, "int4", "int8"), 4)
    0.0651
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 (got {sync_every})")
    return (bytes_per_value(up_codec) + bytes_per_value(down_codec)) / sync_every


def setting_bytes(name: str) -> float:
    """:func:`exchange_bytes` of the named setting."""
    s = comms_setting(name)
    return exchange_bytes(s.sync_every, s.up_codec, s.down_codec)


class CommsBudgetError(ValueError):
    """A syncer whose exchange is heavier than the learner's ``--comms`` budget."""


def check_budget(name: str, *, sync_every: int, up_codec: str, down_codec: str) -> None:
    """Raise :class:`CommsBudgetError` if a syncer running H = ``sync_every`` with these codecs
    costs a learner's link more than setting ``name`` (a pure decision, checked at join)."""
    budget = setting_bytes(name)
    try:
        have = exchange_bytes(sync_every, up_codec, down_codec)
    except ValueError as exc:  # a codec this learner does not know, H < 1: not within it
        raise CommsBudgetError(f"the syncer's exchange cannot be priced: {exc}") from None
    if have > budget * (1 + 1e-9):
        raise CommsBudgetError(
            f"the syncer runs H={sync_every}, {up_codec} up, {down_codec} down: "
            f"{have / budget:.1f}x the traffic of --comms {name} this learner was given "
            f"(start the syncer with --comms {name}, or give the learner a larger setting)"
        )
